"""Causal attention by blocks with an online softmax (flash-style), in plain JAX, with its own VJP.

Queries are cut into blocks of `block` rows and keys into blocks of `block`
columns; for each query block a loop over key blocks keeps a running row max,
row sum and weighted value sum in fp32, so only one [block, block] tile of
scores exists at a time. The forward saves its output and the per-row
logsumexp; the backward recomputes each tile's probabilities from them
(FlashAttention-2's scheme). Nothing of size [seq, seq] exists in either pass:
masks are built per tile from slot positions (causal), segment ids (packed
documents) and a window size that may be a traced per-layer int.

Tiles that no query of the block can see (above the causal diagonal, behind a
window) are skipped: the loops run only over the range of key blocks (query
blocks, in the backward) that can be visible, and where slots are not in
order (context-parallel chunks) a `lax.cond` skips the invisible tiles inside it.

Shapes follow `model.attention`: q [batch, T, kv_heads, group, D], k and v
[batch, S, kv_heads, D]; the logsumexp is [batch, T, kv_heads, group] fp32.
`partial` computes attention over one set of keys and returns (out, lse), and
`merge` combines two such results over disjoint key sets (ring attention).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

NO_WINDOW = 2**30
"""Window meaning 'global'; slot positions are assumed below it (equals `attention.GLOBAL_WINDOW`)."""
_PAD_SLOT = 2**30
"""Slot of the padding keys added to fill the last block: after every real query, so causally hidden."""
_F32 = jnp.float32


def attention(q, k, v, segment_ids=None, window=None, *, block: int = 512) -> jax.Array:
    """Causal self-attention over one sequence, [batch, T, kv_heads, group, D] (see the module doc).

    `segment_ids` [batch, T] stop attention across packed documents; `window`
    (None, an int or a traced int; >= T means global) keeps the last `window`
    positions, the query's own included.
    """
    slots = jnp.arange(q.shape[1], dtype=jnp.int32)
    return partial(q, k, v, slots, slots, segment_ids, segment_ids, window, block=block, ordered=True)[0]


def partial(
    q,
    k,
    v,
    q_slots,
    k_slots,
    q_segments=None,
    k_segments=None,
    window=None,
    *,
    block: int = 512,
    ordered: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Attention of queries at `q_slots` [T] over keys at `k_slots` [S]: (out, lse).

    A query sees a key when k_slot <= q_slot, q_slot - k_slot < window and
    (with segment ids [batch, T] / [batch, S]) their segments are equal. out
    [batch, T, kv_heads, group, D] is normalised over these keys; lse
    [batch, T, kv_heads, group] (fp32) is the log of the softmax denominator,
    -inf for a query that sees none of them (its out is 0). Lengths that are
    not a multiple of `block` are padded up inside (the padding is invisible).
    Differentiable in q, k and v, through both outputs. `ordered=True`
    promises increasing slots (one contiguous sequence): the visible tiles
    of a block then form one range and no per-tile test is compiled.
    """
    T, S = q.shape[1], k.shape[1]
    bq, bk = min(block, T), min(block, S)
    Tp, Sp = -(-T // bq) * bq, -(-S // bk) * bk
    q_slots = jnp.asarray(q_slots, jnp.int32)
    k_slots = jnp.asarray(k_slots, jnp.int32)
    if q_segments is None or k_segments is None:
        q_segments = jnp.zeros((q.shape[0], T), jnp.int32)
        k_segments = jnp.zeros((k.shape[0], S), jnp.int32)
    window = jnp.asarray(NO_WINDOW if window is None else window, jnp.int32)
    q, q_slots, q_segments = _pad(q, Tp, 1), _pad(q_slots, Tp, 0, "edge"), _pad(q_segments, Tp, 1, "edge")
    k, v, k_segments = _pad(k, Sp, 1), _pad(v, Sp, 1), _pad(k_segments, Sp, 1, "edge")
    k_slots = _pad(k_slots, Sp, 0, _PAD_SLOT)
    out, lse = _flash(
        bq,
        bk,
        ordered,
        q,
        k,
        v,
        q_slots,
        k_slots,
        q_segments.astype(jnp.int32),
        k_segments.astype(jnp.int32),
        window,
    )
    return out[:, :T], lse[:, :T]


def merge(out1, lse1, out2, lse2) -> tuple[jax.Array, jax.Array]:
    """Combine `partial` results over two disjoint key sets into the result over their union.

    A query must see at least one key of the union (true for causal self-attention).
    """
    lse = jnp.logaddexp(lse1, lse2)
    safe = jnp.where(jnp.isneginf(lse), 0.0, lse)
    w1, w2 = jnp.exp(lse1 - safe)[..., None], jnp.exp(lse2 - safe)[..., None]
    out = w1 * out1.astype(_F32) + w2 * out2.astype(_F32)
    return out.astype(out1.dtype), lse


def _pad(x, n: int, axis: int, value="zero"):
    """x padded along `axis` to length n: with zeros, its edge value, or a constant."""
    extra = n - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    if value == "edge":
        return jnp.pad(x, widths, mode="edge")
    return jnp.pad(x, widths, constant_values=0 if value == "zero" else value)


def _visible(q_slots, k_slots, window, bq: int, bk: int) -> jax.Array:
    """[q blocks, k blocks] bool: may any query of the block see any key of the block (conservative)."""
    qs, ks = q_slots.reshape(-1, bq), k_slots.reshape(-1, bk)
    q_lo, q_hi = qs.min(1)[:, None], qs.max(1)[:, None]
    k_lo, k_hi = ks.min(1)[None, :], ks.max(1)[None, :]
    return (k_lo <= q_hi) & (q_lo - k_hi < window)


def _span(vis: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row of `vis`, the first and one past the last True column ((0, 0) for a row with none)."""
    n = vis.shape[1]
    any_ = vis.any(1)
    lo = jnp.argmax(vis, axis=1)
    hi = n - jnp.argmax(vis[:, ::-1], axis=1)
    return jnp.where(any_, lo, 0), jnp.where(any_, hi, 0)


def _tile_mask(q_slots, k_slots, q_seg, k_seg, window) -> jax.Array:
    """[batch, bq, bk] bool: which keys of the tile each query sees."""
    d = q_slots[:, None] - k_slots[None, :]
    seen = (d >= 0) & (d < window)
    return seen[None] & (q_seg[:, :, None] == k_seg[:, None, :])


def _scores(qi, kj, seen) -> jax.Array:
    """Scaled fp32 scores [batch, kv_heads, group, bq, bk] of one tile, -inf where not seen."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", qi, kj, preferred_element_type=_F32)
    s = s * (1.0 / math.sqrt(qi.shape[-1]))
    return jnp.where(seen[:, None, None], s, -jnp.inf)


def _block(x, i, size: int, axis: int = 1):
    return jax.lax.dynamic_slice_in_dim(x, i * size, size, axis)


def _maybe(ordered: bool, visible, fn, i, carry):
    """fn(i, carry), or carry where the tile is not `visible` (tested only where slots are unordered)."""
    if ordered:
        return fn(i, carry)
    return jax.lax.cond(visible, fn, lambda i, c: c, i, carry)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _flash(bq, bk, ordered, q, k, v, q_slots, k_slots, q_seg, k_seg, window):
    return _forward(bq, bk, ordered, q, k, v, q_slots, k_slots, q_seg, k_seg, window)


def _forward(bq, bk, ordered, q, k, v, q_slots, k_slots, q_seg, k_seg, window):
    B, Tp, K, G, D = q.shape
    vis = _visible(q_slots, k_slots, window, bq, bk)
    lo, hi = _span(vis)

    def query_block(i):
        qi, qs, qg = _block(q, i, bq), _block(q_slots, i, bq, 0), _block(q_seg, i, bq)

        def tile(j, carry):
            m, l, acc = carry
            kj, vj = _block(k, j, bk), _block(v, j, bk)
            s = _scores(qi, kj, _tile_mask(qs, _block(k_slots, j, bk, 0), qg, _block(k_seg, j, bk), window))
            m_new = jnp.maximum(m, s.max(-1))
            base = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # a row that has seen nothing yet
            p = jnp.exp(s - base[..., None])
            alpha = jnp.exp(m - base)
            pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), vj, preferred_element_type=_F32)
            return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv

        def step(j, carry):
            return _maybe(ordered, vis[i, j], tile, j, carry)

        init = (
            jnp.full((B, K, G, bq), -jnp.inf, _F32),
            jnp.zeros((B, K, G, bq), _F32),
            jnp.zeros((B, K, G, bq, D), _F32),
        )
        m, l, acc = jax.lax.fori_loop(lo[i], hi[i], step, init)
        empty = l == 0
        out = acc / jnp.where(empty, 1.0, l)[..., None]
        lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))
        return out.transpose(0, 3, 1, 2, 4).astype(q.dtype), lse.transpose(0, 3, 1, 2)

    out, lse = jax.lax.map(query_block, jnp.arange(Tp // bq))
    out = jnp.moveaxis(out, 0, 1).reshape(B, Tp, K, G, D)
    return out, jnp.moveaxis(lse, 0, 1).reshape(B, Tp, K, G)


def _flash_fwd(bq, bk, ordered, q, k, v, q_slots, k_slots, q_seg, k_seg, window):
    out, lse = _forward(bq, bk, ordered, q, k, v, q_slots, k_slots, q_seg, k_seg, window)
    return (out, lse), (q, k, v, q_slots, k_slots, q_seg, k_seg, window, out, lse)


def _flash_bwd(bq, bk, ordered, res, cts):
    q, k, v, q_slots, k_slots, q_seg, k_seg, window, out, lse = res
    d_out, d_lse = cts
    scale = 1.0 / math.sqrt(q.shape[-1])
    # dS = P * (dP - rowsum(dO * O) + dlse): the lse output's cotangent enters each row like this.
    row = jnp.sum(d_out.astype(_F32) * out.astype(_F32), -1) - d_lse.astype(_F32)
    row = row.transpose(0, 2, 3, 1)  # [B, K, G, Tp]
    lse_t = jnp.where(jnp.isneginf(lse), jnp.inf, lse).transpose(0, 2, 3, 1)  # empty rows: P = 0
    vis = _visible(q_slots, k_slots, window, bq, bk)
    lo, hi = _span(vis.T)

    def key_block(j, carry):
        dq, dk, dv = carry
        kj, vj, ks, kg = _block(k, j, bk), _block(v, j, bk), _block(k_slots, j, bk, 0), _block(k_seg, j, bk)

        def tile(i, c):
            dq, dkj, dvj = c
            qi, doi = _block(q, i, bq), _block(d_out, i, bq)
            s = _scores(qi, kj, _tile_mask(_block(q_slots, i, bq, 0), ks, _block(q_seg, i, bq), kg, window))
            p = jnp.exp(s - _block(lse_t, i, bq, 3)[..., None])
            dvj = dvj + jnp.einsum(
                "bkgqs,bqkgd->bskd", p.astype(d_out.dtype), doi, preferred_element_type=_F32
            )
            dp = jnp.einsum("bqkgd,bskd->bkgqs", doi, vj, preferred_element_type=_F32)
            ds = (p * (dp - _block(row, i, bq, 3)[..., None]) * scale).astype(q.dtype)
            dqi = jnp.einsum("bkgqs,bskd->bqkgd", ds, kj, preferred_element_type=_F32)
            dq = jax.lax.dynamic_update_slice_in_dim(dq, _block(dq, i, bq) + dqi, i * bq, 1)
            dkj = dkj + jnp.einsum("bkgqs,bqkgd->bskd", ds, qi, preferred_element_type=_F32)
            return dq, dkj, dvj

        def step(i, c):
            return _maybe(ordered, vis[i, j], tile, i, c)

        zero = jnp.zeros(kj.shape, _F32)
        dq, dkj, dvj = jax.lax.fori_loop(lo[j], hi[j], step, (dq, zero, zero))
        dk = jax.lax.dynamic_update_slice_in_dim(dk, dkj, j * bk, 1)
        dv = jax.lax.dynamic_update_slice_in_dim(dv, dvj, j * bk, 1)
        return dq, dk, dv

    init = (jnp.zeros(q.shape, _F32), jnp.zeros(k.shape, _F32), jnp.zeros(v.shape, _F32))
    dq, dk, dv = jax.lax.fori_loop(0, k.shape[1] // bk, key_block, init)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
