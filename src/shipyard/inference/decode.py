"""Incremental decoding with a KV cache: prefill a (left-padded) batch of prompts, then one token at a time.

The cache holds every layer's keys and values, [layers, batch, max_len,
kv_heads, head_dim], preallocated, so the decode step has fixed shapes and is
compiled once. Prompts of different lengths are left-padded; `start[b]` is
row b's number of pad slots: those keys are masked out and RoPE positions
count from the first real token, so each row computes exactly what it would
alone (tested against the full forward and against transformers).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from shipyard.config import ModelConfig
from shipyard.model import attention, layers
from shipyard.model.attention import LayerKV, layer_windows
from shipyard.model.transformer import TransformerParams, mlp_block, output_weights


class KVCache(NamedTuple):
    k: jax.Array
    """[layers, batch, max_len, kv_heads, head_dim]"""
    v: jax.Array
    """Same shape as k."""


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def forward_cached(
    params: TransformerParams,
    tokens: jax.Array,
    cache: KVCache,
    pos: jax.Array,
    start: jax.Array,
    cfg: ModelConfig,
    last_only: bool = False,
    logits_at: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:
    """Logits [batch, T, vocab] (fp32) for `tokens` [batch, T] written at cache slots pos..pos+T-1.

    `pos` is a scalar, or [batch] when each row is at its own slot (a
    continuously batched cache, `inference.engine`).

    With `last_only`, logits [batch, 1, vocab] for the last position only: all
    a prefill needs, and the output projection of every prompt position is a
    large part of a prefill's work for a big vocabulary.
    """
    slots = jnp.asarray(pos)[..., None] + jnp.arange(
        tokens.shape[1]
    )  # cache slot of each new token: [T] or [B, T]
    # RoPE position: counted from the row's first real token
    cos, sin = attention.rope_tables(cfg, (slots if slots.ndim == 2 else slots[None]) - start[:, None])
    keys = jnp.arange(cache.k.shape[2])
    x = jnp.take(params.embed, tokens, axis=0)

    def body(x, layer):
        p, k_cache, v_cache, window = layer
        w = attention.attention_weights(
            p, cfg.num_kv_heads, fused=False
        )  # fusing would copy weights every step
        seen = attention.mask(slots, keys, window, first_key=start)  # slots start[b] .. s, within the window
        h = layers.rms_norm(x, p.attn_norm, cfg.norm_eps)
        out, kv = attention.self_attention(
            cfg, h, w, cos, sin, seen, cache=LayerKV(k_cache, v_cache), pos=pos
        )
        return mlp_block(cfg, x + out, p)[0], kv

    # The cache spans all layers; each stack (dense, then MoE) scans its slice.
    ks, vs, first = [], [], 0
    for (blocks, _), windows in zip(params.stacks(), layer_windows(cfg)):
        n = jax.tree.leaves(blocks)[0].shape[0]
        layer = (blocks, cache.k[first : first + n], cache.v[first : first + n], windows)
        x, (k, v) = jax.lax.scan(body, x, layer)
        ks.append(k)
        vs.append(v)
        first += n
    if logits_at is not None:
        x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)
    elif last_only:
        x = x[:, -1:]
    h = layers.rms_norm(x, params.final_norm, cfg.norm_eps)
    if len(ks) > 1:  # (a dense model keeps its one cache array: no per-token copy)
        ks, vs = [jnp.concatenate(ks)], [jnp.concatenate(vs)]
    return (h @ output_weights(params)).astype(jnp.float32), KVCache(ks[0], vs[0])
