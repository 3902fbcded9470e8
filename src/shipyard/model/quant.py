"""int8 weight-only quantization: a matrix stored as int8 with per-output-channel fp32 scales.

`QuantizedMatrix` takes a weight's place in the params tree. Its scale has
the weight's rank with size 1 on the contracted (input) axes, so the layout
changes the model makes to a weight (reshapes, slices of a layer stack,
fusing q|k|v or gate|up, transposing a tied embedding) apply to the int8
values and to the scales alike (`apply`), and the dequantized weight is
always `q * scale`. `layers.dense` multiplies by it (`matmul`), and so does
`x @ w` (`__rmatmul__`), so every matmul site of the forward passes and the
decode steps accepts it. `model.quantize.quantize_params` converts a model's params.

How the product runs depends on the backend. GPU/TPU: `dequantized_dot`,
the int8 -> float convert inside the dot, which those compilers fuse into
the matmul. CPU: XLA does not fuse that convert (`x @ q.astype(f32)`
writes an fp32 copy of the weight first: slower than fp32 weights), and its
own int8 dot is a slow generic loop, but YNNPACK's int8 x int8 -> int32 dot
reads the int8 weights directly (about 2.5x faster than fp32 on the `small`
model's output head). So `int8_dot` writes each activation row as two int8
digits (hi + lo / 254, one dot over both: the weights are read once) and
the only rounding left is the weights' own; a single digit (plain W8A8)
measured twice the logit error. The decode step enables YNNPACK's dots for
it (`inference.engine.decode_compiler_options`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from shipyard.model import nf4

INT8_MAX = 127.0


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedMatrix:
    """A weight as int8 values and fp32 scales: weight ~= q * scale (broadcast)."""

    q: jax.Array
    """int8, the weight's shape."""
    scale: jax.Array
    """fp32, the weight's shape with 1 on the contracted (input) axes: one scale per output channel."""

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape

    @property
    def ndim(self) -> int:
        return self.q.ndim

    @property
    def T(self) -> QuantizedMatrix:
        """The transpose (a tied embedding [vocab, embed] used as the [embed, vocab] head)."""
        return QuantizedMatrix(self.q.T, self.scale.T)

    def __rmatmul__(self, x: jax.Array) -> jax.Array:
        return matmul(x, self)


def is_quantized(w) -> bool:
    return isinstance(w, QuantizedMatrix)


def quantize(w: jax.Array, in_axes: Sequence[int]) -> QuantizedMatrix:
    """Symmetric int8 per output channel: each channel's largest |w| over `in_axes` maps to 127.

    Rounding to nearest, so |dequantize(quantize(w)) - w| <= scale / 2 elementwise.
    """
    w = jnp.asarray(w, jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=tuple(in_axes), keepdims=True)
    scale = amax / INT8_MAX
    safe = jnp.where(scale > 0, scale, 1.0)  # an all-zero channel: q = 0 whatever the scale
    q = jnp.clip(jnp.round(w / safe), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return QuantizedMatrix(q, scale)


def dequantize(w: QuantizedMatrix, dtype=jnp.float32) -> jax.Array:
    return (w.q.astype(jnp.float32) * w.scale).astype(dtype)


def apply(fn: Callable, *ws):
    """fn(*ws) for arrays; for QuantizedMatrix arguments, fn on their int8 values and on their scales.

    For layout changes only (reshape with -1 or from the argument's own shape,
    slicing, concatenation, stacking, transposes): they keep `q * scale`
    meaning the same weight because the scale broadcasts along the input axes.
    """
    if any(nf4.is_nf4(w) for w in ws):
        if not all(nf4.is_nf4(w) for w in ws):
            raise TypeError("cannot combine NF4 and other weights in one matrix")
        return nf4.apply(fn, *ws)
    kinds = {is_quantized(w) for w in ws}
    if kinds == {False}:
        return fn(*ws)
    if kinds != {True}:
        raise TypeError("cannot combine quantized and unquantized weights in one matrix")
    return QuantizedMatrix(fn(*(w.q for w in ws)), fn(*(w.scale for w in ws)))


def _split_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Activations x [rows, in] (fp32) as two int8 digits per value: x ~= scale * (hi + lo / LO_SCALE).

    Returns (int8 [2 * rows, in]: the hi rows, then the lo rows; fp32 scales [rows, 1]). One int8
    digit per value (plain dynamic W8A8) doubles the error of int8 weights; the second digit makes
    the activations' error ~1/32000 of each row's largest value, so only the weights' rounding
    remains, and the int8 dot reads each weight once for both digits.
    """
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
    y = x / scale
    hi = jnp.round(y)
    lo = jnp.round((y - hi) * LO_SCALE)  # y - hi is in [-0.5, 0.5]
    return jnp.concatenate([hi, lo]).astype(jnp.int8), scale


LO_SCALE = 2 * INT8_MAX
"""The second digit's weight: lo / LO_SCALE covers the first digit's rounding error, [-0.5, 0.5]."""


def matmul(x: jax.Array, w: QuantizedMatrix) -> jax.Array:
    """x[..., in] @ w[in, out] in x's dtype (fp32 accumulation): `int8_dot` on CPU, else `dequantized_dot`.

    Differentiable in x (QLoRA's int8 base): the gradient is dy @ dequantize(w)^T (`int8_dot` rounds the
    activations, whose derivative would be zero); the weight itself gets none (it is frozen).
    """
    if w.ndim != 2:
        raise ValueError(f"matmul takes a 2-D quantized matrix, got shape {w.shape}")
    x2 = x.reshape(-1, x.shape[-1])
    return _matmul2(x2, w.q, w.scale).astype(x.dtype).reshape(*x.shape[:-1], w.shape[-1])


@jax.custom_vjp
def _matmul2(x2: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    dot = int8_dot if jax.default_backend() == "cpu" else dequantized_dot
    return dot(x2, QuantizedMatrix(q, scale))


def _matmul2_fwd(x2, q, scale):
    # Residuals: the int8 values (not a float copy of the weight) and an empty array carrying x's dtype.
    return _matmul2(x2, q, scale), (q, scale, jnp.zeros((0,), x2.dtype))


def _matmul2_bwd(res, dy):
    q, scale, like = res
    w = (q.astype(jnp.float32) * scale).astype(like.dtype)
    dx = jax.lax.dot(dy.astype(like.dtype), w.T, preferred_element_type=jnp.float32).astype(like.dtype)
    return dx, np.zeros(q.shape, jax.dtypes.float0), jnp.zeros_like(scale)


_matmul2.defvjp(_matmul2_fwd, _matmul2_bwd)


def int8_dot(x: jax.Array, w: QuantizedMatrix) -> jax.Array:
    """x [rows, in] @ w as one int8 x int8 -> int32 dot of the activations' two digits (`_split_rows`)."""
    digits, xs = _split_rows(x.astype(jnp.float32))
    acc = jax.lax.dot(digits, w.q, preferred_element_type=jnp.int32).astype(jnp.float32)
    rows = x.shape[0]
    return (acc[:rows] + acc[rows:] * (1.0 / LO_SCALE)) * xs * w.scale


def dequantized_dot(x: jax.Array, w: QuantizedMatrix) -> jax.Array:
    """x [rows, in] @ w with the int8 -> x.dtype convert inside the dot (GPU/TPU compilers fuse it)."""
    return jax.lax.dot(x, w.q.astype(x.dtype), preferred_element_type=jnp.float32) * w.scale


def embed_lookup(table, ids: jax.Array) -> jax.Array:
    """Rows of an embedding table [vocab, embed] (quantized per row or not) for token ids."""
    if not is_quantized(table):
        return jnp.take(table, ids, axis=0)
    rows = jnp.take(table.q, ids, axis=0).astype(jnp.float32)
    return rows * jnp.take(table.scale, ids, axis=0)


# The block weights quantize_params converts: the attention and dense-MLP matrices.
BLOCK_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


# ----------------------------------------------------------------------------- QLoRA's frozen base

BASE_MODES = ("nf4", "int8")
"""What `train.finetune.quantize_base` accepts."""


def is_any_quantized(w) -> bool:
    """An int8 `QuantizedMatrix` or an `nf4.NF4Matrix` (a params-tree node standing for one weight)."""
    return is_quantized(w) or nf4.is_nf4(w)


def quantize_weight(w: jax.Array, spec, mode: str, block: int = 64, double_quant: bool = False):
    """One weight (its `ArraySpec` gives the contracted axes) as `mode`: int8 per output channel or NF4."""
    if mode == "int8":
        return quantize(w, spec.fan_in_axes)
    return nf4.quantize(w, spec.fan_in_axes, block, double_quant)


def quantized_spec(spec, mode: str, block: int = 64, double_quant: bool = False):
    """The `ArraySpec`s of `quantize_weight`'s result, in the same node type (for shapes, shardings and
    planning): every array keeps the weight's logical axes, so it is sharded like the weight (a dim the
    mesh no longer divides, such as a few absmax blocks, stays replicated)."""
    from shipyard.model.params import ArraySpec  # params imports parallel.mesh: keep this module light

    def arr(shape, axes, dtype):
        return ArraySpec(tuple(shape), tuple(axes), "zeros", role="weight", dtype=dtype)

    axes, fan_in = spec.logical_axes, spec.fan_in_axes
    if mode == "int8":
        scale_shape = [1 if i in fan_in else d for i, d in enumerate(spec.shape)]
        scale_axes = [None if i in fan_in else a for i, a in enumerate(axes)]
        return QuantizedMatrix(arr(spec.shape, axes, jnp.int8), arr(scale_shape, scale_axes, jnp.float32))
    shapes = nf4.layout(spec.shape, fan_in, block, double_quant)
    lead = axes[: min(fan_in)]
    return nf4.NF4Matrix(
        codes=arr(shapes["codes"], axes, jnp.uint8),
        absmax=arr(shapes["absmax"], axes, jnp.uint8 if double_quant else jnp.float32),
        absmax2=None if not double_quant else arr(shapes["absmax2"], (*lead, None), jnp.float32),
        offset=None if not double_quant else arr(shapes["offset"], lead, jnp.float32),
        out_ndim=len(spec.shape) - max(fan_in) - 1,
        block=block,
    )


def map_block_weights(fn, params, specs):
    """`params` (a TransformerParams, or its spec tree) with each attention and dense-MLP weight of both
    layer stacks replaced by fn(weight, its spec) (`specs`: the model's `param_specs`). The embedding,
    norms, output head, MoE router and experts are left as they are."""

    def stack(blocks, block_specs):
        if blocks is None:
            return None
        new = {}
        for name in BLOCK_WEIGHTS:
            w = getattr(blocks, name)
            if w is not None:
                new[name] = fn(w, getattr(block_specs, name))
        return dataclasses.replace(blocks, **new)

    return dataclasses.replace(
        params,
        blocks=stack(params.blocks, specs.blocks),
        moe_blocks=stack(params.moe_blocks, specs.moe_blocks),
    )


def dequantize_any(w, dtype=jnp.float32):
    """A weight as a plain array: int8 and NF4 matrices dequantized, arrays returned as they are."""
    if nf4.is_nf4(w):
        return nf4.dequantize(w, dtype)
    if is_quantized(w):
        return dequantize(w, dtype)
    return w


def dequantize_params(params):
    """`params` with every quantized weight (int8 or NF4) replaced by its fp32 dequantized array."""
    return jax.tree.map(dequantize_any, params, is_leaf=is_any_quantized)
