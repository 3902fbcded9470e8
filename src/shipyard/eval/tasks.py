"""Log-likelihood tasks from local JSONL files.

- multiple choice, `{"context": str, "choices": [str, ...], "label": int}`:
  accuracy by summed log-likelihood of each choice, and length-normalised
  accuracy (divided by the choice's UTF-8 bytes);
- cloze, `{"text": str}` (LAMBADA style): the last word is the target; accuracy
  when greedy decoding reproduces all its tokens, and its perplexity.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from shipyard.errors import DataError
from shipyard.eval.loglik import loglikelihoods


def read_task_jsonl(path: Path, fields: Sequence[str]) -> list[dict]:
    rows = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"eval task {path}: cannot read it ({e})") from e
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"eval task {path}:{n}: not valid JSON ({e.msg})") from e
        missing = [f for f in fields if f not in row]
        if missing:
            raise DataError(
                f"eval task {path}:{n}: missing field(s) {', '.join(missing)} (expected {', '.join(fields)})"
            )
        rows.append(row)
    if not rows:
        raise DataError(f"eval task {path}: no examples")
    return rows


def multiple_choice(params, cfg, tok, path: Path) -> dict:
    rows = read_task_jsonl(path, ("context", "choices", "label"))
    pairs, owners = [], []
    for k, row in enumerate(rows):
        ctx = tok.encode(row["context"], add_special_tokens=False).ids
        for choice in row["choices"]:
            pairs.append((ctx, tok.encode(choice, add_special_tokens=False).ids))
            owners.append(k)
    scores = loglikelihoods(params, cfg, pairs)
    correct = correct_norm = 0
    at = 0
    for row in rows:
        ll = [scores[at + c][0] for c in range(len(row["choices"]))]
        norm = [s / max(len(ch.encode("utf-8")), 1) for s, ch in zip(ll, row["choices"])]
        at += len(row["choices"])
        correct += int(np.argmax(ll)) == row["label"]
        correct_norm += int(np.argmax(norm)) == row["label"]
    return {"examples": len(rows), "accuracy": correct / len(rows), "accuracy_norm": correct_norm / len(rows)}


def cloze(params, cfg, tok, path: Path) -> dict:
    rows = read_task_jsonl(path, ("text",))
    pairs = []
    for row in rows:
        text = row["text"].rstrip()
        cut = text.rfind(" ")
        if cut <= 0:
            raise DataError(f"eval task {path}: example {text[:40]!r} has no last word to predict")
        pairs.append(
            (
                tok.encode(text[:cut], add_special_tokens=False).ids,
                tok.encode(text[cut:], add_special_tokens=False).ids,
            )
        )
    scores = loglikelihoods(params, cfg, pairs)
    nats = -sum(s for s, _ in scores)
    ntok = sum(len(c) for _, c in pairs)
    return {
        "examples": len(rows),
        "accuracy": sum(g for _, g in scores) / len(rows),
        "perplexity": math.exp(min(nats / max(ntok, 1), 50.0)),
    }
