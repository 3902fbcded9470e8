"""fp8 training matmuls (`train.precision.matmul: fp8`): per-tensor current scaling, e4m3 forward and
e5m2 gradients, as torchtitan's Float8 "tensorwise" recipe.

Each matmul scales its input and its weight by max(fp8) / amax (the tensor's own absolute maximum,
this step: "current" scaling, no history), casts them to float8_e4m3fn and multiplies them with fp32
accumulation; the backward casts the output gradient to float8_e5m2 (wider range, fewer mantissa
bits: gradients span more decades than activations) and reuses the saved fp8 operands for both
gradient matmuls. On an H100/H200 XLA:GPU runs these as cuBLASLt fp8 GEMMs at twice the bf16 peak
(`shipyard plan --target h100xN` shows them in the HLO); on the CPU they are exact emulations, which
is how the numerics are tested (tests/test_fp8.py, against float64). TPU v4-v6e have no fp8 matmul
units: the config is refused there in one line.

Which matmuls: the attention projections and the dense MLP's, the bulk of the FLOPs; the output
head, the router and the MoE experts stay in the compute dtype (the head's logits are the most
precision-sensitive matmul, and the experts run through the grouped matmul, not `layers.dense`).
The params stay fp32; the train step wraps their compute-dtype copies in `FP8Weight` (`wrap`), which
`layers.dense` dispatches on and `quant.apply`'s layout changes (fused q|k|v) carry through.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
E4M3_MAX = float(jnp.finfo(E4M3).max)  # 448
E5M2_MAX = float(jnp.finfo(E5M2).max)  # 57344
WRAPPED = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
"""The block weights whose matmuls run in fp8."""


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class FP8Weight:
    """A weight (compute dtype) whose matmuls run in fp8; a marker, the cast happens per matmul."""

    w: jax.Array

    @property
    def shape(self):
        return self.w.shape

    @property
    def dtype(self):
        return self.w.dtype


def params_per_token(cfg) -> int:
    """Weights one token is multiplied with in fp8 (`WRAPPED`): every layer's attention projections and
    the dense layers' MLP (of a `config.ModelConfig`; the planner's share of FLOPs at the fp8 peak)."""
    attn = cfg.hidden_size * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    return cfg.num_layers * attn + cfg.num_dense_layers * 3 * cfg.hidden_size * cfg.intermediate_size


def is_fp8(w) -> bool:
    return isinstance(w, FP8Weight)


def wrap(params):
    """The params tree with each block stack's matmul weights (`WRAPPED`) marked for fp8."""
    stacks = {}
    for name in ("blocks", "moe_blocks"):
        blocks = getattr(params, name, None)
        if blocks is None:
            continue
        new = {k: FP8Weight(getattr(blocks, k)) for k in WRAPPED if getattr(blocks, k, None) is not None}
        stacks[name] = dataclasses.replace(blocks, **new)
    return dataclasses.replace(params, **stacks)


def apply(fn, *ws):
    """fn on the wrapped weights (a layout change: reshape, concatenation), wrapped again."""
    return FP8Weight(fn(*(w.w for w in ws)))


def quantize(x: jax.Array, dtype, largest: float) -> tuple[jax.Array, jax.Array]:
    """(x scaled by largest / amax(x) and cast to `dtype`, that scale as fp32): per-tensor current
    scaling. An all-zero tensor keeps scale 1 rather than dividing by zero."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    scale = jnp.where(amax > 0, largest / amax, 1.0)
    return (x.astype(jnp.float32) * scale).clip(-largest, largest).astype(dtype), scale


def _dot(a, b, contract: tuple[tuple[int, ...], tuple[int, ...]]) -> jax.Array:
    return jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


@jax.custom_vjp
def matmul(x: jax.Array, w: FP8Weight) -> jax.Array:
    """x[..., in] @ w[in, out] with both operands in e4m3, fp32 accumulation, the result in x's dtype."""
    return _forward(x, w)[0]


def _forward(x, w):
    xq, sx = quantize(x, E4M3, E4M3_MAX)
    wq, sw = quantize(w.w, E4M3, E4M3_MAX)
    y = _dot(xq, wq, ((x.ndim - 1,), (0,))) / (sx * sw)
    return y.astype(x.dtype), (xq, sx, wq, sw, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.w.dtype))


def _backward(res, dy):
    xq, sx, wq, sw, x_dtype, w_dtype = res
    gq, sg = quantize(dy, E5M2, E5M2_MAX)
    lead = tuple(range(dy.ndim - 1))
    dx = _dot(gq, wq, ((dy.ndim - 1,), (1,))) / (sg * sw)
    dw = _dot(xq, gq, (lead, lead)) / (sx * sg)
    return dx.astype(x_dtype.dtype), FP8Weight(dw.astype(w_dtype.dtype))


matmul.defvjp(_forward, _backward)
