"""Data pages without a browser: a decontamination hit shows the document with the shared n-gram
highlighted (whitespace in the document may differ from the n-gram's single spaces), and a filter's
drop names its rule with the number it measured against the limit."""

from __future__ import annotations

import json

from shipyard.browse.site import open_site
from shipyard.experiment.executor import run_pipeline


def test_decontamination_hits_and_filter_drops_show_their_evidence(tmp_path):
    words = [f"w{i}" for i in range(400)]
    shared = "the quick brown fox jumps over the lazy dog near the old river bank today"
    docs = [{"id": f"d{i}", "text": " ".join(words[i * 20 : i * 20 + 60])} for i in range(12)]
    docs.append(
        {"id": "leak", "text": " ".join(words[:30]) + "\n" + shared.replace(" over ", "\n  over ") + " end"}
    )
    docs.append({"id": "short", "text": "too few words"})
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "eval.jsonl").write_text(json.dumps({"text": f"q: {shared}?"}) + "\n")
    (tmp_path / "p.yaml").write_text(
        "root: out\nsteps:\n"
        "  - {name: filter, kind: filter, inputs: {documents: docs.jsonl}, config: {profile: prose, min_words: 5}}\n"
        f"  - {{name: decon, kind: decontaminate, inputs: {{documents: '@filter'}}, "
        f"config: {{eval_sets: ['{tmp_path / 'eval.jsonl'}'], ngram: 8}}}}\n"
    )
    run_pipeline(str(tmp_path / "p.yaml"), log=lambda m: None)
    site = open_site(tmp_path / "out")
    assert all(n.status == "verified" for n in site.nodes)
    decon = next(n for n in site.nodes if n.kind == "decontaminate")
    page = site.render(f"data/{decon.key}.html")
    assert "<code>leak</code>" in page and "<mark>the quick brown fox jumps\n  over the lazy</mark>" in page
    filt = next(n for n in site.nodes if n.kind == "filter")
    page = site.render(f"data/{filt.key}.html")
    assert "dropped by <b class=rule>min_words</b>: measured 3, &gt;= 5" in page


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
