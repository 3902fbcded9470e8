"""The pipeline executor: content-addressed steps, skipping, reasons, kill safety, provenance, reproduce."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml
from data_fixtures import pipeline_docs

from shipyard.cli.main import main
from shipyard.errors import ConfigError
from shipyard.experiment.executor import load_pipeline, plan_pipeline, run_pipeline


def _pipeline(tmp_path, threshold=0.5, extra=()):
    pipeline_docs(tmp_path / "docs.jsonl")
    spec = {
        "root": "out",
        "steps": [
            {
                "name": "filter",
                "kind": "filter",
                "inputs": {"documents": "docs.jsonl"},
                "config": {"profile": "prose", "min_words": 5, "max_symbol_word_ratio": threshold},
            },
            {"name": "dedup", "kind": "dedup", "inputs": {"documents": "@filter"}},
            {
                "name": "tokenizer",
                "kind": "tokenizer-train",
                "inputs": {"documents": "@dedup"},
                "config": {"vocab_size": 300},
            },
            {
                "name": "tokens",
                "kind": "tokenize",
                "inputs": {"documents": "@dedup", "tokenizer": "@tokenizer"},
            },
            *extra,
        ],
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _plan(path, force=()):
    cfg, root, base = load_pipeline(path)
    return {p.step.name: p for p in plan_pipeline(cfg, root, base, tuple(force))}


def test_runs_then_skips_everything_then_reruns_exactly_downstream_of_a_change(tmp_path, capsys):
    path = _pipeline(tmp_path)
    first = {p.step.name: p for p in run_pipeline(path, log=lambda m: None)}
    assert all(p.status == "run" and p.reason == "new" for p in first.values())
    for p in first.values():
        assert (p.out / "_SUCCESS").is_file()
        prov = json.loads((p.out / "provenance.json").read_text())
        assert prov["step"]["name"] == p.step.name and prov["hash"] == p.hash
        assert prov["packages"]["jax"] and prov["host"]["name"] and prov["wall_seconds"] >= 0
        assert prov["artifacts"]
    assert json.loads((first["tokens"].out / "manifest.json").read_text())["shards"]

    again = _plan(path)
    assert all(p.status == "done" for p in again.values())

    changed = _plan(_pipeline(tmp_path, threshold=0.4))
    assert {n: p.status for n, p in changed.items()} == {n: "run" for n in changed}
    assert changed["filter"].reason == "config changed"
    assert changed["dedup"].reason == "input changed (documents)"
    assert changed["tokens"].reason == "input changed (documents, tokenizer)"
    # the earlier outputs stay where they were (content-addressed, nothing overwritten)
    assert all((p.out / "_SUCCESS").is_file() for p in first.values())

    assert main(["run", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "config changed" in out and "input changed (documents)" in out


def test_force_reruns_a_step_and_what_depends_on_it(tmp_path):
    path = _pipeline(tmp_path)
    run_pipeline(path, log=lambda m: None)
    forced = _plan(path, force=["dedup"])
    assert forced["filter"].status == "done"
    assert forced["dedup"].reason == "forced"
    assert forced["tokenizer"].status == forced["tokens"].status == "run"
    with pytest.raises(ConfigError, match="--force nope: no such step"):
        _plan(path, force=["nope"])


def test_a_killed_step_leaves_no_marker_and_is_redone(tmp_path):
    train = {
        "name": "train",
        "kind": "train",
        "inputs": {"train_tokens": "@tokens"},
        "config": {
            "preset": "tiny",
            "overrides": ["model.vocab_size=300", "train.steps=100000", "data.seq_len=32"],
        },
    }
    path = _pipeline(tmp_path, extra=[train])
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    metrics = _plan(path)["train"].out / "metrics.jsonl"

    def start_and_kill_once(training):
        proc = subprocess.Popen(
            [sys.executable, "-m", "shipyard.cli", "run", str(path)], env=env, stdout=subprocess.DEVNULL
        )
        deadline = time.time() + 240
        while not training() and time.time() < deadline:
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    start_and_kill_once(metrics.exists)
    after = _plan(path)
    assert after["tokens"].status == "done"
    assert after["train"].status == "run" and after["train"].reason.startswith("incomplete")
    assert not (after["train"].out / "_SUCCESS").exists()
    # The next run clears the unfinished directory and runs the step again from the start.
    stale = after["train"].out / "left-over"
    stale.write_text("from the killed attempt")
    start_and_kill_once(lambda: not stale.exists() and metrics.exists())
    assert not stale.exists() and metrics.exists()
    assert not (after["train"].out / "_SUCCESS").exists()


def test_bad_pipelines_are_one_line_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"root": "o", "steps": [{"name": "a", "kind": "bake"}]}))
    with pytest.raises(ConfigError, match=r"steps.0.kind"):
        load_pipeline(bad)
    bad.write_text(
        yaml.safe_dump(
            {"root": "o", "steps": [{"name": "a", "kind": "dedup", "inputs": {"documents": "@b"}}]}
        )
    )
    with pytest.raises(ConfigError, match="unknown steps"):
        _plan(bad)
    cyc = [
        {"name": "a", "kind": "dedup", "inputs": {"documents": "@b"}},
        {"name": "b", "kind": "dedup", "inputs": {"documents": "@a"}},
    ]
    bad.write_text(yaml.safe_dump({"root": "o", "steps": cyc}))
    with pytest.raises(ConfigError, match="cycle"):
        _plan(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_pipeline(tmp_path / "missing.yaml")


@pytest.mark.slow
def test_quickstart_pipeline_beats_unigram(tmp_path):
    """The packaged quickstart, as `make quickstart` runs it: 600 steps reach 30% below the unigram
    baseline. That the same chain rerun gives the same bytes is tested on the 30-step version
    (tests/test_bucket_pipeline.py: every step's artifacts equal between two roots) and `reproduce`
    on data chains (test_reproduce_from_and_into_a_bucket): rerunning 600 steps here would only
    repeat them."""
    from importlib import resources

    pipeline = resources.files("shipyard").joinpath("pipelines", "quickstart.yaml")
    planned = run_pipeline(str(pipeline), root=tmp_path / "qs", log=lambda m: None)
    by = {p.step.name: p for p in planned}
    report = json.loads((by["eval"].out / "eval.json").read_text())
    assert report["bits_per_byte_vs_unigram"] <= 0.7  # at least 30% below the unigram baseline
    assert json.loads((by["sample"].out / "sample.json").read_text())["completion"]
    assert (by["export"].out / "model.safetensors").is_file()
    assert (by["report"].out / "plots" / "metrics.png").is_file()


@pytest.mark.slow
@pytest.mark.xdist_group("ray")  # one Ray cluster on the machine at a time (tests/xdist_schedule.py)
def test_ray_executor_runs_the_same_steps_with_the_same_artifacts(tmp_path, monkeypatch):
    pytest.importorskip("ray")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # no ~/.ray/auth_token left behind (see test_parallel)
    path = _pipeline(tmp_path)
    local = {p.step.name: p for p in run_pipeline(path, root=tmp_path / "local", log=lambda m: None)}
    on_ray = {
        p.step.name: p
        for p in run_pipeline(path, root=tmp_path / "ray", ray_address="local", log=lambda m: None)
    }
    for name, p in on_ray.items():
        assert (p.out / "_SUCCESS").is_file()
        ours = json.loads((p.out / "provenance.json").read_text())["artifacts"]
        theirs = json.loads((local[name].out / "provenance.json").read_text())["artifacts"]
        assert ours == theirs, name
    assert all(p.status == "done" for p in _plan_at(path, tmp_path / "ray").values())
    # the data steps' units ran as Ray tasks, not in a process pool inside the step's task
    data_steps = [p for p in on_ray.values() if p.step.kind in ("filter", "dedup", "tokenize")]
    assert data_steps
    for p in data_steps:
        stats = json.loads((p.out / "stats.json").read_text())
        assert stats["workers"] == "ray auto", p.step.name
        assert stats["ray_nodes"] and sum(stats["ray_tasks"].values()) >= 1, p.step.name  # where tasks ran


def _plan_at(path, root):
    cfg, _, base = load_pipeline(path)
    return {p.step.name: p for p in plan_pipeline(cfg, root.resolve(), base)}


def test_a_bad_step_config_fails_before_anything_runs(tmp_path):
    path = _pipeline(
        tmp_path,
        extra=[
            {
                "name": "t",
                "kind": "train",
                "inputs": {"train_tokens": "@tokens"},
                "config": {"overrides": ["model.num_kv_heads=3"]},
            }
        ],
    )
    with pytest.raises(ConfigError, match="num_kv_heads: 3 does not divide"):
        run_pipeline(path, log=lambda m: None)
    assert not (tmp_path / "out").exists()
    spec = yaml.safe_load(path.read_text())
    spec["steps"][0]["config"]["min_wrds"] = 3
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError, match=r"pipeline step filter \(filter\): min_wrds: unknown key"):
        run_pipeline(path, log=lambda m: None)


def test_the_packaged_quickstart_pipeline_validates_and_plans(tmp_path):
    from importlib import resources

    pipeline = resources.files("shipyard").joinpath("pipelines", "quickstart.yaml")
    planned = run_pipeline(str(pipeline), dry_run=True, root=tmp_path / "qs", log=lambda m: None)
    assert [p.step.name for p in planned][:2] == ["documents", "filter"]
    assert all(p.status == "run" and p.reason == "new" for p in planned)
    assert not (tmp_path / "qs").exists()  # a dry run writes nothing


def test_reproduce_reports_the_step_that_differs_and_exits_7(tmp_path, monkeypatch, capsys):
    """A tokenizer step that writes a random file (non-deterministic by construction): reproducing the
    chain reports it DIFFERENT, the steps before it and the tokenize step after it (which reads only
    tokenizer.json) identical, and exits 7. The same chain with the real step reproduces: exit 0."""
    from shipyard.experiment import steps

    real = steps.STEPS["tokenizer-train"]

    def noisy_tokenizer(out, inputs, config):
        result = real(out, inputs, config)
        (out / "noise.bin").write_bytes(os.urandom(16))
        return result

    path = _pipeline(tmp_path)
    monkeypatch.setitem(steps.STEPS, "tokenizer-train", noisy_tokenizer)
    tokens = {p.step.name: p for p in run_pipeline(path, log=lambda m: None)}["tokens"].out
    capsys.readouterr()
    assert main(["reproduce", str(tokens), "--root", str(tmp_path / "again")]) == 7
    out = capsys.readouterr().out
    verdicts = {
        line.split("]")[0][1:]: line.split("] ")[1].split(":")[0]
        for line in out.splitlines()
        if line.startswith("[") and ("identical:" in line or "DIFFERENT:" in line)
    }
    assert verdicts == {
        "filter": "identical",
        "dedup": "identical",
        "tokenizer": "DIFFERENT",
        "tokens": "identical",
    }
    assert "reproduce: 3 of 4 steps identical" in out

    monkeypatch.setitem(steps.STEPS, "tokenizer-train", real)
    tokens = {p.step.name: p for p in run_pipeline(path, root=tmp_path / "clean", log=lambda m: None)}
    assert main(["reproduce", str(tokens["tokens"].out), "--root", str(tmp_path / "again-clean")]) == 0
    assert "reproduce: 4 of 4 steps identical" in capsys.readouterr().out
