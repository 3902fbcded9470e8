"""Next-token cross-entropy in fp32, with z-loss and predictive entropy."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LossSums:
    """Per-token quantities summed over the (masked) tokens of a batch.

    Sums, not means, so microbatches and shards add up exactly; divide by
    `tokens` at the end.
    """

    ce: jax.Array
    z: jax.Array
    entropy: jax.Array
    tokens: jax.Array


@jax.custom_vjp
def token_stats(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-token (logsumexp, target logit, entropy) of fp32 logits [..., vocab].

    One pass over the vocabulary computes the softmax once; the backward pass
    reuses it (dlogits = g_lse * p + g_target * onehot) instead of
    recomputing exp over the [tokens, vocab] array, which is the largest
    elementwise work in a small model's step. The entropy (-sum p log p =
    lse - sum p * logit) is a diagnostic and carries no gradient.
    """
    return _token_stats_fwd(logits, targets)[0]


def _token_stats_fwd(logits, targets):
    m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    e = jnp.exp(logits - m)
    z = jnp.sum(e, axis=-1, keepdims=True)
    p = e / z
    lse = (m + jnp.log(z))[..., 0]
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    entropy = lse - jnp.sum(p * logits, axis=-1)
    return (lse, target_logit, entropy), (p, targets)


def _token_stats_bwd(res, g):
    p, targets = res
    g_lse, g_target, _ = g
    onehot = jax.nn.one_hot(targets, p.shape[-1], dtype=p.dtype)
    return g_lse[..., None] * p + g_target[..., None] * onehot, None


token_stats.defvjp(_token_stats_fwd, _token_stats_bwd)


def loss_sums(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> LossSums:
    """logits [..., vocab] (any dtype; upcast here), integer targets and 0/1 mask [...]."""
    return sums_from_stats(*token_stats(logits.astype(jnp.float32), targets), mask)


def sums_from_stats(lse: jax.Array, target_logit: jax.Array, entropy: jax.Array, mask: jax.Array) -> LossSums:
    """LossSums from per-token fp32 (logsumexp, target logit, entropy) and a 0/1 mask, all [...]
    (from `token_stats`, or chunk by chunk from `chunked_loss.chunk_stats`)."""
    mask = mask.astype(jnp.float32)
    return LossSums(
        ce=jnp.sum((lse - target_logit) * mask),
        z=jnp.sum(jnp.square(lse) * mask),
        entropy=jnp.sum(jax.lax.stop_gradient(entropy) * mask),
        tokens=jnp.sum(mask),
    )
