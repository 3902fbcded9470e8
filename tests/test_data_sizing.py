"""`shipyard plan data`: the dedup numbers follow the stage's own shuffle shapes, time falls with
nodes, and what does not fit says so."""

import json

from shipyard.cli.main import main
from shipyard.data.configs import DedupConfig
from shipyard.data.dedup import partitions_for
from shipyard.data.sizing import Cluster, Corpus, plan_data, units_for


def test_the_plan_uses_the_stages_own_unit_and_partition_counts():
    corpus = Corpus(10 * 10**12)
    plan = plan_data(corpus, Cluster(nodes=16))
    units, _ = units_for(corpus.bytes)
    dedup = plan["stages"]["dedup"]
    assert dedup["units"] == units and dedup["partitions"] == partitions_for(units, corpus.bytes)
    assert dedup["signature_bytes"] == corpus.documents * DedupConfig().num_perm * 4
    assert dedup["shuffle"]["bands"] == corpus.documents * 16 * (12 + 4 * 8)


def test_more_nodes_take_less_time_and_a_small_node_does_not_fit():
    corpus = Corpus(10 * 10**12)
    few, many = plan_data(corpus, Cluster(nodes=4)), plan_data(corpus, Cluster(nodes=8))
    for stage in ("extract", "filter", "dedup"):
        assert many["stages"][stage]["wall_s"] < few["stages"][stage]["wall_s"]
    small = plan_data(corpus, Cluster(nodes=4, memory_per_node=8 << 30))
    assert not small["fits"] and not small["stages"]["dedup"]["fits"]


def test_plan_data_on_the_command_line(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = main(["plan", "data", "--tokens", "15T", "--nodes", "64", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0 and "dedup" in text and "15.0T tokens" in text
    plan = json.loads(out.read_text())
    assert plan["corpus"]["tokens"] == 15 * 10**12 and plan["fits"]
    assert main(["plan", "data", "--bytes", "10TB", "--nodes", "2", "--memory-per-node", "4GiB"]) == 6
