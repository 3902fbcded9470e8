"""Pipeline roots in a bucket (moto_server on 127.0.0.1): steps staged locally and published with
their marker last, done iff the marker is in the bucket, upstream outputs fetched and checked, a
killed upload redone, reproduce from and to a bucket, no credentials in anything written."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from importlib import resources

import pytest
import yaml
from data_fixtures import pipeline_docs
from s3_fixtures import SECRET_KEY, FaultProxy

from shipyard import storage
from shipyard.cli.main import main
from shipyard.errors import ConfigError
from shipyard.experiment.executor import fetch_output, load_pipeline, plan_pipeline, run_pipeline


def _pipeline(tmp_path):
    """filter -> dedup on a small generated corpus (a few seconds)."""
    pipeline_docs(tmp_path / "docs.jsonl")
    steps = [
        {
            "name": "filter",
            "kind": "filter",
            "inputs": {"documents": "docs.jsonl"},
            "config": {"profile": "prose", "min_words": 5},
        },
        {"name": "dedup", "kind": "dedup", "inputs": {"documents": "@filter"}},
    ]
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump({"root": "out", "steps": steps}))
    return path


def _plan(path, root):
    cfg, resolved, base = load_pipeline(path, root)
    return {p.step.name: p for p in plan_pipeline(cfg, resolved, base)}


def _artifacts(location):
    """{artifact: digest} from a step's provenance.json, in a directory or a bucket prefix."""
    if storage.is_url(location):
        return json.loads(storage.read_bytes(f"{location}/provenance.json"))["artifacts"]
    return json.loads((location / "provenance.json").read_text())["artifacts"]


def _assert_no_secret(root_url, *texts):
    """SECRET_KEY (the test server's secret access key) in no object under the root and no output."""
    for name in storage.list_files(root_url):
        assert SECRET_KEY.encode() not in storage.read_bytes(f"{root_url}/{name}"), name
    for text in texts:
        assert SECRET_KEY not in text


def test_a_bucket_root_publishes_skips_from_the_bucket_fetches_and_redoes_a_killed_upload(
    bucket, tmp_path, monkeypatch, capsys
):
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    path, root = _pipeline(tmp_path), f"{bucket}/runs/p"
    assert main(["run", str(path), "--root", root]) == 0
    first = _plan(path, root)
    assert all(p.status == "done" for p in first.values())
    for p in first.values():
        assert p.url == f"{root}/{p.step.name}-{p.hash}" and storage.is_published(p.url)
        local = sorted(f.relative_to(p.out).as_posix() for f in p.out.rglob("*") if f.is_file())
        assert storage.list_files(p.url) == local  # the staging directory, published whole
    prov = json.loads(storage.read_bytes(f"{first['dedup'].url}/provenance.json"))
    assert prov["inputs"]["documents"] == first["filter"].url  # upstream recorded where it is published
    # same hashes and artifacts as a local root
    local = {p.step.name: p for p in run_pipeline(path, root=tmp_path / "local", log=lambda m: None)}
    for name, p in first.items():
        assert local[name].hash == p.hash and _artifacts(local[name].out) == _artifacts(p.url)

    # a fresh machine: no local copies; everything is done from the bucket alone, nothing fetched
    shutil.rmtree(cache)
    capsys.readouterr()
    assert main(["run", str(path), "--root", root]) == 0
    out = capsys.readouterr().out
    assert "running" not in out and "fetching" not in out and not cache.exists()
    fetched = fetch_output(first["dedup"], log=lambda m: None)  # what quickstart does to print eval.json
    assert (fetched / "_SUCCESS").is_file() and _artifacts(fetched) == _artifacts(local["dedup"].out)

    # forcing dedup there fetches filter's output from the bucket (checked against its digests)
    assert main(["run", str(path), "--root", root, "--force", "dedup"]) == 0
    out = capsys.readouterr().out
    assert f"fetching {first['filter'].url}" in out and "[dedup] running (forced)" in out
    assert _artifacts(first["dedup"].url) == _artifacts(local["dedup"].out)

    # an upload killed half way: objects but no marker -> incomplete, cleared and redone
    storage.remove(f"{first['dedup'].url}/_SUCCESS")
    storage.write_bytes(f"{first['dedup'].url}/left-over", b"from the killed upload")
    again = _plan(path, root)
    assert again["filter"].status == "done"
    assert again["dedup"].status == "run" and again["dedup"].reason.startswith("incomplete")
    assert main(["run", str(path), "--root", root]) == 0
    assert storage.is_published(first["dedup"].url)
    assert "left-over" not in storage.list_files(first["dedup"].url)
    assert _artifacts(first["dedup"].url) == _artifacts(local["dedup"].out)
    _assert_no_secret(root, out, capsys.readouterr().out)


def test_a_damaged_published_step_is_refused_when_fetched(bucket, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path, root = _pipeline(tmp_path), f"{bucket}/p"
    planned = {p.step.name: p for p in run_pipeline(path, root=root, log=lambda m: None)}
    part = next(n for n in storage.list_files(planned["filter"].url) if n.endswith(".jsonl.zst"))
    data = bytearray(storage.read_bytes(f"{planned['filter'].url}/{part}"))
    data[len(data) // 2] ^= 1
    storage.write_bytes(f"{planned['filter'].url}/{part}", bytes(data))
    shutil.rmtree(tmp_path / "cache")
    capsys.readouterr()
    assert main(["run", str(path), "--root", root, "--force", "dedup"]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not match the artifact digests" in err
    assert not (tmp_path / "cache" / "shipyard" / "pipeline" / planned["filter"].out.name).exists()


def test_bucket_roots_refused_in_one_line_before_anything_runs(bucket, tmp_path, capsys):
    path = _pipeline(tmp_path)
    assert main(["quickstart", "--dry-run", "--root", f"{bucket}/qs"]) == 0  # plans from the bucket
    planned = capsys.readouterr().out
    rows = [line.split() for line in planned.splitlines() if line.split()[-1].startswith(f"{bucket}/qs/")]
    assert len(rows) == 11 and all(r[1:3] == ["run", "new"] for r in rows)
    with_key = f"s3://key:{SECRET_KEY}@{bucket.removeprefix('s3://')}/p"
    assert main(["run", str(path), "--root", with_key]) == 2
    err = capsys.readouterr().err.strip()
    assert "credentials come from the environment" in err and SECRET_KEY not in err
    missing = "s3://shipyard-no-such-bucket/p"
    assert main(["run", str(path), "--root", missing]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bucket 'shipyard-no-such-bucket' does not exist" in err
    with pytest.raises(ConfigError, match="run --ray: the root s3://.* is a bucket"):
        run_pipeline(path, root=f"{bucket}/p", ray_address="local", log=lambda m: None)
    assert storage.list_files(bucket) == []


def test_reproduce_from_and_into_a_bucket(bucket, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = _pipeline(tmp_path)
    planned = {p.step.name: p for p in run_pipeline(path, root=f"{bucket}/p", log=lambda m: None)}
    capsys.readouterr()
    assert main(["reproduce", planned["dedup"].url, "--root", f"{bucket}/again"]) == 0
    assert "reproduce: 2 of 2 steps identical" in capsys.readouterr().out
    assert storage.is_published(f"{bucket}/again/steps/dedup-{planned['dedup'].hash}")
    assert storage.read_bytes(f"{bucket}/again/pipeline.yaml").startswith(b"root: s3://")
    assert main(["reproduce", planned["dedup"].url, "--root", f"{bucket}/again"]) == 3  # not fresh
    assert "is not empty" in capsys.readouterr().err
    assert main(["reproduce", planned["dedup"].url, "--root", str(tmp_path / "here")]) == 0
    assert "reproduce: 2 of 2 steps identical" in capsys.readouterr().out
    _assert_no_secret(bucket)


def _small_quickstart(tmp_path):
    """The packaged quickstart with 30 train steps, no in-loop eval and 16 scored sequences (~25 s)."""
    text = resources.files("shipyard").joinpath("pipelines", "quickstart.yaml").read_text()
    for old, new in [
        ("train.steps=600", "train.steps=30"),
        ("train.eval_every=100", "train.eval_every=null"),
        ("max_sequences: 256", "max_sequences: 16"),
    ]:
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / "quickstart.yaml"
    path.write_text(text)
    return path


@pytest.mark.slow
def test_quickstart_in_a_bucket_through_faults_killed_mid_publish_redone_and_skipped_when_fresh(
    s3_server, bucket, tmp_path, monkeypatch, capsys
):
    path, root = _small_quickstart(tmp_path), f"{bucket}/qs"
    local = {p.step.name: p for p in run_pipeline(path, root=tmp_path / "local", log=lambda m: None)}
    train_url = _plan(path, root)["train"].url

    # 1. through a proxy dropping every 7th connection; SIGKILLed while train's directory uploads
    proxy = FaultProxy(s3_server.port, drop_every=7)
    env = {**os.environ, "AWS_ENDPOINT_URL": proxy.endpoint, "XDG_CACHE_HOME": str(tmp_path / "c1")}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shipyard.cli", "run", str(path), "--root", root],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 240
        while not storage.list_files(train_url) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        proxy.outage(30)  # the upload stalls in its retries: the kill lands with files up, no marker
        uploaded = storage.list_files(train_url)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert uploaded and "_SUCCESS" not in uploaded, f"kill missed the upload: {uploaded}"
    assert not storage.is_published(train_url)
    assert proxy.dropped > 0  # the steps before train published through dropped connections

    # 2. a fresh machine (no local copies) reruns: train is redone, its inputs fetched from the bucket
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "c2"))
    plan = _plan(path, root)
    assert plan["tokens-train"].status == "done"
    assert plan["train"].status == "run" and plan["train"].reason.startswith("incomplete")
    capsys.readouterr()
    assert main(["run", str(path), "--root", root]) == 0
    redo = capsys.readouterr().out
    assert "[train] running (incomplete" in redo and "[tokens-train] running" not in redo
    assert f"fetching {plan['tokens-train'].url}" in redo  # train's input, and eval's baseline data
    for name, p in plan.items():  # identical to the local-root run, step by step
        assert p.hash == local[name].hash and _artifacts(p.url) == _artifacts(local[name].out), name

    # 3. another fresh machine: every step done from the bucket alone, nothing run or fetched
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "c3"))
    assert main(["run", str(path), "--root", root]) == 0
    skipped = capsys.readouterr().out
    assert "running" not in skipped and "fetching" not in skipped
    assert all(p.status == "done" for p in _plan(path, root).values())

    # 4. eval forced on the machine that trained, its cache emptied (or another machine with the same
    # ~/.cache): the run and, through its config.yaml, its training tokens (the unigram baseline's
    # data) are fetched before eval runs; the numbers equal the local run's
    shutil.rmtree(tmp_path / "c2")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "c2"))
    assert main(["run", str(path), "--root", root, "--force", "eval"]) == 0
    forced = capsys.readouterr().out
    assert f"fetching {plan['train'].url}" in forced
    assert forced.find(f"fetching {plan['tokens-train'].url}") in range(forced.index("[eval] running"))
    assert _artifacts(plan["eval"].url) == _artifacts(local["eval"].out)
    proxy.close()
    _assert_no_secret(root, (tmp_path / "killed.log").read_text(), redo, skipped, forced)
