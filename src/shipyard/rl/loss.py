"""The policy-gradient loss of RL from verifiable rewards: GRPO (Shao et al., 2024, DeepSeekMath),
Dr. GRPO (Liu et al., 2025) and DAPO's clip-higher and token-level aggregation (Yu et al., 2025).

A rollout batch holds N prompts x G replies. Each reply's reward r gives it one advantage, shared
by all its tokens, from its group of G:

    group_std  (GRPO):     A_i = (r_i - mean(r)) / (std(r) + eps)     (std with ddof 1, as TRL)
    group_mean (Dr. GRPO): A_i = r_i - mean(r)

With per-token log-probs of the policy being trained (logp), of the policy that sampled the
rollout (old: the engine's, under the same sampling transform, `sampling.sampling_logits`) and of
the reference model (ref):

    ratio_t     = exp(logp_t - old_t)
    surrogate_t = min(ratio_t A, clip(ratio_t, 1 - clip_low, 1 + clip_high) A)
    kl_t        = exp(ref_t - logp_t) - (ref_t - logp_t) - 1          (k3, Schulman 2020: >= 0)
    l_t         = -(surrogate_t - beta kl_t)

summed over reply tokens (mask m_t) and divided per `aggregation`:

    sequence (GRPO):     mean_i [ sum_t m_it l_it / sum_t m_it ]
    token (DAPO):        sum_it m_it l_it / sum_it m_it
    constant (Dr. GRPO): sum_it m_it l_it / (replies x max_tokens)

where the replies counted are those with a trained token (a batch padded to its fixed shape, or an
overlong reply masked out, has rows of none).

Everything here is a pure function of arrays (the loss, its metrics), so an independent torch
transcription checks it (tests/test_rl_loss.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ADVANTAGES = ("group_std", "group_mean")
AGGREGATIONS = ("sequence", "token", "constant")
STD_EPS = 1e-4
"""Added to a group's reward std before dividing (a group of equal rewards has std 0)."""


LOGP_FLOOR = -1e4
"""The policy's and the reference's log-prob of a trained token are floored here (-inf: outside the
support top-k / top-p leave; exp of the floor is exactly 0 in float32, as exp(-inf))."""
KL_LOG_RATIO_BOUND = 20.0
"""The k3 estimator's log-ratio log(ref / policy) is clipped to +-this (as verl's low_var_kl)."""
KL_BOUND = 10.0
"""A token's k3 KL is capped at this (as verl's low_var_kl)."""


def group_advantages(rewards: jax.Array, kind: str) -> jax.Array:
    """Advantages [N, G] of rewards [N, G] (a row per prompt's group), per `kind` (ADVANTAGES)."""
    rewards = rewards.astype(jnp.float32)
    centred = rewards - jnp.mean(rewards, axis=1, keepdims=True)
    if kind == "group_mean":
        return centred
    if kind != "group_std":
        raise ValueError(f"advantage must be one of {ADVANTAGES}, got {kind!r}")
    return centred / (jnp.std(rewards, axis=1, keepdims=True, ddof=1) + STD_EPS)


def policy_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    clip_low: float,
    clip_high: float,
    aggregation: str,
    max_tokens: int,
    beta: float = 0.0,
    ref_logp: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss, metrics) of replies [B, T]: per-token log-probs `logp`, `old_logp` (and `ref_logp`
    with beta > 0), one advantage per reply [B], `mask` [B, T] 1 on the reply's trained tokens.

    Metrics (over the trained tokens): the importance ratio's mean and max, the fraction of tokens
    whose surrogate is clipped (the clipped term is the smaller), the k3 KL's mean (0 without a
    reference), and KL(old || policy)'s per-token estimate mean(old - logp) (0 when they agree).
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    mask = mask.astype(jnp.float32)
    # positions outside the replies may hold -inf (a padding target outside top-k): zero them first,
    # as inf x 0 is nan
    # A trained token can leave the policy's top-k / top-p support after an update (log-prob -inf):
    # its ratio is 0 either way (the surrogate then clipped, pessimistically); the floor keeps
    # kl_rollout finite, and the k3 bounds below its KL term (inf otherwise: nan gradients).
    logp = jnp.maximum(jnp.where(mask > 0, logp, 0.0), LOGP_FLOOR)
    old_logp = jnp.where(mask > 0, old_logp, 0.0)
    if ref_logp is not None:
        ref_logp = jnp.maximum(jnp.where(mask > 0, ref_logp, 0.0), LOGP_FLOOR)
    adv = advantages.astype(jnp.float32)[:, None]
    ratio = jnp.exp(logp - old_logp)
    clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    surrogate = jnp.minimum(ratio * adv, clipped * adv)
    if ref_logp is not None and beta:
        # k3 with its log-ratio and its value bounded (KL_LOG_RATIO_BOUND, KL_BOUND): one token far
        # from the reference cannot overflow the loss
        diff = jnp.clip(ref_logp - logp, -KL_LOG_RATIO_BOUND, KL_LOG_RATIO_BOUND)
        kl = jnp.minimum(jnp.exp(diff) - diff - 1.0, KL_BOUND)
    else:
        kl = jnp.zeros_like(logp)
    per_token = -(surrogate - beta * kl)
    tokens = jnp.maximum(jnp.sum(mask), 1.0)
    counts = jnp.sum(mask, axis=1)
    replies = jnp.maximum(jnp.sum(counts > 0), 1)
    if aggregation == "sequence":
        per_reply = jnp.sum(per_token * mask, axis=1) / jnp.maximum(counts, 1.0)
        loss = jnp.sum(per_reply) / replies
    elif aggregation == "token":
        loss = jnp.sum(per_token * mask) / tokens
    else:
        loss = jnp.sum(per_token * mask) / (replies * max_tokens)
    was_clipped = (clipped * adv < ratio * adv).astype(jnp.float32)
    metrics = {
        "ratio_mean": jnp.sum(ratio * mask) / tokens,
        "ratio_max": jnp.max(jnp.where(mask > 0, ratio, -jnp.inf)),
        "clip_fraction": jnp.sum(was_clipped * mask) / tokens,
        "kl_ref": jnp.sum(kl * mask) / tokens,
        "kl_rollout": jnp.sum((old_logp - logp) * mask) / tokens,
    }
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)
