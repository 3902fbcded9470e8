"""`shipyard eval`: held-out loss / perplexity / bits-per-byte per domain, and log-likelihood tasks.

Domains are token-shard directories: their sequences are scored in order
(the first `max_sequences`), every token a target once. Bits per byte divide
the summed loss (in bits) by the UTF-8 bytes the target tokens stand for, so
models with different tokenizers compare; with a byte-level BPE vocabulary a
token's byte count is the length of its vocabulary string (each character of
it encodes one byte), special tokens count zero.

Tasks are local JSONL files:
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
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from shipyard.errors import DataError
from shipyard.model.transformer import logits as model_logits


@partial(jax.jit, static_argnames=("cfg",))
def _token_logprobs(params, tokens, cfg):
    """log p(tokens[:, i+1] | tokens[:, :i+1]) and whether it was the argmax, for every position."""
    out = model_logits(params, tokens[:, :-1], cfg)
    logp = jax.nn.log_softmax(out, axis=-1)
    target = tokens[:, 1:]
    picked = jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
    return picked, jnp.argmax(out, axis=-1) == target


def loglikelihoods(
    params, cfg, pairs: Sequence[tuple[list[int], list[int]]], batch: int = 16
) -> list[tuple[float, bool]]:
    """(sum of log p(continuation | context), continuation is the greedy choice) per (context, continuation).

    Sequences are cut from the left to the model's context and right-padded to
    a multiple of 64 tokens (few distinct shapes: few compilations); causal
    attention makes the padding invisible to the scored positions.
    """
    out = []
    limit = cfg.max_seq_len + 1
    for i in range(0, len(pairs), batch):
        chunk = pairs[i : i + batch]
        seqs = [(ctx + cont)[-limit:] for ctx, cont in chunk]
        width = -(-max(len(s) for s in seqs) // 64) * 64
        tokens = np.zeros((batch, max(width, 2)), np.int32)
        for r, s in enumerate(seqs):
            tokens[r, : len(s)] = s
        logp, greedy = (np.asarray(x) for x in _token_logprobs(params, jnp.asarray(tokens), cfg))
        for r, ((_, cont), s) in enumerate(zip(chunk, seqs)):
            n = min(len(cont), len(s) - 1)
            positions = slice(len(s) - 1 - n, len(s) - 1)  # logits at position j predict token j + 1
            out.append((float(logp[r, positions].sum()), bool(greedy[r, positions].all())))
    return out


def token_byte_lengths(tok) -> np.ndarray:
    """UTF-8 bytes each token id stands for (byte-level BPE: one vocabulary character per byte)."""
    vocab = tok.get_vocab(with_added_tokens=True)
    lengths = np.zeros(tok.get_vocab_size(with_added_tokens=True), np.int64)
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    for token, i in vocab.items():
        lengths[i] = 0 if token in special else len(token)
    return lengths


def domain_metrics(params, cfg, shard_dir: str | Path, tok, max_sequences: int, batch: int = 8) -> dict:
    from shipyard.data.loader import SequenceSource

    src = SequenceSource(shard_dir, cfg.max_seq_len if cfg.max_seq_len < 512 else 512, cfg.vocab_size)
    n = min(len(src), max_sequences)
    byte_len = token_byte_lengths(tok) if tok is not None else None
    nats, tokens, nbytes = 0.0, 0, 0
    for i in range(0, n, batch):
        rows = np.stack([src[j] for j in range(i, min(i + batch, n))])
        padded = np.zeros((batch, rows.shape[1]), np.int32)
        padded[: len(rows)] = rows
        logp, _ = _token_logprobs(params, jnp.asarray(padded), cfg)
        nats -= float(np.asarray(logp)[: len(rows)].sum())
        tokens += rows[:, 1:].size
        if byte_len is not None:
            nbytes += int(byte_len[rows[:, 1:]].sum())
    loss = nats / max(tokens, 1)
    return {
        "sequences": n,
        "tokens": tokens,
        "loss": loss,
        "perplexity": math.exp(min(loss, 50.0)),
        "bytes": nbytes if byte_len is not None else None,
        "bits_per_byte": nats / math.log(2) / nbytes if nbytes else None,
    }


def _read_jsonl(path: Path, fields: Sequence[str]) -> list[dict]:
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
    rows = _read_jsonl(path, ("context", "choices", "label"))
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
    rows = _read_jsonl(path, ("text",))
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


def run_eval(
    run_dir: Path,
    domains: dict[str, str],
    tasks: list[tuple[str, str]],
    max_sequences: int = 64,
    step: int | None = None,
) -> dict:
    from shipyard.data.tokenizer import load_tokenizer
    from shipyard.runs import open_model_dir

    model_dir = open_model_dir(run_dir, "eval")
    cfg, step, params = model_dir.load(step, what="eval")
    tok_dir = model_dir.tokenizer()
    tok = load_tokenizer(tok_dir) if tok_dir is not None else None
    if tasks and tok is None:
        raise DataError(f"eval: tasks need a tokenizer, and none sits next to the training data of {run_dir}")
    params = jax.tree.map(jnp.asarray, params)
    report = {"run": str(run_dir), "step": step, "domains": {}, "tasks": {}}
    for name, path in domains.items():
        report["domains"][name] = domain_metrics(params, cfg.model, path, tok, max_sequences)
    for kind, path in tasks:
        name = f"{kind}:{Path(path).stem}"
        if kind == "chat":  # greedy replies vs references, with the run's chat template
            from shipyard.inference.chat import chat_model, exact_match

            report["tasks"][name] = exact_match(chat_model(cfg, params, tok_dir), path)
            continue
        fn = {"mc": multiple_choice, "cloze": cloze}.get(kind)
        if fn is None:
            raise DataError(f"eval --task {kind}:{path}: unknown kind {kind!r} (expected mc, cloze or chat)")
        report["tasks"][name] = fn(params, cfg.model, tok, Path(path))
    return report
