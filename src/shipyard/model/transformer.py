"""The dense Llama-3 family decoder: parameter specs and the forward pass."""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from shipyard.config import ModelConfig
from shipyard.model import layers
from shipyard.model.params import ArraySpec, count_params


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class BlockParams:
    """One transformer block's weights, each with a leading `layers` axis."""

    attn_norm: jax.Array
    wq: jax.Array
    wk: jax.Array
    wv: jax.Array
    wo: jax.Array
    q_norm: jax.Array | None
    k_norm: jax.Array | None
    mlp_norm: jax.Array
    w_gate: jax.Array
    w_up: jax.Array
    w_down: jax.Array


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TransformerParams:
    embed: jax.Array
    blocks: BlockParams
    final_norm: jax.Array
    lm_head: jax.Array | None  # None when embeddings are tied


def param_specs(cfg: ModelConfig) -> TransformerParams:
    """The spec tree of a model: shapes, logical axes, initialisers and roles."""
    L, E, H, K, D, M, V = (
        cfg.num_layers,
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.vocab_size,
    )
    std = cfg.init_std
    # Output projections feed the residual stream once per layer per branch;
    # shrinking their init by sqrt(2L) keeps the residual variance flat in depth.
    out_std = std / math.sqrt(2 * L)

    def norm(*shape_axes):
        shape, axes = zip(*shape_axes)
        return ArraySpec(tuple(shape), tuple(axes), "ones", role="norm")

    def mat(shape, axes, s, fan_in):
        return ArraySpec(shape, axes, "normal", std=s, role="weight", fan_in_axes=fan_in)

    blocks = BlockParams(
        attn_norm=norm((L, "layers"), (E, "embed")),
        wq=mat((L, E, H, D), ("layers", "embed", "heads", "head_dim"), std, (1,)),
        wk=mat((L, E, K, D), ("layers", "embed", "kv_heads", "head_dim"), std, (1,)),
        wv=mat((L, E, K, D), ("layers", "embed", "kv_heads", "head_dim"), std, (1,)),
        wo=mat((L, H, D, E), ("layers", "heads", "head_dim", "embed"), out_std, (1, 2)),
        q_norm=norm((L, "layers"), (D, "head_dim")) if cfg.qk_norm else None,
        k_norm=norm((L, "layers"), (D, "head_dim")) if cfg.qk_norm else None,
        mlp_norm=norm((L, "layers"), (E, "embed")),
        w_gate=mat((L, E, M), ("layers", "embed", "mlp"), std, (1,)),
        w_up=mat((L, E, M), ("layers", "embed", "mlp"), std, (1,)),
        w_down=mat((L, M, E), ("layers", "mlp", "embed"), out_std, (1,)),
    )
    return TransformerParams(
        embed=ArraySpec((V, E), ("vocab", "embed"), "normal", std=std, role="embedding"),
        blocks=blocks,
        final_norm=norm((E, "embed")),
        lm_head=None
        if cfg.tie_embeddings
        else ArraySpec((E, V), ("embed", "vocab"), "normal", std=std, role="head", fan_in_axes=(0,)),
    )


def num_params(cfg: ModelConfig) -> int:
    """Exact parameter count (from the spec tree; nothing is allocated)."""
    return count_params(param_specs(cfg))


_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _block(cfg: ModelConfig, x: jax.Array, p: BlockParams, cos, sin, segment_ids) -> jax.Array:
    K, G = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    h = layers.rms_norm(x, p.attn_norm, cfg.norm_eps)
    # One matmul for Q, K and V (and one for gate and up below) instead of
    # three (two): wider matmuls run far closer to peak on CPU, and the
    # weight copy this costs is tiny next to the activations. The fused
    # layout [embed, kv_heads, group + 2, head_dim] keeps kv_heads outermost,
    # so a kv_heads / heads sharding is preserved through the concatenation.
    wq = p.wq.reshape(p.wq.shape[0], K, G, p.wq.shape[-1])
    w_qkv = jnp.concatenate([wq, p.wk[:, :, None], p.wv[:, :, None]], axis=2)
    qkv = layers.dense(h, w_qkv.reshape(w_qkv.shape[0], -1)).reshape(*h.shape[:2], *w_qkv.shape[1:])
    q, k, v = qkv[:, :, :, :G], qkv[:, :, :, G], qkv[:, :, :, G + 1]
    if p.q_norm is not None:
        q = layers.rms_norm(q, p.q_norm, cfg.norm_eps)
        k = layers.rms_norm(k, p.k_norm, cfg.norm_eps)
    q = layers.apply_rope(q, cos, sin)
    k = layers.apply_rope(k, cos, sin)
    attn = layers.grouped_attention(q, k, v, segment_ids)
    x = x + layers.dense(attn.reshape(*attn.shape[:2], -1), p.wo.reshape(-1, p.wo.shape[-1]))
    h = layers.rms_norm(x, p.mlp_norm, cfg.norm_eps)
    return x + layers.swiglu(h, p.w_gate, p.w_up, p.w_down)


def hidden_states(
    params: TransformerParams,
    tokens: jax.Array,
    cfg: ModelConfig,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    activation_sharding=None,
) -> jax.Array:
    """Final-norm hidden states [batch, seq, embed] for token ids [batch, seq].

    Runs in the dtype of `params` (cast them first for mixed precision).
    `activation_sharding` (a Sharding for [batch, seq, embed]) pins the residual
    stream's layout at every block boundary, so the compiler cannot drift
    into a layout that gathers the batch (the partitioner only sees shardings
    of inputs and outputs otherwise).
    """

    def constrain(x):
        return x if activation_sharding is None else jax.lax.with_sharding_constraint(x, activation_sharding)

    if positions is None:
        positions = jnp.arange(tokens.shape[1])[None, :]
    cos, sin = layers.rope_cos_sin(
        positions, layers.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    )
    x = constrain(jnp.take(params.embed, tokens, axis=0))

    def body(x, p):
        return constrain(_block(cfg, x, p, cos, sin, segment_ids)), None

    if cfg.remat != "none":
        body = jax.checkpoint(body, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=False)
    x, _ = jax.lax.scan(body, x, params.blocks, unroll=min(cfg.scan_unroll, cfg.num_layers))
    return layers.rms_norm(x, params.final_norm, cfg.norm_eps)


def output_weights(params: TransformerParams) -> jax.Array:
    """The [embed, vocab] output projection (the embedding, transposed, when tied)."""
    return params.embed.T if params.lm_head is None else params.lm_head


def logits(params: TransformerParams, tokens: jax.Array, cfg: ModelConfig, **kw) -> jax.Array:
    """Next-token logits [batch, seq, vocab] in fp32."""
    h = hidden_states(params, tokens, cfg, **kw)
    return layers.dense(h, output_weights(params)).astype(jnp.float32)
