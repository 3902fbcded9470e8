"""The CPU decode step: `decode.forward_cached` for one token per row of a dense model, laid out for speed.

On CPU a decode step is a handful of [batch, in] x [in, out] products with a
tiny batch, bound by reading the weights from memory. This step reads weights
prepared once per Engine (`prepare_weights`: q|k|v and gate|up fused, so a
layer is four matmuls), with layers unrolled (no per-step slicing of stacked
weights), and keeps one cache per layer in `attention.HEAD_MAJOR` layout, so
both attention products are plain batched matmuls over the cache, updated in
place (the stacked KVCache layout cost a transposed copy of each layer's
cache every step). Cutting weights into column blocks so products run on both
cores, and XLA's XNNPACK dots, measured no faster.

The math is `model.attention`'s (the same projection, RoPE, mask, core and
cache update as training and `forward_cached`, with the cache layout as an
argument); tests/test_attention.py and tests/test_generate_decode.py check it
against both. Models using anything it does not implement (MoE, LoRA
adapters, config fields added later) decode with `forward_cached`.

int8 weights (`model.quant.QuantizedMatrix`, from `quantize_params`) need
nothing of their own here: the fusions fuse their int8 values and scales
alike and every product goes through `layers.dense` or `@`, which take them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from shipyard.config import ModelConfig
from shipyard.inference.decode import KVCache
from shipyard.model import attention, layers
from shipyard.model.attention import HEAD_MAJOR, AttentionWeights, LayerKV
from shipyard.model.quant import QuantizedMatrix
from shipyard.model.transformer import output_weights
from shipyard.parallel import backend

# ModelConfig fields `decode_step` implements or that do not change the forward pass; a field added
# later disables it (at a non-default value) until it is taught here.
FIELDS = frozenset(
    [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "max_seq_len",
        "rope_theta",
        "rope_scaling",
        "norm_eps",
        "qk_norm",
        "sliding_window",
        "global_attention_every",
        "qkv_bias",
        "tie_embeddings",
        "init_std",
        "remat",
        "scan_unroll",
        "attention_impl",  # (training's core; the one decode follows, `ordered`, self_attention takes)
        "attention_block",
    ]
)
BLOCK_PARAMS = frozenset(
    [
        "attn_norm",
        "wq",
        "wk",
        "wv",
        "wo",
        "q_norm",
        "k_norm",
        "bq",
        "bk",
        "bv",
        "mlp_norm",
        "w_gate",
        "w_up",
        "w_down",
    ]
)


def supported(params, cfg: ModelConfig) -> bool:
    """Whether `decode_step` implements this model (and the backend is CPU)."""
    if not backend.on_cpu() or getattr(params, "moe_blocks", None) is not None:
        return False
    for name, field in type(cfg).model_fields.items():
        if name not in FIELDS and getattr(cfg, name) != field.default:
            return False
    blocks = params.blocks
    if blocks is None or not dataclasses.is_dataclass(blocks):
        return False
    return all(f.name in BLOCK_PARAMS or getattr(blocks, f.name) is None for f in dataclasses.fields(blocks))


def to_layer_caches(cache: KVCache) -> tuple[LayerKV, ...]:
    """KVCache [layers, batch, max_len, kv_heads, head_dim] -> per-layer HEAD_MAJOR caches (once, after prefill).

    One array per layer keeps each in-place update small and lets XLA reuse
    each layer's buffer on its own; the layout avoids the per-layer copies
    (transposes of the whole layer cache) that the KVCache layout costs in
    every decode step.
    """
    return tuple(
        LayerKV(cache.k[i].transpose(0, 2, 3, 1), cache.v[i].transpose(0, 2, 1, 3))
        for i in range(cache.k.shape[0])
    )


def from_layer_caches(caches: Sequence[LayerKV]) -> KVCache:
    """The inverse of `to_layer_caches` (for tests)."""
    k = jnp.stack([c.k.transpose(0, 3, 1, 2) for c in caches])
    v = jnp.stack([c.v.transpose(0, 2, 1, 3) for c in caches])
    return KVCache(k, v)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerWeights:
    """One layer's weights for `decode_step`."""

    attn_norm: jax.Array
    attn: AttentionWeights
    mlp_norm: jax.Array
    gate_up: jax.Array | QuantizedMatrix
    """[embed, 2 * mlp] (`layers.fuse_gate_up`; int8 values and scales fused alike when quantized)"""
    down: jax.Array | QuantizedMatrix
    window: int | None = dataclasses.field(metadata={"static": True})
    """This layer's attention window (static), None when global."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeWeights:
    embed: jax.Array
    layers: tuple[LayerWeights, ...]
    final_norm: jax.Array
    head: jax.Array | QuantizedMatrix
    """[embed, vocab]; `h @ head` multiplies by a QuantizedMatrix too (its `__rmatmul__`)."""


def prepare_weights(params, cfg: ModelConfig) -> DecodeWeights:
    """Per-layer weights for `decode_step`, fused and sliced out of the stacks once (jit it)."""
    b = params.blocks
    out = []
    for i, window in enumerate(attention.layer_window_sizes(cfg)):
        p = jax.tree.map(lambda a, i=i: a[i], b)
        out.append(
            LayerWeights(
                p.attn_norm,
                attention.attention_weights(p, cfg.num_kv_heads),
                p.mlp_norm,
                layers.fuse_gate_up(p.w_gate, p.w_up),
                p.w_down,
                window,
            )
        )
    return DecodeWeights(params.embed, tuple(out), params.final_norm, output_weights(params))


def decode_step(weights: DecodeWeights, tokens, caches: tuple[LayerKV, ...], pos, start, *, cfg: ModelConfig):
    """forward_cached for a few tokens per row (tokens [batch, T]: one in a decode step, a reply's
    last token and its drafts when speculating) on `prepare_weights` and per-layer caches.

    `pos` is a scalar or [batch] (each row at its own slot). Returns logits
    [batch, T, vocab] and the updated caches.
    """
    q_slots = jnp.asarray(pos)[..., None] + jnp.arange(tokens.shape[1])  # [T] or [batch, T]
    # RoPE positions counted from the row's first real token
    cos, sin = attention.rope_tables(cfg, (q_slots if q_slots.ndim == 2 else q_slots[None]) - start[:, None])
    keys = jnp.arange(caches[0].v.shape[2])
    x = jnp.take(weights.embed, tokens, axis=0)  # [batch, T, embed]
    new_caches = []
    for p, c in zip(weights.layers, caches):
        seen = attention.mask(q_slots, keys, p.window, first_key=start)
        h = layers.rms_norm(x, p.attn_norm, cfg.norm_eps)
        out, c = attention.self_attention(cfg, h, p.attn, cos, sin, seen, cache=c, pos=pos, layout=HEAD_MAJOR)
        new_caches.append(c)
        x = x + out
        x = x + layers.swiglu_fused(layers.rms_norm(x, p.mlp_norm, cfg.norm_eps), p.gate_up, p.down)
    h = layers.rms_norm(x, weights.final_norm, cfg.norm_eps)
    return (h @ weights.head).astype(jnp.float32), tuple(new_caches)
