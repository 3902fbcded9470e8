"""The fastText quality classifier: held-out accuracy on a real task, determinism, keep rules, bad input.

The task: stdlib docstrings (real prose about code) against the same words
shuffled within each docstring. Word counts are identical between the classes,
so only word order (the 2-gram features) can tell them apart.
"""

import ast
import json
import random

import numpy as np
import pytest
import zstandard

from shipyard.cli.main import main
from shipyard.data.classifier import run_classifier_train, run_classify, top_fraction_cutoffs
from shipyard.data.configs import ClassifierTrainConfig, ClassifyConfig, ReadConfig
from shipyard.data.stdlib import stdlib_files

FILES = 300  # the first 300 stdlib files: ~2,250 docstrings of at least 20 words, 1.1 MB


def _docstrings(n_files: int) -> list[tuple[str, str]]:
    out = []
    for rel, path in stdlib_files()[:n_files]:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc.split()) >= 20:
                    out.append((f"{rel}:{getattr(node, 'lineno', 0)}", doc))
    return out


def _write(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for rid, text in records:
            f.write(json.dumps({"id": rid, "text": text}) + "\n")
    return path


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    d = tmp_path_factory.mktemp("classifier")
    docs = _docstrings(FILES)
    rng = random.Random(0)
    shuffled = []
    for rid, text in docs:
        words = text.split()
        rng.shuffle(words)
        shuffled.append((f"{rid}#shuffled", " ".join(words)))
    pos, neg = _write(d / "pos.jsonl", docs), _write(d / "neg.jsonl", shuffled)
    report = run_classifier_train([pos], [neg], d / "model", ClassifierTrainConfig(), ReadConfig())
    return d, pos, neg, report


def _records(out_dir):
    recs = []
    for part in sorted(out_dir.glob("part-*.jsonl.zst")):
        with open(part, "rb") as f:
            data = zstandard.ZstdDecompressor().stream_reader(f).read()
        recs += [json.loads(line) for line in data.decode().splitlines()]
    return recs


def test_held_out_accuracy_on_docstrings_vs_shuffled_words(task):
    d, _, _, report = task
    held = report["held_out"]
    assert report["counts"]["hq"]["held_out"] == report["counts"]["lq"]["held_out"] > 200
    assert held["documents"] > 400 and held["accuracy"] >= 0.95, held
    assert held["precision"] >= 0.9 and held["recall"] >= 0.9
    assert json.loads((d / "model" / "report.json").read_text()) == report
    assert not (d / "model" / "train.txt").exists()


def test_training_is_deterministic_for_a_seed(task, tmp_path):
    d, pos, neg, report = task
    again = run_classifier_train([pos], [neg], tmp_path / "m", ClassifierTrainConfig(), ReadConfig())
    assert again == report
    assert (tmp_path / "m" / "model.bin").read_bytes() == (d / "model" / "model.bin").read_bytes()


def test_classify_same_bytes_for_1_and_2_workers_and_top_fraction_keeps_the_best(task, tmp_path):
    d, pos, neg, _ = task
    cfg = ClassifyConfig(top_fraction=0.3)
    outs = {}
    for w in (1, 2):
        outs[w] = run_classify([pos, neg], tmp_path / f"w{w}", d / "model", cfg, ReadConfig(), w)
    parts = sorted(p.name for p in (tmp_path / "w1").glob("part-*"))
    assert len(parts) >= 2  # several work units, so 2 workers really split the input
    for name in [*parts, "score_histogram.png"]:
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes(), name
    volatile = {"seconds", "mb_per_s", "workers"}  # when and with how many, not what
    assert {k: v for k, v in outs[1].items() if k not in volatile} == {
        k: v for k, v in outs[2].items() if k not in volatile
    }
    st = outs[1]
    n = st["documents_in"]
    kept = _records(tmp_path / "w1")
    assert len(kept) == st["documents_out"] == round(0.3 * n)
    assert sum(st["histogram"]["counts"]) == n
    # every kept score is at least every dropped one: compare with all scores
    everything = run_classify(
        [pos, neg], tmp_path / "all", d / "model", ClassifyConfig(threshold=0), ReadConfig(), 1
    )
    scores = sorted((r["quality_score"] for r in _records(tmp_path / "all")), reverse=True)
    assert everything["documents_out"] == n
    assert min(r["quality_score"] for r in kept) == scores[len(kept) - 1]
    # most of the kept are real docstrings, not shuffled ones
    assert sum(not r["id"].endswith("#shuffled") for r in kept) / len(kept) > 0.95
    levels = [e["score"] for e in st["examples_by_score"]]
    assert len(levels) >= 3 and levels == sorted(levels)
    assert (tmp_path / "w1" / "score_histogram.png").read_bytes()[:4] == b"\x89PNG"


def test_threshold_keeps_exactly_the_scores_at_or_above_it(task, tmp_path):
    d, pos, neg, _ = task
    every = _records_of(run_classify, [pos, neg], tmp_path / "all", d, ClassifyConfig(threshold=0))
    st = run_classify([pos, neg], tmp_path / "t", d / "model", ClassifyConfig(threshold=0.9), ReadConfig(), 2)
    kept = _records(tmp_path / "t")
    expected = [r for r in every if r["quality_score"] >= 0.9]
    assert kept == expected and st["documents_out"] == len(expected) and 0 < len(expected) < len(every)
    assert all(0 <= r["quality_score"] <= 1 for r in every)
    assert st["dropped"] == {"below_cutoff": len(every) - len(expected)}


def _records_of(run, inputs, out, d, cfg):
    run(inputs, out, d / "model", cfg, ReadConfig(), 1)
    return _records(out)


def test_top_fraction_ties_are_split_in_input_order():
    units = [np.array([0.5, 0.9, 0.5]), np.array([0.5, 0.1])]
    cutoff, ties = top_fraction_cutoffs(units, 0.6)  # 3 of 5: 0.9 and the first two 0.5s
    assert cutoff == 0.5 and ties == [2, 0]
    cutoff, ties = top_fraction_cutoffs(units, 0.8)
    assert cutoff == 0.5 and ties == [2, 1]


def test_cli_trains_classifies_and_refuses_bad_input_in_one_line(task, tmp_path, capsys):
    d, pos, neg, _ = task
    model = tmp_path / "m"
    args = ["--out", str(model), "--set", "epoch=5", "--set", "held_out_fraction=0.2"]
    assert main(["data", "classifier-train", "--positive", str(pos), "--negative", str(neg), *args]) == 0
    assert "held-out accuracy" in capsys.readouterr().out
    out = str(tmp_path / "o")
    assert (
        main(["data", "classify", str(pos), "--model", str(model), "--out", out, "--top-fraction", "0.5"])
        == 0
    )
    assert "classify:" in capsys.readouterr().out
    bad = [
        (["--model", str(tmp_path / "nope")], 3, "is not a classifier directory"),
        (
            ["--model", str(model), "--threshold", "1.5"],
            2,
            "threshold: Input should be less than or equal to 1",
        ),
        (["--model", str(model), "--threshold", "0.5", "--top-fraction", "0.2"], 2, "not both"),
        (["--model", str(model), "--top-fraction", "0"], 2, "top_fraction"),
    ]
    for flags, code, message in bad:
        assert main(["data", "classify", str(pos), "--out", str(tmp_path / "x"), *flags]) == code, flags
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert (
        main(
            [
                "data",
                "classifier-train",
                "--positive",
                str(pos),
                "--negative",
                str(tmp_path / "none.jsonl"),
                "--out",
                str(tmp_path / "x"),
            ]
        )
        == 3
    )
    err = capsys.readouterr().err
    assert "none.jsonl" in err and err.count("\n") == 1
    assert not (tmp_path / "x").exists()


def test_pipeline_steps_train_and_classify_and_check_their_config_first(task, tmp_path):
    import yaml

    from shipyard.errors import ConfigError
    from shipyard.experiment.executor import run_pipeline

    _, pos, neg, _ = task
    spec = {
        "root": "out",
        "steps": [
            {
                "name": "quality",
                "kind": "classifier-train",
                "inputs": {"positive": str(pos), "negative": str(neg)},
                "config": {"epoch": 5},
            },
            {
                "name": "best",
                "kind": "classify",
                "inputs": {"documents": str(pos), "model": "@quality"},
                "config": {"top_fraction": 0.5},
            },
        ],
    }
    path = tmp_path / "pipeline.yaml"
    spec["steps"][1]["config"]["threshold"] = 0.5  # both rules: refused before anything runs
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError, match=r"pipeline step best \(classify\): threshold: give threshold or"):
        run_pipeline(path, log=lambda m: None)
    assert not (tmp_path / "out").exists()
    del spec["steps"][1]["config"]["threshold"]
    path.write_text(yaml.safe_dump(spec))
    run_pipeline(path, log=lambda m: None)
    (best,) = [
        p for p in (tmp_path / "out").rglob("stats.json") if json.loads(p.read_text())["stage"] == "classify"
    ]
    stats = json.loads(best.read_text())
    assert stats["documents_out"] == round(stats["documents_in"] / 2)
    assert (best.parent / "score_histogram.png").is_file()
    from shipyard.experiment.steps import digest

    model_dir = tmp_path / "out" / json.loads(best.read_text())["model"].split("/out/")[-1]
    assert set(digest("classifier-train", model_dir)) == {"model.bin", "report"}


def test_fasttext_line_is_one_lowercased_line_of_tokens():
    from shipyard.data.classifier import fasttext_line

    text = "Return the Value.\nIt's\tdone, (mostly)!"
    assert fasttext_line(text, None) == "return the value . it ' s done , ( mostly ) !"
    assert fasttext_line(text, None) == fasttext_line(text, 1000)
    assert fasttext_line(text, 4) == "return the value ."


@pytest.mark.slow
def test_a_killed_classify_resumes_both_passes_from_their_finished_units(task, tmp_path):
    """--top-fraction's two passes are journaled: a SIGKILL in the second pass and a rerun skip every
    scored unit and the finished kept ones, and write the bytes of an uninterrupted run."""
    import os
    import re
    import signal
    import subprocess
    import sys
    import time

    d, pos, neg, _ = task
    inputs = []
    for k in range(4):  # about 16 work units
        for src in (pos, neg):
            copy = tmp_path / f"{k}-{src.name}"
            copy.write_bytes(src.read_bytes())
            inputs.append(str(copy))
    shipyard = os.path.join(os.path.dirname(sys.executable), "shipyard")

    def cmd(out):
        return [shipyard, "data", "classify", *inputs, "--model", str(d / "model"), "--out", str(out)]

    args = ["--set", "top_fraction=0.3", "--workers", "1"]
    clean = subprocess.run([*cmd(tmp_path / "clean"), *args], capture_output=True, text=True, timeout=600)
    assert clean.returncode == 0, clean.stderr
    out, journal = tmp_path / "out", tmp_path / ".out.partial" / "_resume"
    proc = subprocess.Popen([*cmd(out), *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (journal / "units-00002.json").exists():  # three units of the second pass kept
        assert proc.poll() is None and time.time() < deadline, "classify ended before it could be killed"
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    scored, kept = len(list(journal.glob("scores-*.json"))), len(list(journal.glob("units-*.json")))
    again = subprocess.run([*cmd(out), *args], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    first = re.search(r"classify \(scoring\): resuming: (\d+) of (\d+) units", again.stderr)
    second = re.search(r"data classify: resuming: (\d+) of (\d+) units", again.stderr)
    assert first and int(first[1]) == scored == int(first[2]), again.stderr
    assert second and int(second[1]) == kept and 3 <= kept < int(second[2]), again.stderr
    for name in sorted(p.name for p in (tmp_path / "clean").iterdir()):
        a, b = (tmp_path / "clean" / name).read_bytes(), (out / name).read_bytes()
        if name == "stats.json":
            a, b = (
                {k: v for k, v in json.loads(x).items() if k not in ("seconds", "mb_per_s")} for x in (a, b)
            )
        assert a == b, name
    assert not (tmp_path / ".out.partial").exists()
