"""Low-rank adapters (LoRA): specs, the adapter's contribution in the forward pass, merging.

A target projection W [in, out] gets A [in, r] and B [r, out]; the layer then
computes x W + (alpha / r) dropout(x) A B, with W frozen. B starts at zero, so
an untrained adapter leaves the model exactly as it was; A starts random
(normal, std 1/sqrt(in), the scale of PEFT's default uniform init). Adapters
are stacked on the `layers` axis like the block weights they adapt and carried
inside `BlockParams.lora`, so the layer scan slices them with everything else.
The adapter path is computed unmerged while training (the frozen W needs no
weight gradient and dropout stays possible); for export and generation the
product is folded into W once (`merge_into_base`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import jax
import jax.numpy as jnp

from shipyard.config import LoraConfig, ModelConfig
from shipyard.model.params import ArraySpec

ATTENTION_TARGETS = ("q", "k", "v", "o")
MLP_TARGETS = ("gate", "up", "down")
# Each target's own dropout stream (folded into the layer's key).
_TARGET_IDS = {t: i for i, t in enumerate(ATTENTION_TARGETS + MLP_TARGETS)}


def _target_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple, tuple, tuple, tuple]]:
    """Per target: (input dims, their logical axes, output dims, their logical axes)."""
    E, H, K, D, M = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    return {
        "q": ((E,), ("embed",), (H, D), ("heads", "head_dim")),
        "k": ((E,), ("embed",), (K, D), ("kv_heads", "head_dim")),
        "v": ((E,), ("embed",), (K, D), ("kv_heads", "head_dim")),
        "o": ((H, D), ("heads", "head_dim"), (E,), ("embed",)),
        "gate": ((E,), ("embed",), (M,), ("mlp",)),
        "up": ((E,), ("embed",), (M,), ("mlp",)),
        "down": ((M,), ("mlp",), (E,), ("embed",)),
    }


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LoraParams:
    """The adapters of one layer stack; the scale and dropout ride along as static fields."""

    a: dict[str, jax.Array]
    """target -> [layers, *in, rank]"""
    b: dict[str, jax.Array]
    """target -> [layers, rank, *out]"""
    scale: float = field(default=1.0, metadata=dict(static=True))
    """alpha / rank."""
    dropout: float = field(default=0.0, metadata=dict(static=True))
    """Dropout rate on the adapter input (training only: needs a key)."""


def stack_targets(lora: LoraConfig, moe_stack: bool) -> tuple[str, ...]:
    """The targets a stack has: MoE blocks have no dense MLP, so only attention targets."""
    return tuple(t for t in lora.targets if not (moe_stack and t in MLP_TARGETS))


def lora_specs(lora: LoraConfig, cfg: ModelConfig, n: int, moe_stack: bool) -> dict | None:
    """{"a": {...}, "b": {...}} specs for a stack of n layers (None when the stack has no targets)."""
    targets = stack_targets(lora, moe_stack)
    if n == 0 or not targets:
        return None
    shapes, r = _target_shapes(cfg), lora.rank
    a, b = {}, {}
    for t in targets:
        ins, in_axes, outs, out_axes = shapes[t]
        fan_in = math.prod(ins)
        a[t] = ArraySpec(
            (n, *ins, r),
            ("layers", *in_axes, "lora_rank"),
            "normal",
            std=1.0 / math.sqrt(fan_in),
            role="adapter",
            fan_in_axes=tuple(range(1, 1 + len(ins))),
        )
        b[t] = ArraySpec(
            (n, r, *outs), ("layers", "lora_rank", *out_axes), "zeros", role="adapter", fan_in_axes=(1,)
        )
    return {"a": a, "b": b}


def as_lora_params(tree: dict | None, lora: LoraConfig) -> LoraParams | None:
    """The trainable {"a", "b"} dicts of one stack as the LoraParams the forward pass reads."""
    if tree is None:
        return None
    return LoraParams(a=tree["a"], b=tree["b"], scale=lora.alpha / lora.rank, dropout=lora.dropout)


def delta(lora: LoraParams | None, target: str, x: jax.Array, key: jax.Array | None) -> jax.Array | None:
    """One layer's adapter output (alpha/r) dropout(x) A B for `target`: [..., out] flattened; None without one.

    x is [..., in] with the target's input dims flattened (heads x head_dim for o).
    """
    if lora is None or target not in lora.a:
        return None
    a, b = lora.a[target], lora.b[target]
    rank = a.shape[-1]
    if key is not None and lora.dropout > 0:
        keep = jax.random.bernoulli(jax.random.fold_in(key, _TARGET_IDS[target]), 1 - lora.dropout, x.shape)
        x = jnp.where(keep, x / (1 - lora.dropout), 0).astype(x.dtype)
    h = x.reshape(-1, x.shape[-1]) @ a.reshape(-1, rank).astype(x.dtype)
    out = (h @ b.reshape(rank, -1).astype(x.dtype)) * jnp.asarray(lora.scale, x.dtype)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def merged_weight(w: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """W + scale * A B for stacked weights [layers, *in, *out] (fp32)."""
    n = w.shape[0]
    ab = jnp.einsum("lir,lro->lio", a.reshape(n, -1, a.shape[-1]), b.reshape(n, b.shape[1], -1))
    return (w + scale * ab.reshape(w.shape)).astype(w.dtype)


_BLOCK_FIELDS = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up", "down": "w_down"}


def merge_into_base(params):
    """TransformerParams with every stack's adapters folded into its weights and `lora` removed."""

    def fold(blocks):
        if blocks is None or blocks.lora is None:
            return blocks
        lo = blocks.lora
        new = {
            _BLOCK_FIELDS[t]: merged_weight(getattr(blocks, _BLOCK_FIELDS[t]), lo.a[t], lo.b[t], lo.scale)
            for t in lo.a
        }
        return replace(blocks, lora=None, **new)

    return replace(params, blocks=fold(params.blocks), moe_blocks=fold(params.moe_blocks))
