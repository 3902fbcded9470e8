"""NF4: 4-bit NormalFloat weights with blockwise absmax scales (QLoRA's frozen base), and its matmul.

The codec (`NF4_CODE`, `quantize_flat`, `dequantize_flat`, `double_quantize`)
works on flat vectors exactly as bitsandbytes' `quantize_4bit` /
`dequantize_4bit` do on a torch tensor: blocks of `block` consecutive values,
each scaled by its largest |value| (absmax) into [-1, 1] and rounded to the
nearest of the 16 NF4 values; two codes per byte, the first in the high
nibble. Double quantization (bitsandbytes' `compress_statistics`) stores the
fp32 absmax as 8-bit codes of bitsandbytes' signed dynamic map in blocks of
256, after subtracting their mean (`offset`).

`NF4Matrix` is the same data laid out to take a weight's place in the params
tree (the sibling of `quant.QuantizedMatrix`). bitsandbytes quantizes a torch
weight [out, in] flattened row-major, i.e. blocks along the input axis of each
output channel; so here the blocks run along the contracted (input) axes and
every array keeps the weight's rank and output axes: `codes` is the weight
with its last input axis halved (two codes per uint8), `absmax` the weight
with the input axes cut into blocks (`block_dims`). Layout changes on the
output axes (q|k|v and gate|up fusion, head regrouping, the layer scan's
slices) then apply to codes and scales alike (`apply`), and each matmul
dequantizes its weight inside the dot (`matmul`), so the base stays ~0.5 byte
a parameter on the device.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

NF4_CODE = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    np.float32,
)
"""The 16 NF4 values (QLoRA, Dettmers et al. 2023, appendix E): quantiles of N(0, 1) scaled to [-1, 1],
with an exact zero."""

STATS_BLOCK = 256
"""Double quantization: absmax values per 8-bit block (bitsandbytes' compress_statistics)."""


def dynamic_code() -> np.ndarray:
    """bitsandbytes' signed 8-bit dynamic map (`create_dynamic_map()`), 256 values in [-1, 1], sorted.

    For exponents 10^-6 .. 10^0 it holds the midpoints of 2^i + 1 evenly spaced points in [0.1, 1]
    (i = 0..6), both signs, then 0 and 1: fine steps near zero, coarse ones near 1.
    """
    values = []
    for i in range(7):
        edges = _torch_linspace(0.1, 1.0, 2**i + 1)
        mids = (edges[:-1] + edges[1:]) / np.float32(2)
        scaled = np.float32(10.0 ** (i - 6)) * mids  # fp32 products, as torch's scalar * fp32 tensor
        values += list(scaled) + list(-scaled)
    values += [0.0, 1.0]
    return np.sort(np.asarray(values, np.float32))


def _torch_linspace(start: float, end: float, n: int) -> np.ndarray:
    """torch.linspace(start, end, n) in fp32, bit for bit: a fp32 step, the first half counted up from
    start and the rest down from end, each value one fused multiply-add (np.linspace differs by an ulp)."""
    f32 = np.float32
    s, e = np.float64(f32(start)), np.float64(f32(end))
    step = np.float64((f32(end) - f32(start)) / f32(n - 1))
    i = np.arange(n)
    return np.where(i < n // 2, s + step * i, e - step * (n - 1 - i)).astype(f32)


def _nearest(scaled: jax.Array, code: jax.Array) -> jax.Array:
    """Index of the code value nearest each of `scaled` (a value on a midpoint takes the lower one)."""
    bounds = (code[:-1] + code[1:]) / 2
    return jnp.searchsorted(bounds, scaled, side="left").astype(jnp.uint8)


def _blockwise(x: jax.Array, code: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """x [n] -> (code indices uint8 [n], absmax fp32 [ceil(n / block)]): a last, shorter block is allowed."""
    n = x.shape[0]
    padded = jnp.pad(x.astype(jnp.float32), (0, -n % block)).reshape(-1, block)
    absmax = jnp.max(jnp.abs(padded), axis=1)
    # bitsandbytes multiplies by the reciprocal (and guards an all-zero block the same way)
    scaled = jnp.clip(padded * (1.0 / jnp.maximum(absmax, 1e-38))[:, None], -1, 1)
    return _nearest(scaled.reshape(-1)[:n], jnp.asarray(code)), absmax


def _unblock(idx: jax.Array, absmax: jax.Array, code: jax.Array, block: int) -> jax.Array:
    n = idx.shape[0]
    values = jnp.pad(jnp.asarray(code)[idx], (0, -n % block)).reshape(-1, block)
    return (values * absmax[:, None]).reshape(-1)[:n]


def pack(codes: jax.Array) -> jax.Array:
    """4-bit codes [..., 2k] -> bytes [..., k]: pairs along the last axis, the first in the high nibble."""
    pairs = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], -1, 2)
    return (pairs[..., 0] << 4) | pairs[..., 1]


def unpack(packed: jax.Array) -> jax.Array:
    """`pack`'s inverse: bytes [..., k] -> codes [..., 2k]."""
    both = jnp.stack([packed >> 4, packed & 0xF], axis=-1)
    return both.reshape(*packed.shape[:-1], -1)


def quantize_flat(x: jax.Array, block: int = 64) -> tuple[jax.Array, jax.Array]:
    """x [n] (n even) -> (packed uint8 [n / 2], absmax fp32 [ceil(n / block)]), as bitsandbytes' quantize_4bit."""
    idx, absmax = _blockwise(x, NF4_CODE, block)
    return pack(idx), absmax


def dequantize_flat(packed: jax.Array, absmax: jax.Array, block: int = 64) -> jax.Array:
    """`quantize_flat`'s inverse up to rounding: fp32 [2 * packed.size], as bitsandbytes' dequantize_4bit."""
    return _unblock(unpack(packed), absmax, NF4_CODE, block)


def double_quantize(absmax: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """fp32 absmax [m] -> (uint8 [m], fp32 absmax of those [ceil(m / 256)], fp32 offset []): their mean
    subtracted, then 8-bit blockwise with the dynamic map (bitsandbytes' compress_statistics)."""
    offset = jnp.mean(absmax)
    q, absmax2 = _blockwise(absmax - offset, dynamic_code(), STATS_BLOCK)
    return q, absmax2, offset


def double_dequantize(q: jax.Array, absmax2: jax.Array, offset: jax.Array) -> jax.Array:
    """`double_quantize`'s inverse up to rounding: the fp32 absmax [m]."""
    return _unblock(q, absmax2, dynamic_code(), STATS_BLOCK) + offset


# ----------------------------------------------------------------------------- weights


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class NF4Matrix:
    """A weight [*lead, *in, *out] as NF4 codes and blockwise scales (see the module doc)."""

    codes: jax.Array
    """uint8, the weight's shape with its last input axis halved: two codes a byte along that axis."""
    absmax: jax.Array
    """The weight's shape with the input axes cut into blocks (`block_dims`): fp32, or, double-quantized,
    uint8 codes of the dynamic map (then `absmax2` and `offset` decode them, per lead index)."""
    absmax2: jax.Array | None = None
    """Double quantization: fp32 [*lead, ceil(blocks / 256)], blocks taken in bitsandbytes' order (output
    channel major, as on the torch weight [out, in])."""
    offset: jax.Array | None = None
    """Double quantization: fp32 [*lead], the mean absmax that was subtracted."""
    out_ndim: int = field(default=1, metadata=dict(static=True))
    """How many trailing axes are output axes."""
    block: int = field(default=64, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape."""
        s = list(self.codes.shape)
        s[-self.out_ndim - 1] *= 2
        return tuple(s)

    @property
    def ndim(self) -> int:
        return self.codes.ndim

    def __rmatmul__(self, x: jax.Array) -> jax.Array:
        return matmul(x, self)


def is_nf4(w) -> bool:
    return isinstance(w, NF4Matrix)


def block_dims(in_dims: Sequence[int], block: int) -> tuple[int, ...]:
    """The input dims of the absmax array: row-major over them, the i-th entry is the scale of flattened
    inputs i*block .. (i+1)*block - 1. A block may span whole trailing dims (wo's heads x head_dim with
    head_dim < block). Raises ValueError when blocks do not tile the input dims this way."""
    dims, rest = list(in_dims), block
    for i in reversed(range(len(dims))):
        if rest == 1:
            break
        if dims[i] % rest == 0:
            dims[i], rest = dims[i] // rest, 1
        elif rest % dims[i] == 0:
            rest, dims[i] = rest // dims[i], 1
        else:
            break
    if rest != 1 or in_dims[-1] % 2:
        raise ValueError(f"blocks of {block} do not tile input dims {tuple(in_dims)} (an even last one)")
    return tuple(dims)


def _split(shape: Sequence[int], in_axes: Sequence[int]) -> tuple[tuple, tuple, tuple]:
    """(lead, in, out) dims of a weight whose contracted axes are the contiguous `in_axes`."""
    lo, hi = min(in_axes), max(in_axes) + 1
    if tuple(in_axes) != tuple(range(lo, hi)):
        raise ValueError(f"input axes {tuple(in_axes)} are not contiguous")
    return tuple(shape[:lo]), tuple(shape[lo:hi]), tuple(shape[hi:])


def layout(shape: Sequence[int], in_axes: Sequence[int], block: int, double_quant: bool) -> dict:
    """Shapes of an `NF4Matrix`'s arrays for a weight of `shape`: {field: shape or None}."""
    lead, ins, outs = _split(shape, in_axes)
    blocks = math.prod(block_dims(ins, block))
    return {
        "codes": (*lead, *ins[:-1], ins[-1] // 2, *outs),
        "absmax": (*lead, *block_dims(ins, block), *outs),
        "absmax2": (*lead, -(-blocks * math.prod(outs) // STATS_BLOCK)) if double_quant else None,
        "offset": lead if double_quant else None,
    }


def quantize(w: jax.Array, in_axes: Sequence[int], block: int = 64, double_quant: bool = False) -> NF4Matrix:
    """A weight [*lead, *in, *out] as NF4: per lead index, bitsandbytes' quantize_4bit of the torch weight
    W^T [out, in] (flattened row-major), laid out back in the weight's axes."""
    lead, ins, outs = _split(w.shape, in_axes)
    nl, ni, no = len(lead), len(ins), len(outs)
    bdims = block_dims(ins, block)

    def one(m):  # one lead index: [*in, *out] -> the codes, scales of m^T flattened
        flat = jnp.moveaxis(m, tuple(range(ni, ni + no)), tuple(range(no))).reshape(-1)
        packed, absmax = quantize_flat(flat, block)
        stats = double_quantize(absmax) if double_quant else (absmax, None, None)
        back = tuple(range(no))
        codes = jnp.moveaxis(packed.reshape(*outs, *ins[:-1], ins[-1] // 2), back, tuple(range(ni, ni + no)))
        scales = jnp.moveaxis(stats[0].reshape(*outs, *bdims), back, tuple(range(ni, ni + no)))
        return codes, scales, stats[1], stats[2]

    fn = one
    for _ in range(nl):
        fn = jax.vmap(fn)
    codes, absmax, absmax2, offset = fn(jnp.asarray(w, jnp.float32))
    return NF4Matrix(codes, absmax, absmax2, offset, out_ndim=no, block=block)


def decode_scales(w: NF4Matrix) -> NF4Matrix:
    """w with fp32 absmax (double-quantized scales decoded; others returned as they are)."""
    if w.offset is None:
        return w
    nl, no = w.offset.ndim, w.out_ndim
    ni = w.absmax.ndim - nl - no
    out_axes, front = tuple(range(nl + ni, nl + ni + no)), tuple(range(nl, nl + no))
    order = jnp.moveaxis(w.absmax, out_axes, front)  # bitsandbytes' order: output channel major

    def one(q, a2, off):
        return double_dequantize(q.reshape(-1), a2, off)

    fn = one
    for _ in range(nl):
        fn = jax.vmap(fn)
    flat = fn(order.reshape(*order.shape[:nl], -1), w.absmax2, w.offset)
    absmax = jnp.moveaxis(flat.reshape(order.shape), front, out_axes)
    return dataclasses.replace(w, absmax=absmax, absmax2=None, offset=None)


def dequantize(w: NF4Matrix, dtype=jnp.float32) -> jax.Array:
    """The weight, [*lead, *in, *out]: every axis before the output axes taken as one flattened input
    (blocks never cross a lead index, since each lead index's inputs are whole blocks)."""
    w = decode_scales(w)
    return _dequantize(w.codes, w.absmax, w.out_ndim, w.block, dtype).reshape(w.shape)


def _dequantize(codes, absmax, out_ndim: int, block: int, dtype) -> jax.Array:
    """fp32 absmax and codes -> the weight as [inputs, *out] in `dtype` (computed in fp32)."""
    outs = codes.shape[codes.ndim - out_ndim :]
    c = codes.reshape(-1, *outs)
    pairs = jnp.stack([c >> 4, c & 0xF], axis=1)  # byte p holds inputs 2p (high nibble) and 2p + 1
    values = jnp.asarray(NF4_CODE)[pairs.reshape(-1, block, *outs)]
    return (values * absmax.astype(jnp.float32).reshape(-1, 1, *outs)).reshape(-1, *outs).astype(dtype)


def apply(fn: Callable, *ws):
    """fn(*ws) on NF4 weights: on their codes and on their scales (double quantization decoded first).

    For layout changes of the output axes and merges of the input axes (see `quant.apply`). The new
    output rank is read off the result: codes and the weight differ exactly on the packed axis.
    """
    ws = [decode_scales(w) for w in ws]
    blocks = {w.block for w in ws}
    if len(blocks) != 1:
        raise ValueError(f"cannot combine NF4 weights of different block sizes {sorted(blocks)}")
    codes = fn(*(w.codes for w in ws))
    absmax = fn(*(w.absmax for w in ws))
    logical = jax.eval_shape(fn, *(jax.ShapeDtypeStruct(w.shape, jnp.float32) for w in ws)).shape
    differ = [i for i, (a, b) in enumerate(zip(codes.shape, logical)) if a != b]
    if len(differ) != 1 or logical[differ[0]] != 2 * codes.shape[differ[0]]:
        raise ValueError(f"{fn} is not a layout change NF4 weights can follow ({logical} vs {codes.shape})")
    return NF4Matrix(codes, absmax, out_ndim=codes.ndim - differ[0] - 1, block=blocks.pop())


def matmul(x: jax.Array, w: NF4Matrix) -> jax.Array:
    """x[..., in] @ w[in, out], the weight dequantized to x's dtype inside the dot (fp32 accumulation)."""
    if w.ndim != 2:
        raise ValueError(f"matmul takes a 2-D NF4 matrix, got shape {w.shape}")
    w = decode_scales(w)
    y = _dot(x.reshape(-1, x.shape[-1]), w.codes, w.absmax, w.block)
    return y.astype(x.dtype).reshape(*x.shape[:-1], w.shape[-1])


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dot(x, codes, absmax, block: int):
    """x [rows, in] @ the dequantized [in, out]: fp32 out."""
    w = _dequantize(codes, absmax, 1, block, x.dtype)
    return jax.lax.dot(x, w, preferred_element_type=jnp.float32)


def _dot_fwd(x, codes, absmax, block):
    # Residuals: the codes, not the dequantized weight; the backward pass dequantizes again. So no
    # backend can keep a stacked fp32 copy of the base for the layer scan's backward pass (XLA CPU's
    # plain autodiff measured no such copy either: a guarantee, not a saving there). The empty array
    # only carries x's dtype.
    return _dot(x, codes, absmax, block), (codes, absmax, jnp.zeros((0,), x.dtype))


def _dot_bwd(block, res, dy):
    codes, absmax, like = res
    w = _dequantize(codes, absmax, 1, block, like.dtype)
    dx = jax.lax.dot(dy.astype(like.dtype), w.T, preferred_element_type=jnp.float32).astype(like.dtype)
    # The base is frozen: no gradient for the codes (integers: float0) or the scales.
    return dx, np.zeros(codes.shape, jax.dtypes.float0), jnp.zeros_like(absmax)


_dot.defvjp(_dot_fwd, _dot_bwd)
