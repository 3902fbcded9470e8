"""Pipeline roots in a bucket (moto_server on 127.0.0.1): steps staged locally and published with
their marker last, done iff the marker is in the bucket, upstream outputs fetched and checked, a
killed upload redone, reproduce from and to a bucket, no credentials in anything written."""

import json
import shutil

import pytest
import yaml
from s3_fixtures import SECRET_KEY

from shipyard import storage
from shipyard.cli.main import main
from shipyard.errors import ConfigError
from shipyard.pipeline.executor import load_pipeline, plan_pipeline, run_pipeline


def _docs(path, n=60):
    rows = []
    for i in range(n):
        words = " ".join(f"word{(i * 7 + j) % 97}" for j in range(40 + i % 20))
        rows.append({"id": f"d{i}", "text": f"Document {i}. " + words + ". The end of the text is here."})
    rows.append(dict(rows[3], id="dup"))  # an exact duplicate for dedup to remove
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _pipeline(tmp_path):
    """filter -> dedup on a small generated corpus (a few seconds)."""
    _docs(tmp_path / "docs.jsonl")
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
    missing = "s3://shipyard-no-such-bucket/p"
    assert main(["run", str(path), "--root", missing]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bucket 'shipyard-no-such-bucket' does not exist" in err
    with pytest.raises(ConfigError, match="run --ray: the root s3://.* is a bucket"):
        run_pipeline(path, root=f"{bucket}/p", ray_address="local", log=lambda m: None)
    assert storage.list_files(bucket) == []
