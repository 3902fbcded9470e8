"""int8 weight-only quantization: a matrix stored as int8 with fp32 scales, per output channel or per group.

`QuantizedMatrix` takes a weight's place in the params tree. Its scale has
the weight's rank; each of its axes divides the weight's, and a scale entry
covers a block of `q.shape[i] // scale.shape[i]` consecutive indices on
every axis i (`expand_scale`). Per output channel (`--quantize int8`) the
scale has size 1 on the contracted (input) axes: one scale per output
channel. Group-wise (`--quantize int8-g128`, `quantize(..., group=128)`) it
has n_in / g entries there: one scale per run of g consecutive inputs of
each output channel, so one outlier input row costs the precision of its
own group only, not of its whole column. Either way the layout changes the
model makes to a weight (reshapes, slices of a layer stack, fusing q|k|v or
gate|up, transposing a tied embedding) apply to the int8 values and to the
scales alike (`apply`), and the dequantized weight is always
`q * expand_scale(scale, q.shape)`. `layers.dense` multiplies by it
(`matmul`), and so does `x @ w` (`__rmatmul__`), so every matmul site of the
forward passes and the decode steps accepts it.
`model.quantize.quantize_params` converts a model's params.

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
it (`inference.engine.decode_compiler_options`). Group-wise matrices run the
same int8 dot once per group (one batched dot over the groups, int32 sums
per group) and scale and add the groups' fp32 partial products.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from shipyard.model import fp8, nf4
from shipyard.parallel import backend

INT8_MAX = 127.0


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedMatrix:
    """A weight as int8 values and fp32 scales: weight ~= q * scale (broadcast)."""

    q: jax.Array
    """int8, the weight's shape."""
    scale: jax.Array
    """fp32, the weight's rank, each axis dividing q's: 1 on the contracted (input) axes for one scale per
    output channel, n_in / g there for one per g consecutive inputs (see `expand_scale`)."""

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


def quantize(w: jax.Array, in_axes: Sequence[int], group: int | None = None) -> QuantizedMatrix:
    """Symmetric int8: each output channel's (or, with `group`, each group's) largest |w| maps to 127.

    `group` None: one scale per output channel over all of `in_axes`. Otherwise
    one per run of g consecutive inputs (the input axes flattened in order), g
    from `group_factors`: at most `group`, at least half of it, dividing the
    input; a weight with no such g (or at most `group` inputs) gets one group
    per channel, the per-channel scales. Rounding to nearest, so
    |dequantize(quantize(w)) - w| <= the element's scale / 2.
    """
    w = jnp.asarray(w, jnp.float32)
    in_axes = tuple(sorted(a % w.ndim for a in in_axes))
    factors = group_factors(w.shape, in_axes, group)
    if factors is None:
        amax = jnp.max(jnp.abs(w), axis=in_axes, keepdims=True)
    else:
        # split each input axis i into (size / factor, factor) and reduce over the factor parts
        split = []
        for i, n in enumerate(w.shape):
            split += [n // factors[i], factors[i]] if i in in_axes else [n]
        inner = tuple(in_axes.index(i) + i + 1 for i in in_axes)  # the factor parts' positions in `split`
        amax = jnp.max(jnp.abs(w.reshape(split)), axis=inner)
    scale = amax / INT8_MAX
    safe = jnp.where(scale > 0, scale, 1.0)  # an all-zero channel or group: q = 0 whatever the scale
    q = jnp.clip(jnp.round(w / expand_scale(safe, w.shape)), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return QuantizedMatrix(q, scale)


def group_factors(shape: Sequence[int], in_axes: Sequence[int], group: int | None) -> dict[int, int] | None:
    """Per input axis, how many consecutive indices one group scale covers (their product is the group
    size g); None for one scale per output channel.

    g is the largest size in [group / 2, group] that divides the flattened input axes into whole runs
    any reshape of them keeps: the innermost axes whole, then a divisor of the next one (wo's
    [heads, head_dim] inputs with head_dim 64 and group 128: two heads per group). Halving the
    group is the floor: smaller groups add fp32 scales (1/16 of the int8 bytes at g = 64) for little
    accuracy, so a weight with no such g (or with at most `group` inputs) keeps per-channel scales
    (a 576-wide input with group 128: g = 96; a 131-wide one: per channel).
    """
    if group is None:
        return None
    if group < 2:
        raise ValueError(f"int8 group size must be at least 2, got {group}")
    in_axes = sorted(in_axes)
    n_in = int(np.prod([shape[a] for a in in_axes]))
    if n_in <= group:
        return None
    for g in range(group, (group + 1) // 2 - 1, -1):
        factors, left = {}, g
        for a in reversed(in_axes):  # innermost input axis first
            n = shape[a]
            if left >= n and left % n == 0:
                factors[a], left = n, left // n
            elif left < n and n % left == 0:
                factors[a], left = left, 1
            else:
                break
        else:
            if left == 1:
                return factors
    return None


def expand_scale(scale: jax.Array, shape: Sequence[int]) -> jax.Array:
    """`scale` broadcast to `shape`: axis i's entries each repeated shape[i] // scale.shape[i] times."""
    for i, (s, n) in enumerate(zip(scale.shape, shape)):
        if s != 1 and s != n:
            scale = jnp.repeat(scale, n // s, axis=i, total_repeat_length=n)
    return jnp.broadcast_to(scale, tuple(shape))


def groups(w: QuantizedMatrix) -> int:
    """How many scales each output channel of a 2-D [in, out] matrix has: 1 per channel, else n_in / g."""
    return int(w.scale.shape[0])


def dequantize(w: QuantizedMatrix, dtype=jnp.float32) -> jax.Array:
    return (w.q.astype(jnp.float32) * expand_scale(w.scale, w.q.shape)).astype(dtype)


def apply(fn: Callable, *ws):
    """fn(*ws) for arrays; for QuantizedMatrix arguments, fn on their int8 values and on their scales.

    For layout changes only (reshape with -1 or from the argument's own shape,
    slicing, concatenation, stacking, transposes): they keep `q * scale`
    meaning the same weight because the scale broadcasts along the input axes,
    or, group-wise, repeats along them in whole runs: merging input axes (wo's
    [heads, head_dim] into one) keeps each group's inputs consecutive because
    `group_factors` leaves the axes inside the grouped one whole. A result whose
    scale no longer divides the values' shape is refused.
    """
    if any(fp8.is_fp8(w) for w in ws):
        return fp8.apply(fn, *ws)
    if any(nf4.is_nf4(w) for w in ws):
        if not all(nf4.is_nf4(w) for w in ws):
            raise TypeError("cannot combine NF4 and other weights in one matrix")
        return nf4.apply(fn, *ws)
    kinds = {is_quantized(w) for w in ws}
    if kinds == {False}:
        return fn(*ws)
    if kinds != {True}:
        raise TypeError("cannot combine quantized and unquantized weights in one matrix")
    q, scale = fn(*(w.q for w in ws)), fn(*(w.scale for w in ws))
    if q.ndim != scale.ndim or any(n % s for n, s in zip(q.shape, scale.shape)):
        raise ValueError(
            f"{fn} is not a layout change int8 weights can follow ({q.shape} vs scales {scale.shape})"
        )
    return QuantizedMatrix(q, scale)


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
    if w.ndim != 2 or w.scale.shape[1] != w.shape[1]:
        raise ValueError(
            f"matmul takes a 2-D quantized matrix, one scale per output channel or group, got "
            f"shape {w.shape}, scales {w.scale.shape}"
        )
    x2 = x.reshape(-1, x.shape[-1])
    return _matmul2(x2, w.q, w.scale).astype(x.dtype).reshape(*x.shape[:-1], w.shape[-1])


@jax.custom_vjp
def _matmul2(x2: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    dot = int8_dot if backend.on_cpu() else dequantized_dot
    return dot(x2, QuantizedMatrix(q, scale))


def _matmul2_fwd(x2, q, scale):
    # Residuals: the int8 values (not a float copy of the weight) and an empty array carrying x's dtype.
    return _matmul2(x2, q, scale), (q, scale, jnp.zeros((0,), x2.dtype))


def _matmul2_bwd(res, dy):
    q, scale, like = res
    w = dequantize(QuantizedMatrix(q, scale), like.dtype)
    dx = jax.lax.dot(dy.astype(like.dtype), w.T, preferred_element_type=jnp.float32).astype(like.dtype)
    return dx, np.zeros(q.shape, jax.dtypes.float0), jnp.zeros_like(scale)


_matmul2.defvjp(_matmul2_fwd, _matmul2_bwd)


def int8_dot(x: jax.Array, w: QuantizedMatrix) -> jax.Array:
    """x [rows, in] @ w as one int8 x int8 -> int32 dot of the activations' two digits (`_split_rows`).

    Group-wise: the same dot batched over the groups ([groups, 2 * rows, out] int32 sums), each
    group's sums scaled by its own scales, then added: the weights are still read once, as int8.
    """
    digits, xs = _split_rows(x.astype(jnp.float32))
    rows, n = x.shape[0], groups(w)
    if n == 1:
        acc = jax.lax.dot(digits, w.q, preferred_element_type=jnp.int32).astype(jnp.float32)
        return (acc[:rows] + acc[rows:] * (1.0 / LO_SCALE)) * xs * w.scale
    g = w.shape[0] // n
    per_group = jax.lax.dot_general(
        digits.reshape(digits.shape[0], n, g),
        w.q.reshape(n, g, w.shape[1]),
        (((2,), (1,)), ((1,), (0,))),  # contract within a group, batch over the groups
        preferred_element_type=jnp.int32,
    )
    acc = jnp.einsum("grn,gn->rn", per_group.astype(jnp.float32), w.scale)
    return (acc[:rows] + acc[rows:] * (1.0 / LO_SCALE)) * xs


def dequantized_dot(x: jax.Array, w: QuantizedMatrix) -> jax.Array:
    """x [rows, in] @ w with the int8 -> x.dtype convert inside the dot (GPU/TPU compilers fuse it).

    Group-wise the scales are applied before the dot (the dequantized weight in x's dtype, as
    `nf4.matmul` does): a producer fusion of the dot there, not a copy of the weight kept around.
    """
    if groups(w) == 1:
        return jax.lax.dot(x, w.q.astype(x.dtype), preferred_element_type=jnp.float32) * w.scale
    return jax.lax.dot(x, dequantize(w, x.dtype), preferred_element_type=jnp.float32)


def embed_lookup(table, ids: jax.Array) -> jax.Array:
    """Rows of an embedding table [vocab, embed] (quantized per row or per group of a row, or not) for token ids."""
    if not is_quantized(table):
        return jnp.take(table, ids, axis=0)
    rows = jnp.take(table.q, ids, axis=0).astype(jnp.float32)
    return rows * expand_scale(jnp.take(table.scale, ids, axis=0), rows.shape)


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
