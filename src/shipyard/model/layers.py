"""The building blocks of a Llama-3 style decoder, as pure functions."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from shipyard.config import RopeScaling


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in fp32 (the mean of squares underflows in bf16), cast back."""
    xf = x.astype(jnp.float32)
    var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    return (xf * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> jax.Array:
    """Inverse frequencies of the rotary embedding, with optional Llama-3 scaling.

    Llama-3 scaling leaves high frequencies (short wavelengths) alone, divides
    low frequencies by `factor`, and blends linearly (in 1/wavelength) between.
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv_freq
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    return jnp.where(
        wavelen > low_wavelen,
        inv_freq / scaling.factor,
        jnp.where(wavelen < high_wavelen, inv_freq, blended),
    )


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables of shape positions.shape + (head_dim // 2,)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x[..., seq, heads, head_dim] by position.

    Uses the "rotate half" pairing (dimension i with i + head_dim/2), the layout
    of Hugging Face Llama checkpoints, so exported weights need no permutation.
    cos/sin are [batch or 1, seq, head_dim/2].
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    c, s = cos[..., None, :], sin[..., None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """Causal grouped-query attention.

    q: [batch, seq, heads, head_dim]; k, v: [batch, seq, kv_heads, head_dim].
    Query heads are grouped onto their shared KV head by a reshape, so KV is
    never materialised `heads / kv_heads` times. Scores and softmax are fp32.
    segment_ids ([batch, seq], optional) stop attention across packed documents.
    """
    b, s, h, d = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, s, kvh, h // kvh, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / math.sqrt(d))
    pos = jnp.arange(s)
    mask = pos[:, None] >= pos[None, :]
    if segment_ids is not None:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        mask = mask[None] & same
        mask = mask[:, None, None]
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)
    return out.reshape(b, s, h, d)


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    gate = x @ w_gate
    up = x @ w_up
    return (jax.nn.silu(gate) * up) @ w_down
