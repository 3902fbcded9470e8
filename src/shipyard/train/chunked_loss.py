"""The output projection and cross-entropy over chunks of tokens: the fp32 logits never exist whole.

A model's loss needs, per token, the logsumexp of its logits, the target's
logit and (a diagnostic) the entropy. Computing them from the whole
[tokens, vocab] fp32 logits costs tokens x vocab x 4 bytes, twice with the
backward pass's probabilities: for a 128K vocabulary that is more than the
rest of the step's activations. Here the tokens are split into chunks; the
forward pass computes each chunk's logits (h_chunk @ W in fp32), reduces
them to the three per-token numbers and drops them; the backward pass (a
custom VJP) recomputes each chunk's logits, turns them into the logits'
gradient (p - onehot, scaled by the incoming cotangents) and from it the
chunk's hidden-state gradient and its share of the head's, accumulated in
fp32. At most one chunk's logits (and their gradient) is alive at a time,
for one extra head matmul per chunk in the backward pass.

Chunks are strided slices along the sequence (position i goes to chunk
i % n), the same in every row: every device then holds an equal part of
every chunk whatever the batch and context sharding, and no rows move.
The number of chunks is decided per device (`num_chunks`): a device with at
most `train.loss_chunk_tokens` tokens computes its logits whole, exactly as
before (`loss.loss_sums`), which keeps the small CPU models' speed.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from shipyard.model import layers, quant
from shipyard.train.loss import LossSums, sums_from_stats, token_stats

LOGIT_BUFFERS = 2
"""fp32 [tokens, vocab] buffers the loss holds at once: the logits and their gradient (the
whole path keeps the probabilities for the backward pass; a chunk recomputes them)."""


def num_chunks(shape: tuple[int, int], chunk_tokens: int | None, sharding=None) -> int:
    """How many chunks the loss of a [batch, seq] token block runs in: 1 (whole logits) when each
    device holds at most `chunk_tokens` tokens (or chunking is off, None), else enough chunks for
    each to hold at most that many per device, one position per row at least.

    `sharding` (the residual stream's NamedSharding over [batch, seq, embed]) gives the
    per-device share; without it the whole block counts.
    """
    if chunk_tokens is None:
        return 1
    rows, seq = shape
    if sharding is not None:
        # Only the [batch, seq] dims' mesh axes matter (the embed dim's may not divide a stand-in size).
        spec = tuple(sharding.spec) + (None, None)

        def split(entry) -> int:
            axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
            return math.prod(sharding.mesh.shape[a] for a in axes)

        rows, seq = math.ceil(rows / split(spec[0])), math.ceil(seq / split(spec[1]))
    return min(max(math.ceil(rows * seq / chunk_tokens), 1), shape[1])


def logits_bytes(tokens: float, vocab: float, chunk_tokens: int | None) -> float:
    """Bytes of fp32 logits (and their gradient) the loss holds at once for `tokens` tokens per
    device over `vocab` vocabulary entries per device (the planner's logits term)."""
    at_once = tokens if chunk_tokens is None else min(tokens, chunk_tokens)
    return LOGIT_BUFFERS * 4.0 * at_once * vocab


def accumulator_bytes(tokens: float, embed: float, vocab: float, chunk_tokens: int | None) -> float:
    """Bytes of the fp32 [embed, vocab] head-gradient accumulator the chunked backward carries across
    chunks (per device: the head's local `embed` x `vocab`), 0 when the logits are computed whole
    (`tokens` per device at most `chunk_tokens`). XLA's CPU backend holds one more such buffer (each
    chunk's product before the add); GPU compilers fuse the add into the matmul."""
    return 0.0 if chunk_tokens is None or tokens <= chunk_tokens else 4.0 * embed * vocab


def _logits(h: jax.Array, w: jax.Array) -> jax.Array:
    """One chunk's logits h[..., embed] @ w[embed, vocab], accumulated and returned in fp32."""
    return jnp.einsum("...e,ev->...v", h, w, preferred_element_type=jnp.float32)


def _chunk_stats(h: jax.Array, w: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(logsumexp, target logit, entropy) of one chunk's logits, each shaped like `t`."""
    logits = _logits(h, w)
    m = jnp.max(logits, axis=-1, keepdims=True)
    e = jnp.exp(logits - m)
    z = jnp.sum(e, axis=-1, keepdims=True)
    lse = (m + jnp.log(z))[..., 0]
    target = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
    entropy = lse - jnp.sum(e * logits, axis=-1) / z[..., 0]
    return lse, target, entropy


@jax.custom_vjp
def chunk_stats(h: jax.Array, w: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-token (logsumexp, target logit, entropy) of h @ w, chunk by chunk.

    h [chunks, ..., embed] (compute dtype), w [embed, vocab], integer targets
    [chunks, ...]; outputs fp32 [chunks, ...]. The entropy carries no gradient
    (a diagnostic), as in `loss.token_stats`.
    """
    return _chunk_stats_fwd(h, w, targets)[0]


def _chunk_stats_fwd(h, w, targets):
    lse, target, entropy = jax.lax.map(lambda xs: _chunk_stats(xs[0], w, xs[1]), (h, targets))
    return (lse, target, entropy), (h, w, targets, lse)


def _chunk_stats_bwd(res, g):
    h, w, targets, lse = res
    g_lse, g_target, _ = g
    vocab = jnp.arange(w.shape[-1])

    def one(dw, xs):
        hc, tc, lse_c, gl, gt = xs
        p = jnp.exp(_logits(hc, w) - lse_c[..., None])
        # d/dlogits of (g_lse * lse + g_target * logit[target]).
        dlogits = gl[..., None] * p + jnp.where(vocab == tc[..., None], gt[..., None], 0.0)
        d = dlogits.astype(w.dtype)  # the dtype the whole path's matmul gradient has
        dh = jnp.einsum("...v,ev->...e", d, w, preferred_element_type=jnp.float32).astype(h.dtype)
        dw = dw + jnp.einsum("...e,...v->ev", hc, d, preferred_element_type=jnp.float32)
        return dw, dh

    dw, dh = jax.lax.scan(one, jnp.zeros(w.shape, jnp.float32), (h, targets, lse, g_lse, g_target))
    return dh, dw.astype(w.dtype), None


chunk_stats.defvjp(_chunk_stats_fwd, _chunk_stats_bwd)


def _split(x: jax.Array, n: int) -> jax.Array:
    """[batch, seq, ...] -> [n, batch, ceil(seq / n), ...]: position i of every row in chunk i % n
    (the sequence zero-padded to a multiple of n)."""
    pad = -x.shape[1] % n
    if pad:
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(x.shape[0], x.shape[1] // n, n, *x.shape[2:])
    return jnp.moveaxis(x, 2, 0)


def _join(x: jax.Array, seq: int) -> jax.Array:
    """The inverse of `_split` for a [n, batch, seq / n] array: [batch, seq]."""
    x = jnp.moveaxis(x, 0, 2)
    return x.reshape(x.shape[0], -1)[:, :seq]


def head_token_stats(
    h: jax.Array, w, targets: jax.Array, chunks: int = 1
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-token fp32 (logsumexp, target logit, entropy) [batch, seq] of final hidden states
    h [batch, seq, embed] through the head w [embed, vocab] (`transformer.output_weights`), in
    `chunks` chunks (`num_chunks`).

    One chunk is the whole-logits path (`layers.dense`, then `loss.token_stats`). More need a plain
    array head: a quantized one (int8 / NF4) is inference-only and QLoRA keeps the head in fp32.
    """
    if chunks == 1:
        return token_stats(layers.dense(h, w).astype(jnp.float32), targets)
    if quant.is_any_quantized(w):
        raise ValueError("the chunked loss needs a plain array head, not a quantized one")
    stats = chunk_stats(_split(h, chunks), w, _split(targets, chunks))
    return tuple(_join(s, targets.shape[1]) for s in stats)


def head_loss_sums(h: jax.Array, w, targets: jax.Array, mask: jax.Array, chunks: int = 1) -> LossSums:
    """LossSums of next-token prediction through the head (see `head_token_stats`); `mask` [batch, seq]."""
    return sums_from_stats(*head_token_stats(h, w, targets, chunks), mask)
