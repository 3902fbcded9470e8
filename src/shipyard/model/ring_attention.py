"""Ring attention: causal self-attention with the sequence split over the `context` mesh axis.

Each device keeps its chunk of queries; the key/value chunks (with their
slots and segment ids) travel once around the ring by `jax.lax.ppermute`,
and every visit adds that chunk's contribution to an online softmax (running
row max and sum, fp32). The full [L, L] scores never exist: each chunk
(T = L / context positions per device) is cut into tiles of at most
`model.attention_block` positions (each zig-zag half alike), and a device
holds the scores of one (query tile, key tile) block at a time.

The mask is computed from each position's original slot (`slots`, the
context order of `parallel.context`), not its place in the permuted row:
causal by slot, the sliding window by slot distance, documents by segment
id. A block the mask hides entirely is skipped (`lax.cond`): under the
zig-zag order that is at least half of every visiting chunk, the same on
every device.

The backward pass is a custom VJP that runs the ring again (flash-attention
style): it keeps only the output and the per-row logsumexp from the forward
pass, recomputes each block's probabilities, and sends the key/value
gradients around the ring with their chunk, one more hop bringing them home.

Shapes follow `model.attention`: q [batch, T, kv_heads, group, head_dim],
k and v [batch, T, kv_heads, head_dim] (per device).
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from shipyard.model import attention, layers
from shipyard.parallel.context import AXIS
from shipyard.parallel.layout import Layout

_NEG = float(jnp.finfo(jnp.float32).min)


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slots: jax.Array,
    segment_ids: jax.Array | None,
    window,
    mesh: Mesh,
    block: int | None = None,
) -> jax.Array:
    """Softmax attention [batch, L, kv_heads, group, D] of global q [batch, L, kv_heads, group, D] over
    k, v [batch, L, kv_heads, D], with L split over the mesh's context axis.

    `slots` [L] are the original positions (the causal and window mask use them), `segment_ids`
    [batch, L] (or None) keep attention inside documents, `window` (None, an int or a traced int
    under scan; `attention.GLOBAL_WINDOW` means global) keeps the last `window` slots. The other
    mesh axes stay automatic (the compiler keeps batch and heads split as they come). `block`
    bounds the tiles a device's chunk is cut into (None: halves), so no device holds more than
    [block, block] scores per head.
    """
    n = int(mesh.shape[AXIS])
    if q.shape[1] % (n * 2):
        raise ValueError(f"ring attention: sequence length {q.shape[1]} does not split into {n} x 2 halves")
    tiles = _tiles(q.shape[1] // n, block)
    seg = jnp.zeros(q.shape[:2], jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    win = jnp.asarray(2**30 if window is None else window, jnp.int32)
    # Tied to q by a barrier so the masks are not loop-invariant in the layer scan: differentiating
    # that scan, JAX hoists what depends only on its constants (slots, segment ids, windows) out of
    # the loop, and through the ring's tile scans that stacked every block's mask, [L, L] in all.
    q, slots, seg, win = jax.lax.optimization_barrier((q, slots.astype(jnp.int32), seg, win))
    return _ring_attend(q, k, v, slots, seg, win, _Ring(mesh, n, tiles))


class _Ring(NamedTuple):
    """What the ring's shard_maps need to know (hashable: a custom_vjp's static argument)."""

    mesh: Mesh
    n: int
    tiles: int


_SEQ = PartitionSpec(None, AXIS)
_LSE = PartitionSpec(None, None, None, AXIS)
_INPUTS = (_SEQ, _SEQ, _SEQ, PartitionSpec(AXIS), _SEQ, PartitionSpec())


def _sharded(ring: _Ring, fn, in_specs, out_specs):
    """`fn` (a per-device body) as a shard_map manual over `context` alone. Inside another shard_map
    (a pipeline stage, manual over `pipeline`) a nested one must take the abstract mesh of that context."""
    here = jax.sharding.get_abstract_mesh()
    return jax.shard_map(
        partial(fn, n=ring.n, tiles=ring.tiles),
        mesh=ring.mesh if here.empty or not here.manual_axes else here,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names={AXIS},
    )


def _tiles(chunk: int, block: int | None) -> int:
    """How many tiles a device's `chunk` positions are cut into: each zig-zag half alike (so the
    blocks the causal mask hides are whole tiles), in pieces of the largest size <= `block` that
    divides the half (None: the halves themselves)."""
    half = chunk // 2
    size = half if block is None else max(d for d in range(1, min(block, half) + 1) if half % d == 0)
    return chunk // size


def _shift(x, n: int):
    """Send each device's x to the next device on the ring."""
    return jax.lax.ppermute(x, AXIS, [(i, (i + 1) % n) for i in range(n)])


def _varying(tree):
    """Zeros made per-device values (shard_map's type of what differs along the ring), as the
    accumulators they start are."""
    return jax.tree.map(lambda x: jax.lax.pcast(x, (AXIS,), to="varying"), tree)


def _tiled(x, tiles: int, axis: int) -> jax.Array:
    """x with its `axis` (T positions) cut into `tiles` tiles, stacked first: [tiles, ..., T / tiles, ...]."""
    axis %= x.ndim
    return jnp.moveaxis(x.reshape(*x.shape[:axis], tiles, -1, *x.shape[axis + 1 :]), axis, 0)


def _untiled(x, axis: int) -> jax.Array:
    """The inverse of `_tiled`: the stacked tiles joined back along `axis` of the result."""
    axis %= x.ndim - 1
    y = jnp.moveaxis(x, 0, axis)
    return y.reshape(*y.shape[:axis], -1, *y.shape[axis + 2 :])


def _kv_tiles(kv, tiles: int) -> tuple:
    """Key-side tiles of a visiting chunk (k, v, slots, segment ids, ...)."""
    return tuple(_tiled(x, tiles, 0 if x.ndim == 1 else 1) for x in kv[:4])


def _seen(q_slots, k_slots, q_seg, k_seg, window) -> jax.Array:
    """bool [batch, tq, tk]: causal by slot, inside the window, same segment."""
    dist = q_slots[:, None] - k_slots[None, :]
    return ((dist >= 0) & (dist < window))[None] & (q_seg[:, :, None] == k_seg[:, None, :])


def _scores(q, k, seen):
    """Masked fp32 scores [batch, kv_heads, group, tq, tk]."""
    s = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    return jnp.where(seen[:, None, None], s * (1.0 / math.sqrt(q.shape[-1])), _NEG)


def _forward_block(carry, q, k, v, seen):
    """Add one key block to a query block's online softmax: carry = (acc [b,t,k,g,d], max, sum [b,k,g,t])."""
    acc, m, l = carry
    s = _scores(q, k, seen)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    p = jnp.where(seen[:, None, None], jnp.exp(s - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    pv = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    acc = acc * jnp.moveaxis(corr, -1, 1)[..., None] + pv
    return acc, m_new, l * corr + jnp.sum(p, axis=-1)


def _forward_step(states, q_tiles, kv_tiles, window):
    """One visiting chunk added to every query tile's online softmax. The tiles are scanned, so one
    (query tile, key tile) block's scores are all that exist at a time; blocks the mask hides are skipped."""

    def per_query(_, xs):
        state, (q, q_slots, q_seg) = xs

        def per_key(state, kv):
            k, v, k_slots, k_seg = kv
            seen = _seen(q_slots, k_slots, q_seg, k_seg, window)
            state = jax.lax.cond(
                jnp.any(seen), lambda st: _forward_block(st, q, k, v, seen), lambda st: st, state
            )
            return state, None

        return None, jax.lax.scan(per_key, state, kv_tiles)[0]

    return jax.lax.scan(per_query, None, (states, q_tiles))[1]


# The custom VJP sits outside the shard_maps, so autodiff never enters them: the forward and the
# backward are one shard_map each.
@partial(jax.custom_vjp, nondiff_argnums=(6,))
def _ring_attend(q, k, v, slots, seg, window, ring: _Ring):
    return _ring_fwd(q, k, v, slots, seg, window, ring)[0]


def _ring_forward(q, k, v, slots, seg, window, *, n: int, tiles: int):
    """(output in q's dtype, logsumexp [batch, kv_heads, group, T] fp32) of this device's queries."""
    B, T, K, G, D = q.shape
    h = T // tiles
    states = _varying(
        (
            jnp.zeros((tiles, B, h, K, G, D), jnp.float32),
            jnp.full((tiles, B, K, G, h), _NEG),
            jnp.zeros((tiles, B, K, G, h)),
        )
    )
    q_tiles = (_tiled(q, tiles, 1), _tiled(slots, tiles, 0), _tiled(seg, tiles, 1))
    kv = (k, v, slots, seg)
    for step in range(n):
        states = _forward_step(states, q_tiles, _kv_tiles(kv, tiles), window)
        if step < n - 1:
            kv = _shift(kv, n)
    acc, m, l = _untiled(states[0], 1), _untiled(states[1], -1), _untiled(states[2], -1)
    out = acc / jnp.moveaxis(l, -1, 1)[..., None]
    return out.astype(q.dtype), m + jnp.log(l)


def _ring_fwd(q, k, v, slots, seg, window, ring: _Ring):
    out, lse = _sharded(ring, _ring_forward, _INPUTS, (_SEQ, _LSE))(q, k, v, slots, seg, window)
    return out, (q, k, v, slots, seg, window, out, lse)


def _backward_block(dq, dkv, qa, ka, seen):
    """One block's share of dq (query side) and dk, dv (key side), from recomputed probabilities."""
    (q, do, lse, delta), (k, v), (dk, dv) = qa, ka, dkv
    p = jnp.where(seen[:, None, None], jnp.exp(_scores(q, k, seen) - lse[..., None]), 0.0)
    dv = dv + jnp.einsum("bkgts,btkgd->bskd", p, do.astype(jnp.float32))
    dp = jnp.einsum("btkgd,bskd->bkgts", do, v, preferred_element_type=jnp.float32)
    ds = p * (dp - delta[..., None]) * (1.0 / math.sqrt(q.shape[-1]))
    dq = dq + jnp.einsum("bkgts,bskd->btkgd", ds, k.astype(jnp.float32))
    dk = dk + jnp.einsum("bkgts,btkgd->bskd", ds, q.astype(jnp.float32))
    return dq, (dk, dv)


def _backward_step(dq, dkv, q_tiles, kv_tiles, window):
    """One visiting chunk's share of every query tile's dq and of the chunk's (dk, dv) tiles."""

    def per_query(dkv, xs):
        dq_i, (q, do, lse, delta, q_slots, q_seg) = xs

        def per_key(dq_i, xs):
            (k, v, k_slots, k_seg), dkv_j = xs
            seen = _seen(q_slots, k_slots, q_seg, k_seg, window)

            def run(states):
                return _backward_block(*states, (q, do, lse, delta), (k, v), seen)

            return jax.lax.cond(jnp.any(seen), run, lambda states: states, (dq_i, dkv_j))

        dq_i, dkv = jax.lax.scan(per_key, dq_i, (kv_tiles, dkv))
        return dkv, dq_i

    dkv, dq = jax.lax.scan(per_query, dkv, (dq, q_tiles))
    return dq, dkv


def _ring_bwd(ring: _Ring, res, do):
    specs = (*_INPUTS, _SEQ, _LSE, _SEQ)
    dq, dk, dv = _sharded(ring, _ring_backward, specs, (_SEQ, _SEQ, _SEQ))(*res, do)
    return dq, dk, dv, None, None, None


def _ring_backward(q, k, v, slots, seg, window, out, lse, do, *, n: int, tiles: int):
    """(dq, dk, dv) of this device's chunk: the ring run again over recomputed probabilities."""
    # delta = rowsum(dO * O), [b, k, g, t] like lse: the softmax backward's correction term.
    delta = jnp.moveaxis(jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1), 1, -1)
    q_tiles = tuple(
        _tiled(x, tiles, ax) for x, ax in zip((q, do, lse, delta, slots, seg), (1, 1, -1, -1, 0, 1))
    )
    dq = _varying(jnp.zeros((tiles, *q_tiles[0].shape[1:]), jnp.float32))
    # The key/value gradients travel with their chunk (kv[4:]).
    kv = (k, v, slots, seg, *_varying((jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))))
    for step in range(n):
        dkv = (_tiled(kv[4], tiles, 1), _tiled(kv[5], tiles, 1))
        dq, dkv = _backward_step(dq, dkv, q_tiles, _kv_tiles(kv, tiles), window)
        dk, dv = _untiled(dkv[0], 1), _untiled(dkv[1], 1)
        # The last hop sends only the key/value gradients: it brings them back to their chunk's device.
        kv = _shift((*kv[:4], dk, dv), n) if step < n - 1 else (*kv[:4], *_shift((dk, dv), n))
    return _untiled(dq, 1).astype(q.dtype), kv[4].astype(k.dtype), kv[5].astype(v.dtype)


_ring_attend.defvjp(_ring_fwd, _ring_bwd)


def self_attention(
    cfg, h, w, cos, sin, segment_ids=None, window=None, key=None, layout: Layout = None
) -> jax.Array:
    """The attention branch of one block for normed input h [batch, L, embed] with L split over the
    layout's context axis: `attention.causal_self_attention` (same arguments, same order) with the
    ring as the core. The masks follow the positions' original slots, `layout.order` (None: the
    row is in its own order)."""
    q, k, v = attention.project_qkv(cfg, h, w, key)
    q = layers.apply_rope(q, cos, sin)
    k = layers.apply_rope(k, cos, sin)
    slots = jnp.arange(h.shape[1]) if layout.order is None else jnp.asarray(layout.order)
    out = ring_attention(q, k, v, slots, segment_ids, window, layout.mesh, cfg.attention_block)
    return attention.project_out(w, out, key)
