"""Data stages on a real multi-node Ray cluster (a head without CPUs and two worker nodes, each started
from its own working directory): every output file equals the local run's byte for byte, and each
stage's stats.json names the worker nodes its tasks ran on (the local run's names none)."""

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from data_fixtures import mutate, prose, write_jsonl

from shipyard.data.sources import STAGE_TAG

# (xdist_group: one Ray cluster on the machine at a time, tests/xdist_schedule.py)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
SHIPYARD = os.path.join(os.path.dirname(sys.executable), "shipyard")
# where and how fast it ran: not part of the output
HOST_FIELDS = ("seconds", "mb_per_s", "workers", "ray_nodes", "ray_tasks")


@dataclass
class Cluster:
    """The Ray cluster the tests share."""

    address: str
    workers: set[str] = field(default_factory=set)
    """The ids of the worker nodes the test started (the head, without CPUs, is not one)."""


def _start_worker(cluster: Cluster, cwd: Path) -> None:
    """A one-CPU worker node started from a new directory `cwd`, under an id of the test's choosing
    (Ray's own test clusters set it the same way), so a stage's stats.json can be checked against it."""
    cwd.mkdir()
    node = [RAY, "start", f"--address={cluster.address}", "--num-cpus=1", "--disable-usage-stats"]
    # Once more on a refusal (with an id of its own): under a loaded CI machine (three test workers on
    # two cores) one `ray start` failed to join; the second says why, if it fails too.
    for _ in range(2):
        node_id = os.urandom(28).hex()  # a NodeID's 28 bytes
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_OVERRIDE_NODE_ID_FOR_TESTING": node_id}
        done = subprocess.run(node, capture_output=True, text=True, timeout=180, env=env, cwd=cwd)
        if done.returncode == 0:
            cluster.workers.add(node_id)
            return
        time.sleep(5)
    raise AssertionError(f"ray start --address failed twice:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    pytest.importorskip("ray")
    from shipyard.parallel.launch import free_port

    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    port = free_port()
    base = tmp_path_factory.mktemp("ray")
    # no CPUs on the head: every unit task runs on a worker node, in a working directory of its own
    head = [RAY, "start", "--head", f"--port={port}", "--num-cpus=0", "--include-dashboard=false"]
    subprocess.run([*head, "--disable-usage-stats"], check=True, capture_output=True, timeout=180, env=env)
    try:
        cluster = Cluster(f"127.0.0.1:{port}")
        for n in (1, 2):
            _start_worker(cluster, base / f"node{n}")
        yield cluster
    finally:
        subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120, env=env)


def _ran_on_workers(stats_json: Path, cluster: Cluster) -> dict:
    """The stage's stats: they name the nodes its tasks ran on, each a worker node the test started
    (a stage that ran its units in a local pool names none), and count the tasks on each."""
    stats = json.loads(stats_json.read_text())
    nodes = stats.get("ray_nodes")
    assert nodes, f"{stats_json}: no ray_nodes: the {stats['stage']} units did not run on the cluster"
    assert set(nodes) <= cluster.workers, f"{stats_json}: ran on {nodes}, not worker nodes {cluster.workers}"
    tasks = stats["ray_tasks"]
    assert nodes == sorted(tasks) and min(tasks.values()) >= 1, stats_json
    # each part is one unit task's output: fewer tasks than parts means units ran elsewhere
    assert sum(tasks.values()) >= len(stats.get("parts", [])), stats_json
    return stats


def _shipyard(*args, cwd, env=None):
    r = subprocess.run(
        [SHIPYARD, *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "RAY_AUTH_MODE": "disabled", **(env or {})},
    )
    return r


def _corpus(d: Path) -> None:
    """Three inputs over 1 MB each (three work units), near-duplicates planted across them."""
    for f in range(3):
        texts = [prose(1000 * f + s, words=400) for s in range(500)]
        if f:
            texts += [mutate(prose(s, words=400), 0.02, 7 + f) for s in range(0, 40, f + 1)]
        write_jsonl(d / f"in{f}.jsonl", texts)


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _same_output(a: Path, b: Path) -> None:
    """`a`, a local run's output, holds the same files as `b`'s (host fields aside); its stats name
    no Ray node."""
    fa, fb = _files(a), _files(b)
    assert sorted(fa) == sorted(fb)
    for name in fa:
        if name.endswith(".json"):  # stats, manifests and summaries name the run's own directories
            # the stages downstream record their input directory: the same name under each root
            ja = json.loads(fa[name].decode().replace(str(a), "ROOT"))
            jb = json.loads(fb[name].decode().replace(str(b), "ROOT"))
            assert "ray_nodes" not in ja and "ray_tasks" not in ja, name
            for j in (ja, jb):
                for k in HOST_FIELDS:
                    j.pop(k, None)
                for stage in j.get("stages", {}).values() if isinstance(j.get("stages"), dict) else ():
                    for k in HOST_FIELDS:
                        stage.pop(k, None)
            assert ja == jb, name
        else:
            assert fa[name] == fb[name], name


def test_prepare_on_a_cluster_writes_what_the_local_run_writes(ray_cluster, tmp_path):
    _corpus(tmp_path)
    write_jsonl(tmp_path / "val.jsonl", [prose(9000 + s) for s in range(5)])
    write_jsonl(tmp_path / "eval.jsonl", [prose(1003, words=400)[:600]])
    (tmp_path / "prepare.yaml").write_text(
        "inputs: [in0.jsonl, in1.jsonl, in2.jsonl]\nvalidation_inputs: [val.jsonl]\nout: local\n"
        "filter: {min_words: 50}\ndecontaminate: {eval_sets: [eval.jsonl]}\n"
        "tokenizer: {vocab_size: 320}\ntokenize: {shard_tokens: 100000}\n"
    )
    local = _shipyard("data", "prepare", "prepare.yaml", "--set", "workers=2", cwd=tmp_path)
    assert local.returncode == 0, local.stderr
    # relative inputs and outputs: each task works in the driver's directory (a shared filesystem)
    ray = _shipyard(
        "data", "prepare", "prepare.yaml", "--set", "out=onray", "--ray", ray_cluster.address, cwd=tmp_path
    )
    assert ray.returncode == 0, ray.stderr
    stages = {p.parent.name: p for p in (tmp_path / "onray").glob("*/stats.json")}
    assert sorted(stages) == [
        "01-filter",
        "02-dedup",
        "03-decontaminate",
        "04-tokenizer",
        "05-tokenize-train",
        "06-tokenize-validation",
    ]
    # every stage but tokenizer-train (one process, no units) ran its tasks on the worker nodes
    ran = {name: _ran_on_workers(p, ray_cluster) for name, p in stages.items() if name != "04-tokenizer"}
    dedup, decon = ran["02-dedup"], ran["03-decontaminate"]
    assert dedup["workers"] == f"ray {ray_cluster.address}"
    assert dedup["dropped"]["fuzzy_duplicate"] >= 20  # the planted near-duplicates, across files
    assert decon["documents_out"] < decon["documents_in"]
    _same_output(tmp_path / "local", tmp_path / "onray")


def test_a_bucket_output_is_uploaded_by_the_tasks_marker_last(ray_cluster, tmp_path, bucket, s3_env):
    _corpus(tmp_path)
    inputs = ["in0.jsonl", "in1.jsonl", "in2.jsonl"]
    local = _shipyard("data", "filter", *inputs, "--out", "f", "--workers", "2", cwd=tmp_path)
    assert local.returncode == 0, local.stderr
    url = f"{bucket}/filtered"
    ray = _shipyard(
        "data", "filter", *inputs, "--out", url, "--ray", ray_cluster.address, cwd=tmp_path, env=s3_env
    )
    assert ray.returncode == 0, ray.stderr
    from shipyard import storage

    fetched = storage.download_dir(url, tmp_path / "fetched")
    marker = json.loads((fetched / storage.MARKER).read_text())
    parts = sorted(n for n in marker["files"] if n.startswith("part-"))
    assert len(parts) >= 3 and parts == sorted(p.name for p in (tmp_path / "f").glob("part-*"))
    _ran_on_workers(fetched / "stats.json", ray_cluster)
    for name in (storage.MARKER, STAGE_TAG):
        (fetched / name).unlink(missing_ok=True)
    _same_output(tmp_path / "f", fetched)


def test_an_address_without_a_cluster_is_one_line(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [prose(1)])
    from shipyard.parallel.launch import free_port

    r = _shipyard(
        "data", "filter", "a.jsonl", "--out", "f", "--ray", f"127.0.0.1:{free_port()}", cwd=tmp_path
    )
    assert r.returncode != 0 and not (tmp_path / "f").exists()
    assert "no Ray cluster answers there" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def _extra_node(cluster: Cluster, cwd: Path) -> int:
    """Another one-CPU worker node; the pid of its raylet (to kill)."""
    before = set(subprocess.run(["pgrep", "-x", "raylet"], capture_output=True, text=True).stdout.split())
    _start_worker(cluster, cwd)
    after = set(subprocess.run(["pgrep", "-x", "raylet"], capture_output=True, text=True).stdout.split())
    (pid,) = after - before
    return int(pid)


def _busy(raylet: int) -> bool:
    """Whether a worker process of that raylet's node is running a unit task right now (Ray titles
    a worker `ray::<function>` while it runs one, `ray::IDLE` otherwise)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != raylet:
                continue
            if (stat.parent / "cmdline").read_bytes().startswith(b"ray::_run_unit"):
                return True
        except (OSError, IndexError, ValueError):
            continue
    return False


def _kill_when(proc: subprocess.Popen, ready, raylet: int) -> None:
    """SIGKILL `raylet` as soon as `ready()` holds and its node runs a unit task, while `proc` (the
    stage) still runs: a task is always lost, and Ray must run it again elsewhere."""
    import signal
    import time

    deadline = time.time() + 300
    while not (ready() and _busy(raylet)):
        assert proc.poll() is None, "the stage ended before the node could be killed"
        assert time.time() < deadline
        time.sleep(0.002)
    os.kill(raylet, signal.SIGKILL)


def _many_units(d: Path) -> list[str]:
    """Six inputs over 1 MB each (six work units), near-duplicates planted across them."""
    names = []
    for f in range(6):
        texts = [prose(1000 * f + s, words=400) for s in range(420)]
        texts += [mutate(prose(s, words=400), 0.02, 7 + f) for s in range(0, 60, f + 1)]
        names.append(write_jsonl(d / f"in{f}.jsonl", texts).name)
    return names


def test_a_node_killed_during_the_dedup_shuffle_and_during_tokenize_changes_nothing(ray_cluster, tmp_path):
    """SIGKILL a worker node's raylet once dedup's shuffle has begun, and another's once tokenize
    has encoded its first unit: Ray reruns the lost tasks elsewhere and every output file equals the
    local run's (a killed node may be named among the nodes: the tasks it finished count)."""
    inputs = _many_units(tmp_path)
    env = {"RAY_AUTH_MODE": "disabled"}
    local = _shipyard("data", "dedup", *inputs, "--out", "local", "--workers", "2", cwd=tmp_path)
    assert local.returncode == 0, local.stderr
    raylet = _extra_node(ray_cluster, tmp_path / "node3")
    cmd = [SHIPYARD, "data", "dedup", *inputs, "--out", "onray", "--ray", ray_cluster.address]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
    _kill_when(proc, lambda: (tmp_path / ".onray.partial" / "_dedup" / "bands").exists(), raylet)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert json.loads((tmp_path / "local" / "stats.json").read_text())["dropped"]["fuzzy_duplicate"] >= 50
    _same_output(tmp_path / "local", tmp_path / "onray")
    _ran_on_workers(tmp_path / "onray" / "stats.json", ray_cluster)

    tok = _shipyard(
        "data", "tokenizer-train", "local", "--out", "tok", "--set", "vocab_size=300", cwd=tmp_path
    )
    assert tok.returncode == 0, tok.stderr
    shard = ["--tokenizer", "tok", "--set", "shard_tokens=20000"]
    local = _shipyard("data", "tokenize", "local", "--out", "shards", "--workers", "2", *shard, cwd=tmp_path)
    assert local.returncode == 0, local.stderr
    raylet = _extra_node(ray_cluster, tmp_path / "node4")
    cmd = [SHIPYARD, "data", "tokenize", "local", "--out", "rayshards", "--ray", ray_cluster.address, *shard]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
    _kill_when(proc, lambda: any(tmp_path.glob(".rayshards.partial/_tokens/*.bin")), raylet)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    _same_output(tmp_path / "shards", tmp_path / "rayshards")
    _ran_on_workers(tmp_path / "rayshards" / "stats.json", ray_cluster)


PAGE = """<!DOCTYPE html><html><head><title>{title}</title><script>var t = 1;</script></head>
<body><nav><a href="/">Home</a> | <a href="/about">About</a></nav>
<main><article><h1>{title}</h1><p>{body}</p></article></main>
<footer>Copyright 2026 Example Corp.</footer></body></html>"""


def test_extract_and_classify_on_a_cluster_write_what_the_local_run_writes(ray_cluster, tmp_path):
    pytest.importorskip("fasttext")
    import random

    for d in range(2):
        site = tmp_path / "site" / f"d{d}"
        site.mkdir(parents=True)
        for k in range(30):
            (site / f"p{k}.html").write_text(PAGE.format(title=f"Page {d}-{k}", body=prose(100 * d + k)))
    rng = random.Random(0)
    good = [prose(500 + s) for s in range(60)]
    bad = [" ".join(rng.sample(t.split(), len(t.split()))) for t in good]
    write_jsonl(tmp_path / "good.jsonl", good)
    write_jsonl(tmp_path / "bad.jsonl", bad)
    qc = ["data", "classifier-train", "--positive", "good.jsonl", "--negative", "bad.jsonl", "--out", "qc"]
    assert _shipyard(*qc, cwd=tmp_path).returncode == 0
    for where, flags in (("local", ["--workers", "2"]), ("onray", ["--ray", ray_cluster.address])):
        r = _shipyard("data", "extract", "site", "--out", f"{where}-extract", *flags, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        cls = ["data", "classify", "local-extract", "--model", "qc", "--out", f"{where}-classify"]
        r = _shipyard(*cls, "--top-fraction", "0.5", *flags, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
    for stage in ("extract", "classify"):
        _same_output(tmp_path / f"local-{stage}", tmp_path / f"onray-{stage}")
        _ran_on_workers(tmp_path / f"onray-{stage}" / "stats.json", ray_cluster)


def test_a_killed_driver_resumes_a_bucket_output_from_its_finished_units(
    ray_cluster, tmp_path, bucket, s3_env
):
    """The driver SIGKILLed while dedup writes to a bucket from the cluster: the partial output and
    its journal are in the bucket (unpublished), and the rerun skips the finished units (counted)
    and publishes what the local run writes (its stats name the nodes of the rerun's tasks)."""
    import re
    import signal
    import time

    from shipyard import storage

    inputs = _many_units(tmp_path)
    local = _shipyard("data", "dedup", *inputs, "--out", "local", "--workers", "2", cwd=tmp_path)
    assert local.returncode == 0, local.stderr
    url = f"{bucket}/dedup"
    cmd = [SHIPYARD, "data", "dedup", *inputs, "--out", url, "--ray", ray_cluster.address]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.time() + 300
    while "sketch-00001.json" not in storage.list_files(f"{url}/_resume"):
        assert proc.poll() is None and time.time() < deadline, "the stage ended before it could be killed"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not storage.is_published(url)
    done = sum(n.startswith("sketch-") for n in storage.list_files(f"{url}/_resume"))
    again = _shipyard(*cmd[1:], cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    resumed = re.search(r"data dedup: sketch: resuming: (\d+) of (\d+) units already done", again.stderr)
    assert resumed and int(resumed[1]) == done >= 2 and int(resumed[2]) == 12, again.stderr
    fetched = storage.download_dir(url, tmp_path / "fetched")
    assert not any(n.startswith(("_resume", "_dedup")) for n in storage.list_files(url))
    _ran_on_workers(fetched / "stats.json", ray_cluster)
    for name in (storage.MARKER, STAGE_TAG):
        (fetched / name).unlink(missing_ok=True)
    _same_output(tmp_path / "local", fetched)
