"""Mixture-of-experts MLP: routing, dropless or capacity-limited expert compute, expert parallelism.

A router scores every token against every expert (softmax or sigmoid), each
token goes to its top-k experts, and their SwiGLU outputs are summed with the
(optionally renormalised) scores. Optional shared experts see every token.

Expert compute works on the token->expert *assignments* sorted by expert:
- dropless, `ragged`: one `jax.lax.ragged_dot` per matmul over the sorted rows
  (a real grouped GEMM on GPU/TPU; on CPU XLA lowers it to every expert times
  every row, hence the alternative);
- dropless, `blocked`: rows are padded into blocks of `b` rows that each belong
  to one expert, and one batched matmul runs block x its expert's weights.
  Compute is the static worst case (all rows + one partial block per expert);
- capacity: each expert takes its first `C` assignments into a [experts, C,
  embed] buffer (later tokens are dropped, as in Switch/GShard).

Expert parallelism (`experts` on the mesh's `expert` axis) runs the layer in
`shard_map`: the tokens of an expert group are all-gathered over the expert
axis, every device computes the assignments that go to its own experts, and a
reduce-scatter returns each token's summed output to the device it came from.
This moves (ep - 1) x tokens per device where an all-to-all moves about k x
tokens, so it is no more traffic for ep <= k (the presets' regime) and stays
exact and dropless with static shapes; a ragged all-to-all for ep >> k is
future work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from shipyard.config import MoEConfig
from shipyard.errors import ConfigError
from shipyard.model.layers import swiglu
from shipyard.model.params import ArraySpec
from shipyard.parallel import backend


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class MoEParams:
    """One stack of MoE MLPs, each array with a leading `layers` axis."""

    router: jax.Array
    """[layers, embed, experts] router projection."""
    router_bias: jax.Array
    """[layers, experts] selection bias for aux-loss-free balancing; moved by a rule, not by gradients."""
    w_gate: jax.Array
    """[layers, experts, embed, expert_mlp]"""
    w_up: jax.Array
    """[layers, experts, embed, expert_mlp]"""
    w_down: jax.Array
    """[layers, experts, expert_mlp, embed]"""
    shared_gate: jax.Array | None
    """[layers, embed, shared_mlp] the shared experts fused into one MLP (None without shared experts)."""
    shared_up: jax.Array | None
    shared_down: jax.Array | None


class MoEStats(NamedTuple):
    """Routing statistics of one MoE layer (stacked over layers by the scan)."""

    load: jax.Array
    """[experts] fraction of all token->expert assignments that went to each expert (sums to 1)."""
    aux_loss: jax.Array
    """Switch load-balancing loss: experts x sum_i load_i x mean score_i (1 when balanced)."""
    z_loss: jax.Array
    """Mean squared logsumexp of the router logits."""
    dropped: jax.Array
    """Fraction of assignments dropped for capacity (0 when dropless)."""


def moe_specs(moe: MoEConfig, num_layers: int, hidden: int, std: float, out_std: float) -> MoEParams:
    L, E, X, F = num_layers, hidden, moe.num_experts, moe.expert_intermediate_size
    S = moe.num_shared_experts * F

    def mat(shape, axes, s, fan_in):
        return ArraySpec(shape, axes, "normal", std=s, role="weight", fan_in_axes=fan_in)

    shared = S > 0
    return MoEParams(
        # The router's experts axis stays replicated: every device routes its own tokens.
        router=ArraySpec(
            (L, E, X), ("layers", "embed", None), "normal", std=std, role="router", fan_in_axes=(1,)
        ),
        router_bias=ArraySpec((L, X), ("layers", None), "zeros", role="buffer"),
        w_gate=mat((L, X, E, F), ("layers", "experts", "embed", "expert_mlp"), std, (2,)),
        w_up=mat((L, X, E, F), ("layers", "experts", "embed", "expert_mlp"), std, (2,)),
        w_down=mat((L, X, F, E), ("layers", "experts", "expert_mlp", "embed"), out_std, (2,)),
        shared_gate=mat((L, E, S), ("layers", "embed", "mlp"), std, (1,)) if shared else None,
        shared_up=mat((L, E, S), ("layers", "embed", "mlp"), std, (1,)) if shared else None,
        shared_down=mat((L, S, E), ("layers", "mlp", "embed"), out_std, (1,)) if shared else None,
    )


def expert_params_per_layer(moe: MoEConfig, hidden: int) -> int:
    """Parameters of one routed expert (gate, up, down)."""
    return 3 * hidden * moe.expert_intermediate_size


# ----------------------------------------------------------------------------- routing


class RouterSums(NamedTuple):
    """Additive routing sums over a set of tokens (so shards can be psum-ed before the ratios)."""

    counts: jax.Array  # [X] assignments per expert
    score_sum: jax.Array  # [X] sum over tokens of each expert's (normalised) score
    lse_sq: jax.Array  # sum over tokens of logsumexp(router logits)^2
    tokens: jax.Array  # number of tokens


def route(x: jax.Array, router: jax.Array, bias: jax.Array, moe: MoEConfig):
    """Top-k routing of x [T, embed]: (weights [T, k] fp32, experts [T, k] int32, RouterSums).

    The bias only changes *which* experts are chosen, never the weights
    (DeepSeek-V3), and receives no gradient.
    """
    logits = jnp.dot(x, router.astype(x.dtype), preferred_element_type=jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if moe.score == "softmax" else jax.nn.sigmoid(logits)
    _, experts = jax.lax.top_k(
        scores + jax.lax.stop_gradient(bias.astype(jnp.float32)), moe.experts_per_token
    )
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if moe.normalize_weights:
        weights = weights / (
            jnp.sum(weights, axis=-1, keepdims=True) + (1e-20 if moe.score == "sigmoid" else 0.0)
        )
    weights = weights * moe.routed_scale
    X = router.shape[-1]
    counts = jnp.zeros((X,), jnp.float32).at[experts.reshape(-1)].add(1.0)
    # The balance loss wants a distribution per token: softmax already is one;
    # sigmoid scores are normalised per token first (DeepSeek-V3's sequence-wise loss).
    probs = scores if moe.score == "softmax" else scores / jnp.sum(scores, axis=-1, keepdims=True)
    sums = RouterSums(
        counts=counts,
        score_sum=jnp.sum(probs, axis=0),
        lse_sq=jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1))),
        tokens=jnp.asarray(x.shape[0], jnp.float32),
    )
    return weights, experts.astype(jnp.int32), sums


def capacity(moe: MoEConfig, tokens: int) -> int:
    """Per-expert capacity for a routing group of `tokens` tokens (capacity mode)."""
    return max(1, math.ceil(moe.capacity_factor * tokens * moe.experts_per_token / moe.num_experts))


def stats_from_sums(sums: RouterSums, dropped: jax.Array, moe: MoEConfig) -> MoEStats:
    """MoEStats from RouterSums over all tokens and the number of dropped assignments."""
    assignments = sums.tokens * moe.experts_per_token
    load = sums.counts / assignments
    mean_score = sums.score_sum / sums.tokens
    # Only the scores carry gradient: the counts come from a discrete top-k.
    aux = sums.counts.shape[0] * jnp.sum(jax.lax.stop_gradient(load) * mean_score)
    return MoEStats(load=load, aux_loss=aux, z_loss=sums.lse_sq / sums.tokens, dropped=dropped / assignments)


# ----------------------------------------------------------------------------- expert compute


def _swiglu_batched(buf: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """buf [n, rows, embed] through n experts' SwiGLU (weights [n, embed, F], [n, F, embed])."""
    gate = jnp.einsum("nre,nef->nrf", buf, w_gate)
    up = jnp.einsum("nre,nef->nrf", buf, w_up)
    return jnp.einsum("nrf,nfe->nre", jax.nn.silu(gate) * up, w_down)


def _ragged(xs, group_sizes, w_gate, w_up, w_down):
    """Rows beyond sum(group_sizes) come out zero (ragged_dot leaves them unassigned)."""
    gate = jax.lax.ragged_dot(xs, w_gate, group_sizes)
    up = jax.lax.ragged_dot(xs, w_up, group_sizes)
    return jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down, group_sizes)


def grouped_matmul_impl(moe: MoEConfig, platform: str) -> str:
    """The dropless expert compute that runs on `platform` ("tpu", "gpu", "cpu"): "ragged" or "blocked"."""
    if moe.grouped_matmul != "auto":
        return moe.grouped_matmul
    # ragged_dot is a Mosaic grouped-matmul kernel on TPU; XLA:CPU and XLA:GPU lower it as every
    # local expert on every row (measured on the compiled 535B step for H200s: 22x the FLOPs
    # and 2.3x the temporaries of blocked; docs/targets.md)
    return "ragged" if platform == "tpu" else "blocked"


def block_layout(rows: int, experts: int) -> tuple[int, int]:
    """(blocks, rows per block) of the blocked expert compute for `rows` assignments over `experts`.

    Padding costs up to one block per expert; blocks of about a quarter of the mean group keep that
    under ~25% while staying large enough to be efficient matmuls. Each block gathers its expert's
    three weight matrices, so the gathered weights are `blocks` experts' worth (the planner counts
    them: plan._activation_bytes).
    """
    target = max(1, rows // (4 * experts))
    b = int(min(256, max(8, 2 ** math.floor(math.log2(target)))))
    return -(-(rows + experts * (b - 1)) // b), b


def _blocked(xs, group_sizes, w_gate, w_up, w_down):
    """Dropless grouped SwiGLU with per-expert padded blocks and one batched matmul."""
    M, X = xs.shape[0], group_sizes.shape[0]
    blocks, b = block_layout(M, X)
    padded = (group_sizes + b - 1) // b * b
    pad_start = jnp.cumsum(padded) - padded
    grp_start = jnp.cumsum(group_sizes) - group_sizes
    row = jnp.arange(M)
    expert = jnp.clip(jnp.searchsorted(jnp.cumsum(group_sizes), row, side="right"), 0, X - 1)
    valid = row < jnp.sum(group_sizes)
    dest = jnp.where(valid, pad_start[expert] + row - grp_start[expert], blocks * b)
    buf = jnp.zeros((blocks * b, xs.shape[1]), xs.dtype).at[dest].set(xs, mode="drop")
    block_expert = jnp.clip(
        jnp.searchsorted(jnp.cumsum(padded), jnp.arange(blocks) * b, side="right"), 0, X - 1
    )
    out = _swiglu_batched(
        buf.reshape(blocks, b, -1), w_gate[block_expert], w_up[block_expert], w_down[block_expert]
    ).reshape(blocks * b, -1)
    return jnp.where(valid[:, None], out[jnp.minimum(dest, blocks * b - 1)], 0)


def experts_forward(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    moe: MoEConfig,
    first_expert=0,
) -> jax.Array:
    """Sum over each token's chosen experts of weight x expert(token), for x [T, embed].

    Only experts first_expert .. first_expert + w_gate.shape[0] - 1 are held
    here (expert parallelism); assignments to other experts contribute 0.
    """
    T, k = experts.shape
    X_local = w_gate.shape[0]
    local = experts - first_expert
    is_local = (local >= 0) & (local < X_local)
    # Sort assignments by local expert; other devices' assignments go last.
    key = jnp.where(is_local, local, X_local).reshape(-1)
    order = jnp.argsort(key, stable=True)
    token = order // k
    sorted_key = key[order]
    group_sizes = jnp.zeros((X_local + 1,), jnp.int32).at[key].add(1)[:X_local]
    xs = x[token]
    if moe.capacity_factor is not None:
        C = capacity(moe, T)
        rank = (
            jnp.arange(T * k) - (jnp.cumsum(group_sizes) - group_sizes)[jnp.minimum(sorted_key, X_local - 1)]
        )
        kept = (sorted_key < X_local) & (rank < C)
        slot = jnp.where(kept, sorted_key * C + rank, X_local * C)
        buf = jnp.zeros((X_local * C, x.shape[1]), x.dtype).at[slot].set(xs, mode="drop")
        out = _swiglu_batched(buf.reshape(X_local, C, -1), w_gate, w_up, w_down).reshape(X_local * C, -1)
        out = jnp.where(kept[:, None], out[jnp.minimum(slot, X_local * C - 1)], 0)
    else:
        impl = grouped_matmul_impl(moe, backend.platform())
        out = (_ragged if impl == "ragged" else _blocked)(xs, group_sizes, w_gate, w_up, w_down)
    w = weights.reshape(-1)[order].astype(out.dtype)
    return jnp.zeros_like(x).at[token].add(out * w[:, None])


def _dropped(counts: jax.Array, moe: MoEConfig, group_tokens: int) -> jax.Array:
    if moe.capacity_factor is None:
        return jnp.zeros((), jnp.float32)
    return jnp.sum(jnp.maximum(counts - capacity(moe, group_tokens), 0.0))


# ----------------------------------------------------------------------------- the layer


def moe_mlp(
    h: jax.Array, p: MoEParams, moe: MoEConfig, mesh: Mesh | None = None, rules=None
) -> tuple[jax.Array, MoEStats]:
    """The MoE MLP of one layer for h [batch, seq, embed] (p holds one layer's slice).

    With a `mesh` (and its logical-axis `rules`) of more than one device the
    routed experts run under shard_map, expert-parallel over the mesh axes the
    `experts` axis maps to; the result equals the single-device computation.
    """
    B, S, E = h.shape
    if mesh is None or mesh.size == 1:
        x = h.reshape(B * S, E)
        weights, experts, sums = route(x, p.router, p.router_bias, moe)
        y = experts_forward(x, weights, experts, p.w_gate, p.w_up, p.w_down, moe).reshape(B, S, E)
        stats = stats_from_sums(sums, _dropped(sums.counts, moe, B * S), moe)
    else:
        y, stats = _sharded(h, p, moe, mesh, rules)
    if p.shared_gate is not None:
        y = y + swiglu(h, p.shared_gate, p.shared_up, p.shared_down)
    return y, stats


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _sharded(h, p: MoEParams, moe: MoEConfig, mesh: Mesh, rules):
    from shipyard.parallel.mesh import logical_to_pspec
    from shipyard.parallel.pipeline import nested_mesh

    B, S, E = h.shape
    X = moe.num_experts
    act_spec = logical_to_pspec(("batch", "seq", None), h.shape, mesh, rules)
    w_spec = logical_to_pspec(("experts", None, "expert_mlp"), p.w_gate.shape, mesh, rules)
    down_spec = PartitionSpec(w_spec[0], w_spec[2], None)
    batch_axes, seq_axes = _axes(act_spec[0]), _axes(act_spec[1])
    expert_axes, tensor_axes = _axes(w_spec[0]), _axes(w_spec[2])
    # Tokens are gathered over the expert axes when they are split over them;
    # when they are not (a batch the axes do not divide) every expert shard
    # already sees the same tokens and the outputs are summed instead.
    gather = bool(expert_axes) and set(expert_axes) <= set(batch_axes)
    token_axes = batch_axes + seq_axes
    other_axes = tuple(a for a in token_axes if not (gather and a in expert_axes))
    ep = math.prod(mesh.shape[a] for a in expert_axes)
    if set(tensor_axes) & set(token_axes):
        raise ConfigError(
            f"mesh.rules: expert_mlp is split over {tensor_axes}, which also split the batch/seq; "
            "map expert_mlp and batch to different mesh axes"
        )

    def body(h, router, bias, w_gate, w_up, w_down):
        b, s, _ = h.shape
        x = h.reshape(b * s, E)
        if gather:
            x = jax.lax.all_gather(x, expert_axes, axis=0, tiled=True)
        weights, experts, sums = route(x, router, bias, moe)
        first = jax.lax.axis_index(expert_axes) * (X // ep) if expert_axes else 0
        xe, we = x, weights
        replicated = tuple(a for a in expert_axes if a not in token_axes)
        if replicated and not gather:
            # Without the gather, x and the weights are the same on every
            # expert shard, and each shard indexes its own subset of them
            # (indices from its axis_index). Left invariant, their gradients
            # came out wrong (mlp_norm and router vs one device, rows not
            # divisible by the expert axes); cast to varying, the transpose
            # sums every shard's part.
            xe, we = jax.lax.pcast((x, weights), replicated, to="varying")
        y = experts_forward(xe, we, experts, w_gate, w_up, w_down, moe, first_expert=first)
        if tensor_axes:
            y = jax.lax.psum(y, tensor_axes)
        if gather:
            y = jax.lax.psum_scatter(y, expert_axes, scatter_dimension=0, tiled=True)
        elif expert_axes:
            y = jax.lax.psum(y, expert_axes)
        dropped = _dropped(sums.counts, moe, x.shape[0])
        if other_axes:
            sums = jax.tree.map(lambda v: jax.lax.psum(v, other_axes), sums)
            dropped = jax.lax.psum(dropped, other_axes)
        if expert_axes:
            # Every expert shard routed the same gathered tokens, so these are
            # equal across it; the mean makes that visible to shard_map (and
            # splits their gradient evenly between the shards).
            sums = jax.tree.map(lambda v: jax.lax.pmean(v, expert_axes), sums)
            dropped = jax.lax.pmean(dropped, expert_axes)
        return y.reshape(b, s, E), stats_from_sums(sums, dropped, moe)

    stats_spec = MoEStats(PartitionSpec(), PartitionSpec(), PartitionSpec(), PartitionSpec())
    # Inside a pipeline stage the `pipeline` axis is manual already: nest over the other axes.
    inner_mesh, axis_names = nested_mesh(mesh)
    specs = (act_spec, PartitionSpec(), PartitionSpec(), w_spec, w_spec, down_spec)
    fn = jax.shard_map(
        body, mesh=inner_mesh, in_specs=specs, out_specs=(act_spec, stats_spec), axis_names=axis_names
    )
    return fn(h, p.router, p.router_bias, p.w_gate, p.w_up, p.w_down)
