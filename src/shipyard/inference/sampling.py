"""The sampling rules, written once for every sampler: the Generator (settings fixed per call), the
exported programs (settings as traced inputs) and the serving engine (settings per row) share the
top-k / top-p filter and the temperature floor; `generate`, `chat` and the OpenAI API share the
ranges a setting may take (`check_temperature`, `check_top_k`, `check_top_p`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

TEMPERATURE_MAX = 2.0
"""The highest temperature accepted (OpenAI's bound): beyond it samples are close to uniform noise."""

MIN_TEMPERATURE = 1e-6
"""Positive temperatures below this divide by it instead: logits / 1e-40 overflow float32 to inf (or
to nan, where a subnormal is flushed to zero), and categorical over several infs picks the first of
them, not the best. At this floor, sampling is greedy but for logits within ~1e-5 of the best."""


def check_temperature(value: float) -> float:
    """`value` if it is a temperature the samplers accept (0 = greedy, up to TEMPERATURE_MAX), else ValueError."""
    if not 0.0 <= value <= TEMPERATURE_MAX:  # (also refuses nan)
        raise ValueError(f"temperature must be between 0 (greedy) and {TEMPERATURE_MAX:g}, got {value:g}")
    return value


def check_top_k(value: int) -> int:
    """`value` if it is a top-k the samplers accept (0 or -1, vLLM's spelling, mean every token), else ValueError."""
    if value < -1:
        raise ValueError(f"top-k must be a number of tokens >= 1, or 0 (or -1) for all of them; got {value}")
    return value


def check_top_p(value: float) -> float:
    """`value` if it is a nucleus mass the samplers accept, in (0, 1] (1 = every token), else ValueError."""
    if not 0.0 < value <= 1.0:
        raise ValueError(f"top-p must be a probability mass in (0, 1] (1 keeps every token), got {value:g}")
    return value


def filter_logits(logits: jax.Array, top_k, top_p) -> jax.Array:
    """logits [batch, vocab] with the tokens outside the top-k and the top-p nucleus set to -inf.

    `top_k` and `top_p` are numbers or arrays, one value for the batch or [batch] (a value per row);
    top_k 0 (or below) keeps every token, and so does a top_p of 1 or more. Top-p keeps the smallest
    prefix of the ranked tokens whose mass reaches it, computed after top-k (always at least the best
    token). One descending sort serves both (masking below the k-th value keeps that order).
    """
    batch, vocab = logits.shape
    top_k = jnp.reshape(jnp.asarray(top_k), (-1, 1))
    top_p = jnp.reshape(jnp.asarray(top_p), (-1, 1))
    order = jnp.argsort(-logits, axis=-1)
    ranked = jnp.take_along_axis(logits, order, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(ranked, jnp.broadcast_to(k - 1, (batch, 1)), axis=-1)
    logits = jnp.where(logits < kth, -jnp.inf, logits)
    ranked = jnp.where(ranked < kth, -jnp.inf, ranked)
    probs = jax.nn.softmax(ranked, axis=-1)
    # top_p >= 1 keeps all: the float32 cumulative sum can reach 1.0 before the tail, which would
    # drop a row's last few tokens; the best token (rank 0) stays whatever top_p is.
    before = jnp.cumsum(probs, axis=-1) - probs
    drop_ranked = (before >= top_p) & (top_p < 1.0) & (jnp.arange(vocab) > 0)
    drop = jnp.zeros_like(drop_ranked).at[jnp.arange(batch)[:, None], order].set(drop_ranked)
    return jnp.where(drop, -jnp.inf, logits)
