"""Long work shows progress: a bar with a count, a rate and an ETA, on a terminal only (logs and
captured output stay clean)."""

from __future__ import annotations

import json
import re
import sys

from shipyard.cli.main import main

# tqdm's tail: "| 40/40 [00:01<00:00, 31.2docs/s]" (count, elapsed<remaining, rate; "1.5s/step" when slow)
BAR = r"\| *{done}/{total} \[\d\d:\d\d<\d\d:\d\d, +[\d.]+ ?({unit}/s|s/{unit})"


def _docs(path, n=400):
    path.write_text(
        "".join(
            json.dumps({"text": f"Document {i} says something about the weather."}) + "\n" for i in range(n)
        )
    )
    return path


def test_a_data_stage_shows_a_bar_with_rate_and_eta_on_a_terminal(tmp_path, capsys, monkeypatch):
    docs = _docs(tmp_path / "d.jsonl")
    assert main(["data", "filter", str(docs), "--out", str(tmp_path / "quiet"), "--workers", "1"]) == 0
    assert "/s]" not in capsys.readouterr().err  # not a terminal: no bar in logs

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["data", "filter", str(docs), "--out", str(tmp_path / "tty"), "--workers", "1"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"[\d.]+ ?\w+/s\]", err) and re.search(r"\[\d\d:\d\d<\d\d:\d\d", err), err[-500:]


def test_training_shows_steps_with_rate_and_eta(tmp_path, capsys, byte_tokens):
    argv = ["train", "tiny", f"data.train_tokens={byte_tokens}", f"run.out_dir={tmp_path}", "train.steps=6"]
    assert main([*argv, "train.logging.progress=true", "train.logging.log_every=3"]) == 0
    err = capsys.readouterr().err
    assert re.search(BAR.format(done=6, total=6, unit="step"), err), err[-500:]
    assert re.search(r"tok_s=[\d,]+", err)  # and the throughput of the latest logged step
    assert main([*argv, "run.name=quiet", "train.logging.progress=false"]) == 0
    assert not re.search(BAR.format(done=6, total=6, unit="step"), capsys.readouterr().err)
