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

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from shipyard.model import attention, layers
from shipyard.parallel.context import AXIS

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
    seq = PartitionSpec(None, AXIS)
    # Inside another shard_map (a pipeline stage, manual over `pipeline`) a nested one must take the
    # abstract mesh of that context; the ring is manual over `context` alone either way.
    here = jax.sharding.get_abstract_mesh()
    fn = jax.shard_map(
        partial(_ring, n=n, tiles=tiles),
        mesh=mesh if here.empty or not here.manual_axes else here,
        in_specs=(seq, seq, seq, PartitionSpec(AXIS), seq, PartitionSpec()),
        out_specs=seq,
        axis_names={AXIS},
    )
    return fn(q, k, v, slots.astype(jnp.int32), seg, win)


def _ring(q, k, v, slots, seg, window, *, n: int, tiles: int):
    return _ring_attend(q, k, v, slots, seg, window, n, tiles)


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


def _split(x, tiles: int, axis: int = 1) -> list:
    return jnp.split(x, tiles, axis=axis)


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


def _parts(arrays, axes, slots, seg, tiles: int) -> list:
    """A chunk in tiles: per tile (the arrays' tiles, split along `axes`, its slots, its segment ids)."""
    pieces = zip(*[_split(a, tiles, ax) for a, ax in zip(arrays, axes)])
    return list(zip(pieces, _split(slots, tiles, 0), _split(seg, tiles)))


def _visit(update, q_states: list, k_states: list, q_parts, kv_parts, window):
    """Run `(q_state, k_state) = update(q_state, k_state, q_arrays, kv_arrays, seen)` for every
    (query tile i, key tile j) block the mask does not wholly hide: (q_states, k_states)."""
    q_states, k_states = list(q_states), list(k_states)
    for i, (qa, qs, qseg) in enumerate(q_parts):
        for j, (ka, ks, kseg) in enumerate(kv_parts):
            seen = _seen(qs, ks, qseg, kseg, window)

            def run(states, qa=qa, ka=ka, seen=seen):
                return update(*states, qa, ka, seen)

            q_states[i], k_states[j] = jax.lax.cond(
                jnp.any(seen), run, lambda states: states, (q_states[i], k_states[j])
            )
    return q_states, k_states


@partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _ring_attend(q, k, v, slots, seg, window, n, tiles):
    return _ring_forward(q, k, v, slots, seg, window, n, tiles)[0]


def _forward_update(q_state, k_state, qa, ka, seen):
    return _forward_block(q_state, qa[0], ka[0], ka[1], seen), k_state


def _ring_forward(q, k, v, slots, seg, window, n, tiles):
    """(output in q's dtype, logsumexp [batch, kv_heads, group, T] fp32) of this device's queries."""
    B, T, K, G, D = q.shape
    h = T // tiles
    start = (jnp.zeros((B, h, K, G, D), jnp.float32), jnp.full((B, K, G, h), _NEG), jnp.zeros((B, K, G, h)))
    states = [_varying(start) for _ in range(tiles)]
    q_parts = _parts((q,), (1,), slots, seg, tiles)
    kv = (k, v, slots, seg)
    for step in range(n):
        kv_parts = _parts(kv[:2], (1, 1), kv[2], kv[3], tiles)
        states, _ = _visit(_forward_update, states, [None] * tiles, q_parts, kv_parts, window)
        if step < n - 1:
            kv = _shift(kv, n)
    acc, m, l = (jnp.concatenate(parts, axis=ax) for parts, ax in zip(zip(*states), (1, -1, -1)))
    out = acc / jnp.moveaxis(l, -1, 1)[..., None]
    return out.astype(q.dtype), m + jnp.log(l)


def _ring_fwd(q, k, v, slots, seg, window, n, tiles):
    out, lse = _ring_forward(q, k, v, slots, seg, window, n, tiles)
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


def _ring_bwd(n, tiles, res, do):
    q, k, v, slots, seg, window, out, lse = res
    # delta = rowsum(dO * O), [b, k, g, t] like lse: the softmax backward's correction term.
    delta = jnp.moveaxis(jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1), 1, -1)
    q_parts = _parts((q, do, lse, delta), (1, 1, -1, -1), slots, seg, tiles)
    dqs = [_varying(jnp.zeros(qa[0].shape, jnp.float32)) for qa, _, _ in q_parts]
    # The key/value gradients travel with their chunk (kv[4:]).
    kv = (k, v, slots, seg, *_varying((jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))))
    for step in range(n):
        kv_parts = _parts(kv[:2], (1, 1), kv[2], kv[3], tiles)
        k_states = list(zip(_split(kv[4], tiles), _split(kv[5], tiles)))
        dqs, k_states = _visit(_backward_block, dqs, k_states, q_parts, kv_parts, window)
        dk, dv = (jnp.concatenate(parts, axis=1) for parts in zip(*k_states))
        # The last hop sends only the key/value gradients: it brings them back to their chunk's device.
        kv = _shift((*kv[:4], dk, dv), n) if step < n - 1 else (*kv[:4], *_shift((dk, dv), n))
    dq = jnp.concatenate(dqs, axis=1)
    return dq.astype(q.dtype), kv[4].astype(k.dtype), kv[5].astype(v.dtype), None, None, None


_ring_attend.defvjp(_ring_fwd, _ring_bwd)


def self_attention(cfg, h, w, cos, sin, slots, segment_ids, window, mesh: Mesh, key=None) -> jax.Array:
    """The attention branch of one block for normed input h [batch, L, embed] with L split over the
    context axis: q/k/v projection and RoPE as `attention.self_attention`, the ring as the core.
    `slots` [L] are the positions' original slots (None: the row is in its own order)."""
    q, k, v = attention.project_qkv(cfg, h, w, key)
    q = layers.apply_rope(q, cos, sin)
    k = layers.apply_rope(k, cos, sin)
    if slots is None:
        slots = jnp.arange(h.shape[1])
    out = ring_attention(q, k, v, slots, segment_ids, window, mesh, cfg.attention_block)
    return attention.project_out(w, out, key)
