"""End to end: chat SFT on a synthetic instruction set answers held-out prompts of the same pattern."""

import json
import os
import subprocess
import sys

import pytest
from chat_fixtures import QUIET, upper_task, write_chats, write_tokenizer


@pytest.mark.slow
def test_sft_answers_held_out_prompts(tmp_path):
    tok = write_tokenizer(tmp_path / "tok")
    train = write_chats(tmp_path / "train.jsonl", upper_task(0, 2000))
    seen = {json.dumps(c) for c in upper_task(0, 2000)}
    held = [c for c in upper_task(1, 200) if json.dumps(c) not in seen][:100]  # words never trained on
    held_out = write_chats(tmp_path / "held.jsonl", held)
    env = dict(os.environ, XLA_FLAGS="", SHIPYARD_NO_REEXEC="1")  # one device: the fastest here

    def cli(*args):
        proc = subprocess.run(
            [sys.executable, "-m", "shipyard.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    run = tmp_path / "sft"
    cli(
        "train",
        "tiny",
        "--run-dir",
        str(run),
        "data.seq_len=128",
        f"data.chat={{train: {train}, validation: {held_out}, tokenizer: {tok}}}",
        "train.steps=1000",
        "train.optimizer.lr=5e-3",
        "train.eval_every=500",
        *QUIET,
    )
    val = [
        r["val_loss"]
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if "val_loss" in r
    ]
    assert len(val) == 2 and val[-1] < 0.5  # nats per assistant token
    out = cli("eval", str(run), "--task", f"chat:{held_out}")
    report = json.loads((run / "eval.json").read_text())["tasks"]["chat:held"]
    assert report["conversations"] == 100 and report["exact_match"] >= 0.9, out
