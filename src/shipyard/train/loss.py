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


def loss_sums(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> LossSums:
    """logits [..., vocab] (any dtype; upcast here), integer targets and 0/1 mask [...]."""
    logits = logits.astype(jnp.float32)
    mask = mask.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    # Entropy of softmax(logits) = lse - sum_i p_i * logit_i; it is a diagnostic
    # (collapse / over-confidence), so no gradient flows through it.
    probs = jnp.exp(logits - lse[..., None])
    entropy = jax.lax.stop_gradient(lse - jnp.sum(probs * logits, axis=-1))
    return LossSums(
        ce=jnp.sum((lse - target_logit) * mask),
        z=jnp.sum(jnp.square(lse) * mask),
        entropy=jnp.sum(entropy * mask),
        tokens=jnp.sum(mask),
    )
