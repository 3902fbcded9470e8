"""Preference losses on summed reply log-probs: DPO (Rafailov et al., 2023), SimPO (Meng et al., 2024)
and ORPO (Hong et al., 2024).

A packed row holds P pairs; reply slot 2k is the chosen reply of its k-th
pair, 2k+1 the rejected one (data/preference.py). `reply_logps` sums the
policy's per-token log p(target) over each slot's tokens; `preference_sums`
turns those into the loss and metrics as sums over valid pairs, so
microbatches and data shards add up exactly (divide by `pairs` at the end).

DPO, with z = beta [(pi_c - ref_c) - (pi_r - ref_r)]:
    loss = -(1 - ls) log sigmoid(z) - ls log sigmoid(-z)
where ls is the label smoothing of conservative DPO (the assumed probability
that a pair's labels are flipped; 0 is the paper's loss). The implicit
rewards are beta (pi - ref) per reply.

SimPO has no reference; with length-normalised log-probs,
z = beta (pi_c / |c| - pi_r / |r|) - gamma, the same smoothed loss, and
rewards beta pi / |y|. The margin reported is chosen reward - rejected
reward (gamma not subtracted).

ORPO has no reference either: with the mean token log-prob m = pi / |y| of a
reply (log P of the paper's length-normalised likelihood P), its log-odds are
m - log(1 - e^m) and
    loss = -m_c - beta log sigmoid(log odds_c - log odds_r)
(the chosen reply's per-token NLL plus beta times the odds-ratio term, eq. 6 of
the paper; beta is its lambda). Rewards beta m, as TRL reports them. Label
smoothing does not apply (config refuses it).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from shipyard.config import PreferenceConfig
from shipyard.train.loss import token_stats


def reply_logps(
    logits: jax.Array, targets: jax.Array, slots: jax.Array, num_slots: int
) -> tuple[jax.Array, jax.Array]:
    """(summed log p(target) [B, num_slots] fp32, tokens [B, num_slots] fp32) per reply slot.

    logits [B, L, V] (any dtype; upcast here), targets and slots [B, L]
    (slot -1: not a reply token). A segment sum per row, not a [B, L, slots]
    one-hot (as large as the logits for long rows); per row so the result
    keeps the batch axis, and its sharding, of the inputs.
    """
    lse, target_logit, _ = token_stats(logits.astype(jnp.float32), targets)
    return reply_logps_from_stats(lse, target_logit, slots, num_slots)


def reply_logps_from_stats(
    lse: jax.Array, target_logit: jax.Array, slots: jax.Array, num_slots: int
) -> tuple[jax.Array, jax.Array]:
    """`reply_logps` from per-token fp32 logsumexp and target logit [B, L] (as
    `chunked_loss.head_token_stats` gives them, without the whole logits)."""
    valid = slots >= 0
    logp = jnp.where(valid, target_logit - lse, 0.0)
    bucket = jnp.where(valid, slots, num_slots)  # untrained positions go to one spare bucket, dropped

    def per_row(x, b):
        return jax.ops.segment_sum(x, b, num_segments=num_slots + 1)[:num_slots]

    return jax.vmap(per_row)(logp, bucket), jax.vmap(per_row)(valid.astype(jnp.float32), bucket)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PreferenceSums:
    """Per-pair quantities summed over the valid pairs of a batch (divide by `pairs`)."""

    loss: jax.Array
    correct: jax.Array
    """Pairs whose chosen reward exceeds the rejected reward."""
    margin: jax.Array
    """Sum of chosen reward - rejected reward."""
    chosen_logps: jax.Array
    rejected_logps: jax.Array
    chosen_rewards: jax.Array
    rejected_rewards: jax.Array
    pairs: jax.Array


def _log1mexp(x: jax.Array) -> jax.Array:
    """log(1 - e^x) for x < 0, accurate near 0 (expm1) and far below it (log1p): Maechler (2012)."""
    return jnp.where(x > -0.6931471805599453, jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def _pair_losses(policy, reference, counts, cfg: PreferenceConfig):
    """(chosen rewards, rejected rewards, loss) [B, P] of the configured loss."""
    pc, pr = policy[:, 0::2], policy[:, 1::2]
    ls = cfg.label_smoothing

    def smoothed(z):
        return -(1.0 - ls) * jax.nn.log_sigmoid(z) - ls * jax.nn.log_sigmoid(-z)

    if cfg.loss == "dpo":
        if reference is None:
            raise ValueError("train.preference.loss=dpo needs the reference log-probs")
        reference = jax.lax.stop_gradient(reference)  # the reference model is frozen
        chosen = cfg.beta * (pc - reference[:, 0::2])
        rejected = cfg.beta * (pr - reference[:, 1::2])
        return chosen, rejected, smoothed(chosen - rejected)
    # an empty slot (no k-th pair in the row) has count 0: divide by 1 there, it is masked out later
    nc, nr = jnp.maximum(counts[:, 0::2], 1.0), jnp.maximum(counts[:, 1::2], 1.0)
    if cfg.loss == "simpo":
        chosen, rejected = cfg.beta * pc / nc, cfg.beta * pr / nr
        return chosen, rejected, smoothed(chosen - rejected - cfg.gamma)
    if cfg.loss == "orpo":
        # An empty slot's mean is 0, where log(1 - e^0) = -inf and its gradient NaN even under the
        # mask (0 * NaN): clamp just below 0, which only a reply of probability 1 in fp32 also reaches.
        mc, mr = jnp.minimum(pc / nc, -1e-6), jnp.minimum(pr / nr, -1e-6)
        log_odds = (mc - _log1mexp(mc)) - (mr - _log1mexp(mr))
        return cfg.beta * mc, cfg.beta * mr, -mc - cfg.beta * jax.nn.log_sigmoid(log_odds)
    raise ValueError(f"train.preference.loss: unknown loss {cfg.loss!r}")


def preference_sums(
    policy: jax.Array,
    reference: jax.Array | None,
    counts: jax.Array,
    pair_mask: jax.Array,
    cfg: PreferenceConfig,
) -> PreferenceSums:
    """Loss and metric sums of policy (and, for dpo, reference) reply log-probs [B, 2P]; even slots chosen,
    odd rejected; counts [B, 2P] reply tokens; pair_mask [B, P] 1 where the row has a k-th pair."""
    policy = policy.astype(jnp.float32)
    m = pair_mask.astype(jnp.float32)
    chosen, rejected, per_pair = _pair_losses(policy, reference, counts.astype(jnp.float32), cfg)

    def total(x):
        return jnp.sum(jnp.where(m > 0, x, 0.0))

    return PreferenceSums(
        loss=total(per_pair),
        correct=total((chosen > rejected).astype(jnp.float32)),
        margin=total(chosen - rejected),
        chosen_logps=total(policy[:, 0::2]),
        rejected_logps=total(policy[:, 1::2]),
        chosen_rewards=total(chosen),
        rejected_rewards=total(rejected),
        pairs=jnp.sum(m),
    )


def preference_metrics(sums: PreferenceSums) -> dict[str, jax.Array]:
    """Per-pair means: loss, pref_accuracy, reward_margin, chosen/rejected logps and rewards."""
    n = jnp.maximum(sums.pairs, 1.0)
    return {
        "loss": sums.loss / n,
        "pref_accuracy": sums.correct / n,
        "reward_margin": sums.margin / n,
        "chosen_logps": sums.chosen_logps / n,
        "rejected_logps": sums.rejected_logps / n,
        "chosen_reward": sums.chosen_rewards / n,
        "rejected_reward": sums.rejected_rewards / n,
    }
