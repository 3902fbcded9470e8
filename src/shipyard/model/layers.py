"""The building blocks of a Llama-3 style decoder, as pure functions (attention itself: `model.attention`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from shipyard.config import RopeScaling
from shipyard.model import fp8, nf4, quant
from shipyard.parallel import backend


def cpu_backend() -> bool:
    """Whether JAX's default backend is the CPU, asked at trace time: the CPU-only tricks (the dense
    backward below, unrolled layer scans) apply there alone; GPU and TPU compile the plain model."""
    return backend.on_cpu()


def layer_unroll(requested: int, layers: int) -> int:
    """The `unroll` of a scan over `layers` layers: model.scan_unroll (at most the layer count) on the
    CPU, where it removes the per-layer slicing of stacked weights; 1 (rolled) elsewhere, where the
    compilers handle the loop themselves and unrolling only lengthens compilation."""
    return min(requested, layers) if cpu_backend() else 1


def dense(x: jax.Array, w) -> jax.Array:
    """x[..., in] @ w[in, out]; w an array, an int8 `quant.QuantizedMatrix`, an `nf4.NF4Matrix` or an
    `fp8.FP8Weight` (train.precision.matmul=fp8: e4m3 operands, e5m2 gradients),
    (the quantized ones: inference, and QLoRA's frozen base, which gets no weight gradient).
    A plain array multiplies through `_dense`'s CPU-laid-out backward on the CPU, as `x @ w` elsewhere."""
    if fp8.is_fp8(w):
        return fp8.matmul(x, w)
    if nf4.is_nf4(w):
        return nf4.matmul(x, w)
    if quant.is_quantized(w):
        return quant.matmul(x, w)
    return _dense(x, w) if cpu_backend() else x @ w


@jax.custom_vjp
def _dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """x[..., in] @ w[in, out], with a backward pass laid out for fast matmuls.

    XLA's autodiff of a plain matmul computes the weight gradient as a dot
    contracting the leading (batch x seq) dimension of both operands; on CPU,
    layout assignment turns that into a transposed copy of the big output
    gradient plus a slow generic dot (measured: 0.48 s of a 4.1 s
    single-threaded step for the output head alone). Here the small input is
    transposed explicitly instead, behind an optimization barrier so XLA
    cannot fold it back, and both backward matmuls are plain row-major ones.
    """
    return _dense_fwd(x, w)[0]


def _dense_fwd(x, w):
    return x @ w, (x, w)


def _dense_bwd(res, dy):
    # The leading dimensions are contracted as they are, never flattened into one: with batch and
    # seq split over different mesh axes (context parallelism) a flattened dimension has no
    # sharding, and the partitioner would gather the whole sequence on every device.
    x, w = res
    lead = tuple(range(x.ndim - 1))
    x_t = jax.lax.optimization_barrier(jnp.moveaxis(x, -1, 0))
    dw = jnp.tensordot(x_t, dy, axes=(tuple(i + 1 for i in lead), lead))
    return dy @ w.T, dw.astype(w.dtype)


_dense.defvjp(_dense_fwd, _dense_bwd)


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
    """Rotate x[batch, seq, *heads, head_dim] by position.

    Uses the "rotate half" pairing (dimension i with i + head_dim/2), the layout
    of Hugging Face Llama checkpoints, so exported weights need no permutation.
    cos/sin are [batch or 1, seq, head_dim/2]; any number of head axes follow seq.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    extra = (1,) * (x.ndim - 3)
    c = cos.reshape(*cos.shape[:2], *extra, half)
    s = sin.reshape(*sin.shape[:2], *extra, half)
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def fuse_gate_up(w_gate, w_up):
    """[embed, mlp] gate and up weights -> one [embed, 2 * mlp] matrix (gate columns, then up).

    Quantized weights fuse their int8 values and their scales alike (`quant.apply`).
    """

    def fuse(g, u):
        return jnp.stack([g, u], axis=1).reshape(g.shape[0], 2 * g.shape[-1])

    return quant.apply(fuse, w_gate, w_up)


def swiglu_fused(x: jax.Array, w_gate_up, w_down) -> jax.Array:
    """SwiGLU MLP on a `fuse_gate_up` weight: one matmul for gate and up."""
    m = w_gate_up.shape[-1] // 2
    gate_up = dense(x, w_gate_up)
    return dense(jax.nn.silu(gate_up[..., :m]) * gate_up[..., m:], w_down)


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, adapter=None) -> jax.Array:
    """SwiGLU MLP; gate and up run as one [embed, 2 * mlp] matmul (wider matmuls run closer to peak on CPU).

    `adapter(target, inputs)` (LoRA) returns an addition to the gate, up or
    down projection's output, or None.
    """
    if adapter is None:
        return swiglu_fused(x, fuse_gate_up(w_gate, w_up), w_down)
    m = w_gate.shape[-1]
    gate_up = dense(x, fuse_gate_up(w_gate, w_up))
    gate, up = gate_up[..., :m], gate_up[..., m:]
    gate, up = add_optional(gate, adapter("gate", x)), add_optional(up, adapter("up", x))
    hidden = jax.nn.silu(gate) * up
    return add_optional(dense(hidden, w_down), adapter("down", hidden))


def add_optional(y: jax.Array, d: jax.Array | None) -> jax.Array:
    """y + d in y's shape and dtype, or y when there is no d (an absent adapter)."""
    return y if d is None else y + d.reshape(y.shape).astype(y.dtype)
