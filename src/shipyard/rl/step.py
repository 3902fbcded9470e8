"""RL's trainer side: the policy's per-token log-probs of rollout replies under the rollout's own
sampling transform, and the optimizer step on the loss of rl/loss.py.

A rollout batch is a dict of arrays of one fixed shape (rows padded, so the step compiles once):

    tokens      [B, L]    prompt then reply, left-aligned, zeros after
    mask        [B, L-1]  1 where position t's target tokens[t+1] is a trained reply token
    old_logp    [B, L-1]  the rollout engine's log-prob of that target (same transform)
    advantages  [B]       the reply's advantage (rl/loss.py: group_advantages)

The log-probs are log_softmax of `sampling.sampling_logits(logits, temperature, top_k, top_p)`: the
distribution the engine drew each token from. The trainer and the engine run one model config
(`on_policy_model`: on CPU attention's `ordered` core) and compile with the same XLA options
(`decode_compiler_options`), and the engine lays rows out as the trainer does
(`Engine(training_numerics=True)`): so every rollout log-prob is bitwise the trainer's, and at the
first optimizer step of a batch the importance ratio is exactly 1 (tests/test_rl.py).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

from shipyard.config import ModelConfig, RLConfig
from shipyard.inference.engine import decode_compiler_options
from shipyard.inference.sampling import sampling_logits
from shipyard.model import attention, transformer
from shipyard.model.partition import Partition
from shipyard.parallel import backend
from shipyard.rl.loss import policy_loss


def token_distribution(params, tokens: jax.Array, cfg: ModelConfig, temperature, top_k, top_p, layout=None):
    """Log-probs [B, L-1, V] of every next token under the sampling transform, from the model
    `params` on `tokens` [B, L] (`layout`: the trainer's mesh layout, None on one device)."""
    logits = transformer.logits(params, tokens[:, :-1], cfg, layout=layout)
    B, T, V = logits.shape
    flat = sampling_logits(logits.reshape(B * T, V), temperature, top_k, top_p)
    return jax.nn.log_softmax(flat, axis=-1).reshape(B, T, V)


def token_logps(params, tokens: jax.Array, cfg: ModelConfig, temperature, top_k, top_p, layout=None):
    """(log-prob [B, L-1] of each next token under the sampling transform, that distribution's
    entropy [B, L-1]) of the model `params` on `tokens` [B, L]."""
    logp_all = token_distribution(params, tokens, cfg, temperature, top_k, top_p, layout)
    chosen = jnp.take_along_axis(logp_all, tokens[:, 1:, None], axis=-1)[..., 0]
    p = jnp.exp(logp_all)
    entropy = -jnp.sum(jnp.where(p > 0, p * logp_all, 0.0), axis=-1)
    return chosen, entropy


def sequence_length(longest: int, max_tokens: int) -> int:
    """Tokens per row of an RL run for prompts of up to `longest` tokens: prompt + reply + headroom for
    longer prompts, a multiple of 16. On a GPU one more, so that the trainer's positions (length - 1:
    each predicts the next token) are the multiple of 16: XLA:GPU's Triton GEMM tiling finds no tile
    sizes for the update's fp32 dots over rows x (16k - 1) positions (jax-cuda13 0.10.2, compiled
    for an H100 by tests/test_targets.py; 16k + 1 compiles)."""
    length = -(-(longest + max_tokens + 8) // 16) * 16
    return length + 1 if backend.platform() == "gpu" else length


def on_policy_model(cfg: ModelConfig, length: int) -> ModelConfig:
    """The model config RL's trainer and rollout engine both run for sequences of `length` tokens: on
    CPU, where attention would be the reference core, the `ordered` one (model/attention.py), whose
    sums over keys the engine's cached steps repeat bit for bit. Elsewhere `cfg` as it is: a GPU's
    or TPU's kernels give no such promise, and `blocked` (long sequences) keeps its memory bound."""
    if not backend.on_cpu():
        return cfg
    if attention.attention_impl(cfg, "cpu", length, jnp.float32, False) != "reference":
        return cfg
    return cfg.model_copy(update={"attention_impl": "ordered"})


def build_optimizer(rl: RLConfig) -> optax.GradientTransformation:
    """AdamW at a constant rate, after clipping the gradient's global norm (rl.grad_clip)."""
    adam = optax.adamw(rl.lr, weight_decay=rl.weight_decay)
    return adam if rl.grad_clip is None else optax.chain(optax.clip_by_global_norm(rl.grad_clip), adam)


def _loss(
    trainable, batch, frozen, reference, *, cfg: ModelConfig, rl: RLConfig, partition: Partition, layout
):
    transform = (rl.temperature, rl.top_k, rl.top_p)
    params = partition.merge(trainable, frozen)
    logp, entropy = token_logps(params, batch["tokens"], cfg, *transform, layout)
    ref = None
    if rl.beta:
        ref_params = partition.merge(reference, frozen)
        ref = jax.lax.stop_gradient(token_logps(ref_params, batch["tokens"], cfg, *transform, layout)[0])
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


def make_update(
    cfg: ModelConfig, rl: RLConfig, optimizer: optax.GradientTransformation, partition: Partition, layout=None
):
    """`update(trainable, opt_state, batch, frozen, reference) -> (trainable, opt_state, metrics)`,
    jitted: one optimizer step on the batch's loss. `trainable` and `frozen` are `partition`'s two
    parts (everything and None for full training); `reference`: the starting trainable part, for
    the KL term when rl.beta > 0."""
    loss = partial(_loss, cfg=cfg, rl=rl, partition=partition, layout=layout)
    grad = jax.value_and_grad(loss, has_aux=True)

    def update(trainable, opt_state, batch, frozen, reference):
        (value, metrics), grads = grad(trainable, batch, frozen, reference)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        metrics = {**metrics, "loss": value, "grad_norm": optax.tree.norm(grads)}
        return optax.apply_updates(trainable, updates), opt_state, metrics

    # compiled as the engine's steps are (`make_distribution`): the ratio of a batch's first step is 1
    return jax.jit(update, donate_argnums=(0, 1), compiler_options=decode_compiler_options())


def make_distribution(cfg: ModelConfig, rl: RLConfig, partition: Partition | None = None, layout=None):
    """`distribution(trainable, frozen, tokens) -> [B, L-1, V]`, jitted: the trainer's log-probs of
    every next token. One program for both sides of fixed-shape mode (rl/fixed_rollout.py samples
    from it; `make_logps` reads the replies' tokens from it), so they agree bit for bit."""
    partition = partition or Partition(cfg, None)

    def distribution(trainable, frozen, tokens):
        params = partition.merge(trainable, frozen)
        return token_distribution(params, tokens, cfg, rl.temperature, rl.top_k, rl.top_p, layout)

    # compiled as the engine's steps are (`Engine(training_numerics=True)`): its rows then round as
    # the engine's cached steps do, so engine-mode rollouts' log-probs are bitwise these too
    return jax.jit(distribution, compiler_options=decode_compiler_options())


def make_logps(cfg: ModelConfig, rl: RLConfig, partition: Partition | None = None, layout=None):
    """`logps(trainable, tokens, frozen=None) -> [B, L-1]`: the trainer's log-prob of each next token
    (the on-policy check): `make_distribution`'s program, the tokens' entries picked after it."""
    distribution = make_distribution(cfg, rl, partition, layout)

    def logps(trainable, tokens, frozen=None):
        every = np.asarray(distribution(trainable, frozen, tokens))
        return np.take_along_axis(every, np.asarray(tokens)[:, 1:, None], axis=-1)[..., 0]

    return logps
