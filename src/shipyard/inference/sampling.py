"""The top-k / top-p rule, written once for every sampler: the Generator (settings fixed per call), the
exported programs (settings as traced inputs) and the serving engine (settings per row)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def filter_logits(logits: jax.Array, top_k, top_p) -> jax.Array:
    """logits [batch, vocab] with the tokens outside the top-k and the top-p nucleus set to -inf.

    `top_k` and `top_p` are numbers or arrays, one value for the batch or [batch] (a value per row);
    top_k 0 keeps every token, and so does a top_p above 1. Top-p keeps the smallest prefix of the
    ranked tokens whose mass reaches it, computed after top-k (always at least the best token). One
    descending sort serves both (masking below the k-th value keeps that order).
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
    drop_ranked = (jnp.cumsum(probs, axis=-1) - probs) >= top_p
    drop = jnp.zeros_like(drop_ranked).at[jnp.arange(batch)[:, None], order].set(drop_ranked)
    return jnp.where(drop, -jnp.inf, logits)
