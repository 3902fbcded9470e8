"""The data CLI end to end: stages, prepare (skip / rerun), bad input, nothing half-written."""

import json

import pytest
from data_fixtures import mutate, prose, write_jsonl

from shipyard.cli.main import main


def _inputs(tmp_path):
    texts = [prose(s) for s in range(12)] + [mutate(prose(0), 0.01, 1), "too short"]
    good = write_jsonl(tmp_path / "a.jsonl", texts)
    return good


def _leftovers(d):
    return [p.name for p in d.iterdir() if ".tmp-" in p.name]


def test_filter_stage_cli_counts_bad_records_and_writes_stats(tmp_path, capsys):
    src = _inputs(tmp_path)
    with open(src, "a") as f:
        f.write("{broken json\n")
    code = main(["data", "filter", str(src), "--out", str(tmp_path / "f"), "--max-bad-fraction", "0.2"])
    assert code == 0
    stats = json.loads((tmp_path / "f" / "stats.json").read_text())
    assert stats["dropped"] == {"min_words": 1} and stats["documents_out"] == 13
    assert stats["bad_records"] == {"not valid JSON": 1}
    assert stats["bad_examples"] == [f"{src}:15: not valid JSON"]
    assert "14 → 13 documents" in capsys.readouterr().out
    # over the bad-record limit: exit 3, one line, no output and no temporary left behind
    code = main(["data", "filter", str(src), "--out", str(tmp_path / "g"), "--max-bad-fraction", "0"])
    err = capsys.readouterr().err
    assert code == 3 and err.count("\n") == 1 and "1 of 15 records were bad" in err
    assert not (tmp_path / "g").exists() and not _leftovers(tmp_path)
    # existing output is not replaced without --overwrite
    assert main(["data", "filter", str(src), "--out", str(tmp_path / "f")]) == 3
    assert "already exists" in capsys.readouterr().err


def test_bad_settings_are_one_line(tmp_path, capsys):
    src = _inputs(tmp_path)
    assert main(["data", "filter", str(src), "--out", str(tmp_path / "o"), "--set", "min_wrds=3"]) == 2
    err = capsys.readouterr().err
    assert "min_wrds: unknown key" in err and err.count("\n") == 1
    assert main(["data", "dedup", str(src), "--out", str(tmp_path / "o"), "--set", "threshold=2"]) == 2
    assert "threshold" in capsys.readouterr().err
    assert main(["data", "filter", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o")]) == 3
    assert "no such file" in capsys.readouterr().err
    assert (
        main(["data", "tokenize", str(src), "--out", str(tmp_path / "o"), "--tokenizer", str(tmp_path)]) == 3
    )
    assert "tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_stage_that_fails_midway_leaves_nothing(tmp_path, monkeypatch):
    from shipyard.data import filters

    src = write_jsonl(tmp_path / "big.jsonl", [prose(s) for s in range(600)])
    calls = {"n": 0}
    real = filters.filter_batch

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("worker died")
        return real(batch)

    monkeypatch.setattr(filters, "filter_batch", flaky)
    from shipyard.data.configs import FilterConfig, ReadConfig

    with pytest.raises(RuntimeError):
        filters.run_filter([str(src)], tmp_path / "out", FilterConfig(), ReadConfig(), workers=1)
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path)


def _prepare_config(tmp_path, min_words=50):
    src = _inputs(tmp_path)
    val = write_jsonl(tmp_path / "val.jsonl", [prose(100 + s) for s in range(3)])
    ev = write_jsonl(tmp_path / "eval.jsonl", [prose(5)[:400]])
    cfg = tmp_path / "prepare.yaml"
    cfg.write_text(
        f"inputs: [{src.name}]\nvalidation_inputs: [{val.name}]\nout: out\nworkers: 1\n"
        f"filter: {{min_words: {min_words}}}\n"
        f"decontaminate: {{eval_sets: [{ev.name}]}}\n"
        "tokenizer: {vocab_size: 320}\n"
        "tokenize: {shard_tokens: 1000}\n"
    )
    return cfg


def test_prepare_runs_the_chain_skips_when_done_and_reruns_downstream(tmp_path, capsys):
    cfg = _prepare_config(tmp_path)
    assert main(["data", "prepare", str(cfg)]) == 0
    out = capsys.readouterr().out
    stages = [
        "01-filter",
        "02-dedup",
        "03-decontaminate",
        "04-tokenizer",
        "05-tokenize-train",
        "06-tokenize-validation",
    ]
    assert all(f"[{s}]" in out for s in stages) and "done already" not in out
    root = tmp_path / "out"
    assert json.loads((root / "02-dedup" / "stats.json").read_text())["dropped"]["fuzzy_duplicate"] == 1
    assert json.loads((root / "03-decontaminate" / "stats.json").read_text())["contaminated_documents"] == 1
    manifest = json.loads((root / "05-tokenize-train" / "manifest.json").read_text())
    assert manifest["documents"] == 11 and manifest["vocab_size"] == 320
    assert main(["data", "verify", str(root / "06-tokenize-validation")]) == 0
    capsys.readouterr()

    assert main(["data", "prepare", str(cfg)]) == 0
    assert capsys.readouterr().out.count("done already") == len(stages)

    # a changed filter threshold is refused without --overwrite, then reruns filter and everything after
    assert main(["data", "prepare", str(cfg), "--set", "filter.min_words=1"]) == 3
    assert "--overwrite" in capsys.readouterr().err
    assert main(["data", "prepare", str(cfg), "--set", "filter.min_words=1", "--overwrite"]) == 0
    out = capsys.readouterr().out
    assert all(f"[{s}] done already" not in out for s in stages[:5])
    assert (
        "[06-tokenize-validation] done already" not in out
    )  # the tokenizer changed, so validation reruns too
    assert json.loads((root / "05-tokenize-train" / "manifest.json").read_text())["documents"] == 12
