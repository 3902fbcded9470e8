"""Held-out loss, perplexity and bits per byte of a token-shard directory.

Its sequences are scored in order (the first `max_sequences`), every token a
target once. Bits per byte divide the summed loss (in bits) by the UTF-8
bytes the target tokens stand for, so models with different tokenizers
compare.
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


def domain_metrics(
    params, cfg, shard_dir: str | Path, tok, max_sequences: int, batch: int = 8
) -> DomainMetrics:
    from shipyard.data.loader import SequenceSource

    src = SequenceSource(shard_dir, cfg.max_seq_len if cfg.max_seq_len < 512 else 512, cfg.vocab_size)
    n = min(len(src), max_sequences)
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
    loss = nats / max(tokens, 1)
    return DomainMetrics(
        sequences=n,
        tokens=tokens,
        loss=loss,
        perplexity=math.exp(min(loss, 50.0)),
        bytes=nbytes if byte_len is not None else None,
        bits_per_byte=nats / math.log(2) / nbytes if nbytes else None,
    )
