"""The Llama-3 family decoder (dense or mixture-of-experts MLPs): parameter specs and the forward pass.

Layers are stacked on a leading `layers` axis and run by `lax.scan`. A scan
needs identical layers, so a model with MoE has two stacks: `blocks` (the
first `moe.first_dense_layers` layers, dense MLPs; every layer of a dense
model) and `moe_blocks` (the rest). Either is None when it has no layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from shipyard.config import ModelConfig
from shipyard.model import attention, layers, quant, ring_attention
from shipyard.model.lora import LoraParams, delta
from shipyard.model.moe import MoEParams, MoEStats, expert_params_per_layer, moe_mlp, moe_specs
from shipyard.model.params import ArraySpec, count_params
from shipyard.parallel import pipeline
from shipyard.parallel.layout import Layout


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
    w_gate: jax.Array | None
    """Dense SwiGLU MLP (None in MoE blocks)."""
    w_up: jax.Array | None
    w_down: jax.Array | None
    moe: MoEParams | None = None
    """Mixture-of-experts MLP (None in dense blocks)."""
    bq: jax.Array | None = None
    """[layers, heads, head_dim] query bias (qkv_bias models only); bk, bv likewise over kv_heads."""
    bk: jax.Array | None = None
    bv: jax.Array | None = None
    lora: LoraParams | None = None
    """Low-rank adapters on this stack's projections (fine-tuning only; folded into the weights for export)."""


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TransformerParams:
    embed: jax.Array
    blocks: BlockParams | None
    """The dense-MLP layers (all layers of a dense model); None when every layer is MoE."""
    final_norm: jax.Array
    lm_head: jax.Array | None  # None when embeddings are tied
    moe_blocks: BlockParams | None = None
    """The MoE layers, which follow the dense ones; None for a dense model."""

    def stacks(self) -> list[tuple[BlockParams, bool]]:
        """(stacked blocks, is_moe) in layer order."""
        return [(b, moe) for b, moe in ((self.blocks, False), (self.moe_blocks, True)) if b is not None]


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

    def bias(*shape_axes):
        shape, axes = zip(*shape_axes)
        return ArraySpec(tuple(shape), tuple(axes), "zeros", role="bias")

    def mat(shape, axes, s, fan_in):
        return ArraySpec(shape, axes, "normal", std=s, role="weight", fan_in_axes=fan_in)

    def block_specs(n: int, moe: bool) -> BlockParams | None:
        if n == 0:
            return None
        return BlockParams(
            attn_norm=norm((n, "layers"), (E, "embed")),
            wq=mat((n, E, H, D), ("layers", "embed", "heads", "head_dim"), std, (1,)),
            wk=mat((n, E, K, D), ("layers", "embed", "kv_heads", "head_dim"), std, (1,)),
            wv=mat((n, E, K, D), ("layers", "embed", "kv_heads", "head_dim"), std, (1,)),
            wo=mat((n, H, D, E), ("layers", "heads", "head_dim", "embed"), out_std, (1, 2)),
            q_norm=norm((n, "layers"), (D, "head_dim")) if cfg.qk_norm else None,
            k_norm=norm((n, "layers"), (D, "head_dim")) if cfg.qk_norm else None,
            mlp_norm=norm((n, "layers"), (E, "embed")),
            w_gate=None if moe else mat((n, E, M), ("layers", "embed", "mlp"), std, (1,)),
            w_up=None if moe else mat((n, E, M), ("layers", "embed", "mlp"), std, (1,)),
            w_down=None if moe else mat((n, M, E), ("layers", "mlp", "embed"), out_std, (1,)),
            moe=moe_specs(cfg.moe, n, E, std, out_std) if moe else None,
            bq=bias((n, "layers"), (H, "heads"), (D, "head_dim")) if cfg.qkv_bias else None,
            bk=bias((n, "layers"), (K, "kv_heads"), (D, "head_dim")) if cfg.qkv_bias else None,
            bv=bias((n, "layers"), (K, "kv_heads"), (D, "head_dim")) if cfg.qkv_bias else None,
        )

    return TransformerParams(
        embed=ArraySpec((V, E), ("vocab", "embed"), "normal", std=std, role="embedding"),
        blocks=block_specs(cfg.num_dense_layers, False),
        moe_blocks=block_specs(cfg.num_moe_layers, True),
        final_norm=norm((E, "embed")),
        lm_head=None
        if cfg.tie_embeddings
        else ArraySpec((E, V), ("embed", "vocab"), "normal", std=std, role="head", fan_in_axes=(0,)),
    )


def num_params(cfg: ModelConfig) -> int:
    """Exact parameter count (from the spec tree; nothing is allocated).

    Includes MoE routers' selection biases (one number per expert per layer),
    which are state rather than trained weights but live with the params.
    """
    return count_params(param_specs(cfg))


def num_active_params(cfg: ModelConfig) -> int:
    """Parameters one token uses: all but the routed experts it is not sent to."""
    if cfg.moe is None:
        return num_params(cfg)
    idle = cfg.moe.num_experts - cfg.moe.experts_per_token
    return num_params(cfg) - cfg.num_moe_layers * idle * expert_params_per_layer(cfg.moe, cfg.hidden_size)


_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def attention_sublayer(
    cfg: ModelConfig,
    x: jax.Array,
    p: BlockParams,
    cos,
    sin,
    segment_ids,
    window=None,
    key=None,
    layout: Layout | None = None,
) -> jax.Array:
    """x plus the attention branch of one block (`key`: LoRA dropout); see `model.attention`.

    On a layout with a context axis the sequence is split over it and attention runs as a ring
    (`model.ring_attention`); the causal and window masks follow the positions' original slots
    (`layout.order`)."""
    h = layers.rms_norm(x, p.attn_norm, cfg.norm_eps)
    # The q|k|v weights are fused here, per layer, so the stored layout and its shardings stay per projection.
    w = attention.attention_weights(p, cfg.num_kv_heads)
    if layout is not None and layout.context > 1:
        return x + ring_attention.self_attention(cfg, h, w, cos, sin, segment_ids, window, key, layout)
    return x + attention.causal_self_attention(cfg, h, w, cos, sin, segment_ids, window, key, layout)


def mlp_block(cfg: ModelConfig, x: jax.Array, p: BlockParams, layout: Layout | None = None, key=None):
    """x plus the MLP branch of one block: (x, MoEStats or None); MoE experts are parallel over the
    layout's mesh."""
    h = layers.rms_norm(x, p.mlp_norm, cfg.norm_eps)
    if p.moe is None:
        adapter = None
        if p.lora is not None:

            def adapter(target, inputs):
                return delta(p.lora, target, inputs, key)

        return x + layers.swiglu(h, p.w_gate, p.w_up, p.w_down, adapter), None
    mesh, rules = (None, None) if layout is None else (layout.mesh, layout.rules)
    y, stats = moe_mlp(h, p.moe, cfg.moe, mesh, rules)
    return x + y, stats


def _layer_body(cfg: ModelConfig, cos, sin, segment_ids, *, layout, constrain):
    """The scan body of one block, `(x, (params, window, dropout key)) -> (x, MoEStats | None)`, under the remat policy."""

    def body(x, layer):
        p, window, key = layer
        x = attention_sublayer(cfg, x, p, cos, sin, segment_ids, window, key, layout)
        x, stats = mlp_block(cfg, x, p, layout, key)
        return constrain(x), stats

    if cfg.remat != "none":
        body = jax.checkpoint(body, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=False)
    return body


def _scan_stacks(params: TransformerParams, x, cfg: ModelConfig, body, dropout_key, frozen_layers: int):
    """x through every stack, each one `lax.scan` of `body` (the frozen layers as a scan of their own)."""
    stats, first = [], 0
    for (blocks, _), windows in zip(params.stacks(), attention.layer_windows(cfg)):
        n = jax.tree.leaves(blocks)[0].shape[0]
        keys = None if dropout_key is None else jax.random.split(jax.random.fold_in(dropout_key, first), n)
        cut = min(max(frozen_layers - first, 0), n)
        for lo, hi in ((0, cut), (cut, n)) if 0 < cut < n else ((0, n),):
            part = (
                jax.tree.map(lambda a, lo=lo, hi=hi: a[lo:hi], (blocks, windows, keys))
                if hi - lo < n
                else (blocks, windows, keys)
            )
            x, stats_n = jax.lax.scan(body, x, part, unroll=layers.layer_unroll(cfg.scan_unroll, hi - lo))
            if first + hi <= frozen_layers:
                x = jax.lax.stop_gradient(x)
            if stats_n is not None:
                stats.append(stats_n)
        first += n
    if not stats:
        return x, None
    # one entry per scanned part of the MoE stack, each [layers, ...]
    return x, stats[0] if len(stats) == 1 else jax.tree.map(lambda *s: jnp.concatenate(s), *stats)


def _pipeline_stacks(params: TransformerParams, x, cfg: ModelConfig, layout: Layout, layer, side):
    """x through the stacks as the layout's pipeline schedule (parallel/pipeline.py): (x, mean MoEStats | None).

    `layer(cos, sin, segment_ids)` makes the scan body for one microbatch's side inputs `side`
    (cos, sin, segment_ids): each goes with its microbatch when it is per row, else to every
    stage whole. The last stack (every layer of a dense model, the MoE layers of a MoE model) is
    cut into the schedule's chunks. A MoE model's leading dense layers run inside stage 0 in
    front of its first chunk (a `cond`: the other stages skip them, and stage 0 is that much
    slower per microbatch); they travel to every stage whole, being few and small next to experts.
    """
    stacks, windows = params.stacks(), attention.layer_windows(cfg)
    main = (stacks[-1][0], windows[len(stacks) - 1])
    schedule = layout.schedule
    M, rows = schedule.microbatches, x.shape[0]
    side = dict(zip(("cos", "sin", "segment_ids"), side))
    extras = {
        k: pipeline.split_microbatches(v, M) for k, v in side.items() if v is not None and v.shape[0] == rows
    }
    shared = {**side, "prefix": (stacks[0][0], windows[0]) if len(stacks) == 2 else None}
    shared = {k: v for k, v in shared.items() if k not in extras}
    unroll = layers.layer_unroll(cfg.scan_unroll, jax.tree.leaves(main)[0].shape[0] // schedule.chunks)
    constrain = pipeline.stage_constraint(layout.activations_of(rows))

    def stage(chunk, shared, h, mine, index):
        inputs = {**shared, **mine}
        body = layer(inputs["cos"], inputs["sin"], inputs.get("segment_ids"), constrain=constrain)
        if shared["prefix"] is not None:
            dense, dense_windows = shared["prefix"]

            def run_prefix(h):
                return jax.lax.scan(body, h, (dense, dense_windows, None))[0]

            if layers.cpu_backend():
                # XLA CPU's collectives rendezvous every device of the program, so a collective (the
                # ring's ppermutes, tensor all-reduces) inside a branch only stage 0 takes deadlocks:
                # there every stage computes the prefix and stage 0 keeps it.
                h = jnp.where(index == 0, run_prefix(h), h)
            else:
                h = jax.lax.cond(index == 0, run_prefix, lambda h: h, h)
        blocks, chunk_windows = chunk
        return jax.lax.scan(body, h, (blocks, chunk_windows, None), unroll=unroll)

    micro = pipeline.split_microbatches(x, M)
    y, stats = pipeline.run(stage, main, shared, micro, extras, layout.mesh, schedule)
    return pipeline.merge_microbatches(y), None if stats is None else jax.tree.map(lambda s: s / M, stats)


def forward(
    params: TransformerParams,
    tokens: jax.Array,
    cfg: ModelConfig,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    layout: Layout | None = None,
    dropout_key: jax.Array | None = None,
    frozen_layers: int = 0,
) -> tuple[jax.Array, MoEStats | None]:
    """Final-norm hidden states [batch, seq, embed] for token ids [batch, seq], and MoE routing stats.

    Runs in the dtype of `params` (cast them first for mixed precision).
    `positions` ([batch or 1, seq]) are the RoPE positions (packed
    conversations restart at 0). `layout` (parallel/layout.py; None: no
    mesh) pins the residual stream's layout at every block boundary, makes
    MoE layers expert-parallel and attention a ring over its context axis,
    and with a pipeline schedule runs the stacks as that microbatched
    schedule over the mesh's pipeline stages instead of one scan (see
    `_pipeline_stacks`; the stats are then the mean over its microbatches).
    Rows come in `layout.order` (the context order; masks follow the
    original slots). `dropout_key` turns on LoRA dropout. `frozen_layers` > 0
    runs the first that many layers as their own scan with the residual
    stream's gradient stopped after them: when only later layers train, the
    backward pass never enters the frozen ones. The stats (None for a dense
    model) have a leading axis over MoE layers.
    """

    def constrain(x):
        return x if layout is None else layout.constrain(x)

    if positions is None:
        positions = jnp.arange(tokens.shape[1])[None, :]
    cos, sin = attention.rope_tables(cfg, positions)
    x = constrain(quant.embed_lookup(params.embed, tokens))

    layer = partial(_layer_body, cfg, layout=layout, constrain=constrain)
    if layout is None or layout.schedule is None:
        x, stats = _scan_stacks(params, x, cfg, layer(cos, sin, segment_ids), dropout_key, frozen_layers)
    else:
        if dropout_key is not None or frozen_layers:
            raise ValueError("the pipeline schedule runs without LoRA dropout and frozen layers")
        x, stats = _pipeline_stacks(params, x, cfg, layout, layer, (cos, sin, segment_ids))
    return layers.rms_norm(x, params.final_norm, cfg.norm_eps), stats


def hidden_states(params: TransformerParams, tokens: jax.Array, cfg: ModelConfig, **kw) -> jax.Array:
    """Final-norm hidden states [batch, seq, embed] (see `forward`)."""
    return forward(params, tokens, cfg, **kw)[0]


def output_weights(params: TransformerParams):
    """The [embed, vocab] output projection (the embedding, transposed, when tied): an array or, in
    params from `quantize.quantize_params`, an int8 `quant.QuantizedMatrix` (`layers.dense` and `@` take both)."""
    return params.embed.T if params.lm_head is None else params.lm_head


def logits_and_stats(
    params: TransformerParams, tokens: jax.Array, cfg: ModelConfig, **kw
) -> tuple[jax.Array, MoEStats | None]:
    """Next-token logits [batch, seq, vocab] in fp32, and the MoE routing stats (see `forward`)."""
    h, stats = forward(params, tokens, cfg, **kw)
    return layers.dense(h, output_weights(params)).astype(jnp.float32), stats


def logits(params: TransformerParams, tokens: jax.Array, cfg: ModelConfig, **kw) -> jax.Array:
    """Next-token logits [batch, seq, vocab] in fp32."""
    return logits_and_stats(params, tokens, cfg, **kw)[0]
