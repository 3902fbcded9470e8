"""Held-out loss, perplexity and bits per byte of a token-shard directory.

Its sequences are scored in order (the first `max_sequences`), every token a
target once. Bits per byte divide the summed loss (in bits) by the UTF-8
bytes the target tokens stand for, so models with different tokenizers
compare. `unigram_metrics` scores a unigram baseline on exactly those target
tokens, so the two numbers side by side (the quickstart's) measure the same text.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from shipyard.eval.loglik import token_byte_lengths, token_logprobs


@dataclass(frozen=True)
class DomainMetrics:
    """What `domain_metrics` measures on one held-out token set."""

    sequences: int
    """Sequences scored."""
    tokens: int
    """Target tokens scored."""
    loss: float
    """Mean negative log-likelihood, nats per token."""
    perplexity: float
    """exp(loss) (capped at exp(50))."""
    bytes: int | None
    """UTF-8 bytes the target tokens stand for (None without a tokenizer)."""
    bits_per_byte: float | None
    """Summed loss in bits over those bytes (None without a tokenizer)."""

    def to_json(self) -> dict:
        return asdict(self)


def _scored(shard_dir: str | Path, cfg, max_sequences: int):
    """(the sequence source, how many of its sequences are scored): sequences of min(max_seq_len, 512)
    + 1 tokens, sequence i covering tokens [i L, (i + 1) L], so the targets are tokens 1 .. n L."""
    from shipyard.data.loader import SequenceSource

    src = SequenceSource(shard_dir, cfg.max_seq_len if cfg.max_seq_len < 512 else 512, cfg.vocab_size)
    return src, min(len(src), max_sequences)


def _metrics(sequences: int, tokens: int, nats: float, nbytes: int | None) -> DomainMetrics:
    loss = nats / max(tokens, 1)
    return DomainMetrics(
        sequences=sequences,
        tokens=tokens,
        loss=loss,
        perplexity=math.exp(min(loss, 50.0)),
        bytes=nbytes,
        bits_per_byte=nats / math.log(2) / nbytes if nbytes else None,
    )


def domain_metrics(
    params, cfg, shard_dir: str | Path, tok, max_sequences: int, batch: int = 8
) -> DomainMetrics:
    """The model's held-out metrics on the first `max_sequences` sequences of `shard_dir`."""
    src, n = _scored(shard_dir, cfg, max_sequences)
    byte_len = token_byte_lengths(tok) if tok is not None else None
    nats, tokens, nbytes = 0.0, 0, 0
    for i in range(0, n, batch):
        rows = np.stack([src[j] for j in range(i, min(i + batch, n))])
        padded = np.zeros((batch, rows.shape[1]), np.int32)
        padded[: len(rows)] = rows
        logp, _ = token_logprobs(params, jnp.asarray(padded), cfg)
        nats -= float(np.asarray(logp)[: len(rows)].sum())
        tokens += rows[:, 1:].size
        if byte_len is not None:
            nbytes += int(byte_len[rows[:, 1:]].sum())
    return _metrics(n, tokens, nats, nbytes if byte_len is not None else None)


def unigram_metrics(
    train_tokens: str | Path, cfg, shard_dir: str | Path, tok, max_sequences: int
) -> DomainMetrics:
    """The baseline a model must beat, on the tokens `domain_metrics` scores with the same arguments:
    add-one-smoothed unigram frequencies of the training tokens (over cfg.vocab_size ids)."""
    from shipyard.data.shards import open_shards

    counts = np.ones(cfg.vocab_size, np.float64)
    for shard in open_shards(train_tokens)[1]:
        counts += np.bincount(np.asarray(shard), minlength=cfg.vocab_size)[: cfg.vocab_size]
    logp = np.log(counts / counts.sum())
    src, n = _scored(shard_dir, cfg, max_sequences)
    targets = src.tokens(1, n * src.seq_len + 1)
    nbytes = int(token_byte_lengths(tok)[targets].sum()) if tok is not None else None
    return _metrics(n, int(targets.size), -float(logp[targets].sum()), nbytes)
