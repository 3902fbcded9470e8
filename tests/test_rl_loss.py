"""rl/loss.py against an independent torch transcription of GRPO, Dr. GRPO and DAPO: advantages,
the clipped surrogate with clip-higher, the k3 KL, the three aggregations; loss and gradients with
respect to the logits on a fixed batch, within 1e-5."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from shipyard.rl.loss import group_advantages, policy_loss

N, G, T, V = 3, 4, 7, 11
MAX_TOKENS = 9


def _batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(N * G, T, V)).astype(np.float32)
    targets = rng.integers(0, V, size=(N * G, T))
    lengths = rng.integers(1, T + 1, size=N * G)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    mask[5] = 0.0  # a reply left out of the loss (overlong, masked): still in its group's baseline
    rewards = rng.integers(0, 2, size=(N, G)).astype(np.float32)
    rewards[1] = [0.0, 1.0, 1.0, 0.5]
    # the sampler's and the reference's log-probs: the policy's, moved (ratios from ~0.6 to ~1.5)
    logp = np.take_along_axis(
        logits - np.log(np.exp(logits).sum(-1, keepdims=True)), targets[..., None], axis=-1
    )[..., 0]
    old = logp + rng.normal(scale=0.25, size=logp.shape).astype(np.float32)
    ref = logp + rng.normal(scale=0.3, size=logp.shape).astype(np.float32)
    return logits, targets, mask, rewards, old, ref


def _torch_reference(logits, targets, mask, rewards, old, ref, adv_kind, aggregation, beta, lo, hi):
    """The papers' formulas, written out reply by reply (float64)."""
    x = torch.tensor(logits, dtype=torch.float64, requires_grad=True)
    logp_all = torch.log_softmax(x, dim=-1)
    r = torch.tensor(rewards, dtype=torch.float64)
    advantages = []
    for group in r:
        centred = group - group.mean()
        advantages.append(centred / (group.std() + 1e-4) if adv_kind == "group_std" else centred)
    adv = torch.cat(advantages)
    per_reply, total, count = [], 0.0, 0.0
    for i in range(logits.shape[0]):
        terms = []
        for t in range(logits.shape[1]):
            if mask[i, t] == 0:
                continue
            lp = logp_all[i, t, int(targets[i, t])]
            ratio = torch.exp(lp - float(old[i, t]))
            surrogate = torch.min(ratio * adv[i], torch.clamp(ratio, 1 - lo, 1 + hi) * adv[i])
            d = torch.clamp(float(ref[i, t]) - lp, -20.0, 20.0)  # bounded as verl's low_var_kl
            kl = torch.clamp(torch.exp(d) - d - 1, max=10.0)
            terms.append(-(surrogate - beta * kl))
        if not terms:
            continue
        s = torch.stack(terms).sum()
        per_reply.append(s / len(terms))
        total = total + s
        count += len(terms)
    if aggregation == "sequence":
        loss = torch.stack(per_reply).mean()
    elif aggregation == "token":
        loss = total / count
    else:
        loss = total / (len(per_reply) * MAX_TOKENS)
    loss.backward()
    return loss.item(), x.grad.numpy()


@pytest.mark.parametrize(
    "adv_kind, aggregation, beta, clip",
    [
        ("group_std", "sequence", 0.04, (0.2, 0.2)),  # GRPO with a KL term
        ("group_std", "token", 0.0, (0.2, 0.28)),  # DAPO: token-level, clip-higher
        ("group_mean", "constant", 0.0, (0.2, 0.2)),  # Dr. GRPO
        ("group_mean", "token", 0.1, (0.1, 0.3)),
    ],
)
def test_loss_and_gradients_equal_a_torch_transcription(adv_kind, aggregation, beta, clip):
    logits, targets, mask, rewards, old, ref = _batch()
    lo, hi = clip

    def loss_of(x):
        logp = jnp.take_along_axis(jax.nn.log_softmax(x, axis=-1), targets[..., None], axis=-1)[..., 0]
        adv = group_advantages(jnp.asarray(rewards), adv_kind).reshape(-1)
        return policy_loss(
            logp,
            jnp.asarray(old),
            adv,
            jnp.asarray(mask),
            clip_low=lo,
            clip_high=hi,
            aggregation=aggregation,
            max_tokens=MAX_TOKENS,
            beta=beta,
            ref_logp=jnp.asarray(ref),
        )

    (loss, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(jnp.asarray(logits))
    want_loss, want_grads = _torch_reference(
        logits, targets, mask, rewards, old, ref, adv_kind, aggregation, beta, lo, hi
    )
    assert abs(float(loss) - want_loss) < 1e-5
    np.testing.assert_allclose(np.asarray(grads), want_grads, rtol=0, atol=1e-5)
    assert 0 < float(metrics["clip_fraction"]) < 1  # the batch exercises the clipping
    assert float(metrics["ratio_max"]) > 1 + hi


def test_at_the_sampler_s_own_log_probs_the_ratio_is_one_and_the_kl_zero():
    logits, targets, mask, rewards, _, _ = _batch(1)
    logp = jnp.take_along_axis(jax.nn.log_softmax(jnp.asarray(logits)), targets[..., None], axis=-1)[..., 0]
    adv = group_advantages(jnp.asarray(rewards), "group_std").reshape(-1)
    _, m = policy_loss(
        logp, logp, adv, jnp.asarray(mask), clip_low=0.2, clip_high=0.2, aggregation="token", max_tokens=9
    )
    assert float(m["ratio_mean"]) == 1.0 and float(m["ratio_max"]) == 1.0
    assert float(m["kl_rollout"]) == 0.0 and float(m["clip_fraction"]) == 0.0


def test_a_token_outside_the_policy_s_support_has_ratio_zero_and_finite_gradients():
    """After an update a trained token can fall outside the policy's top-k (log-prob -inf): the loss
    and its gradients stay finite, that token's ratio is 0 and its KL term is bounded."""
    from shipyard.inference.sampling import sampling_logits

    logits, targets, mask, rewards, old, ref = _batch(2)

    def loss_of(x):
        top3 = sampling_logits(x.reshape(-1, V), 1.0, 3, 1.0).reshape(x.shape)  # the rest at -inf
        logp = jnp.take_along_axis(jax.nn.log_softmax(top3, axis=-1), targets[..., None], axis=-1)[..., 0]
        adv = group_advantages(jnp.asarray(rewards), "group_std").reshape(-1)
        return policy_loss(
            logp, jnp.asarray(old), adv, jnp.asarray(mask), clip_low=0.2, clip_high=0.28,
            aggregation="token", max_tokens=MAX_TOKENS, beta=0.1, ref_logp=jnp.asarray(ref),
        )  # fmt: skip

    (loss, m), grads = jax.value_and_grad(loss_of, has_aux=True)(jnp.asarray(logits))
    assert np.isfinite(float(loss)) and np.isfinite(np.asarray(grads)).all()
    assert np.abs(np.asarray(grads)).max() > 0
    assert np.isfinite(float(m["kl_ref"])) and float(m["kl_ref"]) <= 10 and float(m["ratio_mean"]) < 0.9


def test_equal_rewards_give_no_advantage_and_unknown_settings_are_refused():
    assert np.all(np.asarray(group_advantages(jnp.ones((2, 4)), "group_std")) == 0)
    with pytest.raises(ValueError, match="advantage must be one of"):
        group_advantages(jnp.ones((2, 4)), "ppo")
    with pytest.raises(ValueError, match="aggregation must be one of"):
        policy_loss(
            jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.zeros(1), jnp.ones((1, 2)),
            clip_low=0.2, clip_high=0.2, aggregation="mean", max_tokens=2,
        )  # fmt: skip
