"""RL's trainer side: the policy's per-token log-probs of rollout replies under the rollout's own
sampling transform, and the optimizer step on the loss of rl/loss.py.

A rollout batch is a dict of arrays of one fixed shape (rows padded, so the step compiles once):

    tokens      [B, L]    prompt then reply, left-aligned, zeros after
    mask        [B, L-1]  1 where position t's target tokens[t+1] is a trained reply token
    old_logp    [B, L-1]  the rollout engine's log-prob of that target (same transform)
    advantages  [B]       the reply's advantage (rl/loss.py: group_advantages)

The log-probs are log_softmax of `sampling.sampling_logits(logits, temperature, top_k, top_p)`: the
distribution the engine drew each token from. So at the first optimizer step of a batch the policy
is the sampler and the importance ratio is 1 up to the two forwards' rounding (tests/test_rl.py).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import optax

from shipyard.config import ModelConfig, RLConfig
from shipyard.inference.sampling import sampling_logits
from shipyard.model import transformer
from shipyard.rl.loss import policy_loss


def token_logps(params, tokens: jax.Array, cfg: ModelConfig, temperature, top_k, top_p):
    """(log-prob [B, L-1] of each next token under the sampling transform, that distribution's
    entropy [B, L-1]) of the model `params` on `tokens` [B, L]."""
    logits = transformer.logits(params, tokens[:, :-1], cfg)
    B, T, V = logits.shape
    flat = sampling_logits(logits.reshape(B * T, V), temperature, top_k, top_p)
    logp_all = jax.nn.log_softmax(flat, axis=-1)
    chosen = jnp.take_along_axis(logp_all, tokens[:, 1:].reshape(B * T, 1), axis=-1)[:, 0]
    p = jnp.exp(logp_all)
    entropy = -jnp.sum(jnp.where(p > 0, p * logp_all, 0.0), axis=-1)
    return chosen.reshape(B, T), entropy.reshape(B, T)


def build_optimizer(rl: RLConfig) -> optax.GradientTransformation:
    """AdamW at a constant rate, after clipping the gradient's global norm (rl.grad_clip)."""
    adam = optax.adamw(rl.lr, weight_decay=rl.weight_decay)
    return adam if rl.grad_clip is None else optax.chain(optax.clip_by_global_norm(rl.grad_clip), adam)


def _loss(params, batch, reference, *, cfg: ModelConfig, rl: RLConfig):
    transform = (rl.temperature, rl.top_k, rl.top_p)
    logp, entropy = token_logps(params, batch["tokens"], cfg, *transform)
    ref = None
    if rl.beta:
        ref = jax.lax.stop_gradient(token_logps(reference, batch["tokens"], cfg, *transform)[0])
    loss, metrics = policy_loss(
        logp,
        batch["old_logp"],
        batch["advantages"],
        batch["mask"],
        clip_low=rl.clip_low,
        clip_high=rl.clip_high,
        aggregation=rl.aggregation,
        max_tokens=rl.max_tokens,
        beta=rl.beta,
        ref_logp=ref,
    )
    mask = batch["mask"]
    entropy = jnp.where(mask > 0, entropy, 0.0)
    metrics["entropy"] = jax.lax.stop_gradient(jnp.sum(entropy) / jnp.maximum(jnp.sum(mask), 1.0))
    return loss, metrics


def make_update(cfg: ModelConfig, rl: RLConfig, optimizer: optax.GradientTransformation):
    """`update(params, opt_state, batch, reference) -> (params, opt_state, metrics)`, jitted: one
    optimizer step on the batch's loss (`reference`: the starting params, used when rl.beta > 0)."""
    grad = jax.value_and_grad(partial(_loss, cfg=cfg, rl=rl), has_aux=True)

    def update(params, opt_state, batch, reference):
        (loss, metrics), grads = grad(params, batch, reference)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        metrics = {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads)}
        return optax.apply_updates(params, updates), opt_state, metrics

    return jax.jit(update, donate_argnums=(0, 1))


def make_logps(cfg: ModelConfig, rl: RLConfig):
    """`logps(params, tokens) -> [B, L-1]`, jitted: the trainer's log-probs (the on-policy check)."""
    return jax.jit(
        lambda params, tokens: token_logps(params, tokens, cfg, rl.temperature, rl.top_k, rl.top_p)[0]
    )
