"""Pages without a browser: a decontamination hit shows the document with the shared n-gram
highlighted (whitespace in the document may differ from the n-gram's single spaces), and a filter's
drop names its rule with the number it measured against the limit; a running server re-checks the
root before each page (a byte changed under it shows ✗ on the next request, and a request over an
unchanged root reads no file)."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from shipyard.browse.site import open_site
from shipyard.experiment.executor import run_pipeline


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """filter → decon (decontaminate) → dedup over a dozen documents, one of which leaks an eval
    set's n-gram (the module's one pipeline run; a test that changes it changes a copy)."""
    d = tmp_path_factory.mktemp("pages")
    words = [f"w{i}" for i in range(400)]
    shared = "the quick brown fox jumps over the lazy dog near the old river bank today"
    docs = [{"id": f"d{i}", "text": " ".join(words[i * 20 : i * 20 + 60])} for i in range(12)]
    docs.append(
        {"id": "leak", "text": " ".join(words[:30]) + "\n" + shared.replace(" over ", "\n  over ") + " end"}
    )
    docs.append({"id": "short", "text": "too few words"})
    (d / "docs.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    (d / "eval.jsonl").write_text(json.dumps({"text": f"q: {shared}?"}) + "\n")
    (d / "p.yaml").write_text(
        "root: out\nsteps:\n"
        "  - {name: filter, kind: filter, inputs: {documents: docs.jsonl}, config: {profile: prose, min_words: 5}}\n"
        f"  - {{name: decon, kind: decontaminate, inputs: {{documents: '@filter'}}, "
        f"config: {{eval_sets: ['{d / 'eval.jsonl'}'], ngram: 8}}}}\n"
        "  - {name: dedup, kind: dedup, inputs: {documents: '@decon'}}\n"
    )
    run_pipeline(str(d / "p.yaml"), log=lambda m: None)
    return d / "out"


def test_decontamination_hits_and_filter_drops_show_their_evidence(root):
    site = open_site(root)
    assert [n.status for n in site.nodes] == ["verified"] * 3
    decon = next(n for n in site.nodes if n.kind == "decontaminate")
    page = site.render(f"data/{decon.key}.html")
    assert "<code>leak</code>" in page and "<mark>the quick brown fox jumps\n  over the lazy</mark>" in page
    filt = next(n for n in site.nodes if n.kind == "filter")
    page = site.render(f"data/{filt.key}.html")
    assert "dropped by <b class=rule>min_words</b>: measured 3, &gt;= 5" in page


def test_a_running_server_re_checks_the_root_before_each_page(root, tmp_path, monkeypatch):
    """`shipyard browse`'s app (through FastAPI's TestClient) over a copy of the root shows ✓ on
    every step; one byte of decon's part file is flipped in place, its size kept and its mtime set
    back with os.utime (only the ctime moves, and the hash cache's stat holds the ctime): the next
    page shows ✗ on decon, ✗ upstream on dedup, ✓ on filter. A request over an unchanged root reads
    no file; after the flip exactly the flipped file is re-hashed and only decon is digested again.
    Flipped back, ✓ everywhere again."""
    from fastapi.testclient import TestClient

    from shipyard.browse.server import create_app
    from shipyard.data import hashcache
    from shipyard.experiment import steps

    copy = tmp_path / "root"
    shutil.copytree(root, copy, symlinks=True)
    # The copy's files were just written: inside the hash cache's racy window (RACY_NS) they would be
    # hashed on every request until they settle, 2 s on. Closed here, so the counts below are those of
    # a settled root; `_flip` waits out a timestamp tick instead, so its writes get a new ctime.
    monkeypatch.setattr(hashcache, "RACY_NS", 0)
    site = open_site(copy, live=True)
    hashed, digested = [], []
    sha, digest = hashcache.file_sha256, steps.digest
    monkeypatch.setattr(hashcache, "file_sha256", lambda p: hashed.append(Path(p)) or sha(p))
    monkeypatch.setattr(steps, "digest", lambda kind, out: digested.append(out.name) or digest(kind, out))
    client = TestClient(create_app(site))
    ok = {"filter": "✓ verified", "decon": "✓ verified", "dedup": "✓ verified"}
    assert _statuses(client) == ok
    assert hashed == [] and digested == []  # a stat per file, nothing read

    part = sorted((copy / _key(copy, "decon")).glob("part-*"))[0]
    _flip(part)
    bad = {"filter": "✓ verified", "decon": "✗ differs", "dedup": "✗ upstream differs"}
    assert _statuses(client) == bad
    assert hashed == [part] and digested == [part.parent.name]
    hashed.clear()
    digested.clear()
    assert _statuses(client) == bad and hashed == [] and digested == []

    _flip(part)  # the byte as it was: ✓ again, again by reading that file and digesting that step
    assert _statuses(client) == ok
    assert hashed == [part] and digested == [part.parent.name]
    assert "re-checked for this page in" in client.get("/").text


def _flip(path: Path) -> None:
    """One byte in the middle of `path` flipped in place, the size, inode and mtime as they were: only
    the ctime tells (os.utime sets it to now)."""
    before = path.stat()
    time.sleep(0.05)  # past a timestamp tick since the file was last hashed
    with open(path, "r+b") as f:
        f.seek(before.st_size // 2)
        byte = f.read(1)[0]
        f.seek(before.st_size // 2)
        f.write(bytes([byte ^ 0x01]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_ino, after.st_mtime_ns) == (
        before.st_size,
        before.st_ino,
        before.st_mtime_ns,
    )
    assert after.st_ctime_ns != before.st_ctime_ns


def _statuses(client) -> dict[str, str]:
    """Step name -> the status the index shows for it (its own page must show the same)."""
    index = client.get("/")
    assert index.status_code == 200
    rows = re.findall(
        r'<tr><td><span class="status \w+">([^<]*)</span></td><td>[^<]*</td><td><a href="node/([^"]+)\.html"',
        index.text,
    )
    out = {}
    for status, key in rows:
        page = client.get(f"/node/{key}.html").text
        assert re.search(r'<p class="status \w+">(.*?)(?: — |</p>)', page)[1] == status, key
        out[key.rsplit("-", 1)[0]] = status
    return out


def _key(root: Path, name: str) -> str:
    return next(p.name for p in root.iterdir() if p.name.rsplit("-", 1)[0] == name)


def test_a_root_in_a_bucket_is_browsed_and_a_changed_object_marks_its_step(bucket, tmp_path):
    """A pipeline root in an S3 bucket (moto on 127.0.0.1): browsed from a local copy, every step
    verified; one byte changed in a published object of the filter step is fetched again and shows
    ✗ on it and upstream-differs on dedup; the reproduce command names the bucket."""
    from data_fixtures import pipeline_docs

    from shipyard import storage

    pipeline_docs(tmp_path / "docs.jsonl")
    (tmp_path / "p.yaml").write_text(
        "root: out\nsteps:\n"
        "  - {name: filter, kind: filter, inputs: {documents: docs.jsonl}, config: {profile: prose, min_words: 5}}\n"
        "  - {name: dedup, kind: dedup, inputs: {documents: '@filter'}}\n"
    )
    root = f"{bucket}/root"
    run_pipeline(str(tmp_path / "p.yaml"), root=root, log=lambda m: None)
    site = open_site(root, say=lambda m: None)
    assert [n.status for n in site.nodes] == ["verified", "verified"] and site.source == root
    filt = next(n for n in site.nodes if n.kind == "filter")
    assert f"shipyard reproduce {root}/{filt.key} --root FRESH_ROOT" in site.render(f"node/{filt.key}.html")
    part = f"{root}/{filt.key}/part-00000.jsonl.zst"
    data = bytearray(storage.read_bytes(part))
    data[len(data) // 2] ^= 0x01
    storage.write_bytes(part, bytes(data))
    site = open_site(root, say=lambda m: None)
    assert {n.kind: n.status for n in site.nodes} == {"filter": "differs", "dedup": "upstream"}


def test_an_rl_run_shows_its_reward_curves_and_held_out_reward_and_no_loader_batches(tmp_path):
    """An RL run directory (rl.yaml, metrics.jsonl as `shipyard rl` writes them) as ROOT: the reward
    and KL curves, the held-out reward on the evaluations page, and no batch pages (its batches are
    rollouts)."""
    import yaml

    run = tmp_path / "rl-run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {}, "train": {"steps": 4}}))
    (run / "rl.yaml").write_text(yaml.safe_dump({"task": "add", "steps": 4}))
    lines = [{"step": 0, "eval_reward": 0.25, "eval_pass@1": 0.25}]
    lines += [{"step": s, "reward_mean": 0.1 * s, "kl_ref": 0.01 * s, "kl_rollout": 0.0} for s in (1, 2, 3)]
    lines += [{"step": 4, "reward_mean": 0.4, "kl_ref": 0.04, "kl_rollout": 0.0, "eval_reward": 0.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    site = open_site(run)
    page = site.render(f"run/{run.name}.html")
    assert "reward (RL)" in page and "reward_mean" in page and "KL (RL)" in page
    assert "rollouts" in page and not [p for p in site.static_paths() if p.startswith("batch/")]
    assert site.render(f"batch/{run.name}/1.html") is None
    assert "<td>0.5</td>" in site.render("evals.html")
