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
from shipyard.model import layers
from shipyard.model.transformer import TransformerParams, layer_windows, mlp_block, output_weights


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
) -> tuple[jax.Array, KVCache]:
    """Logits [batch, T, vocab] (fp32) for `tokens` [batch, T] written at cache slots pos..pos+T-1.

    With `last_only`, logits [batch, 1, vocab] for the last position only: all
    a prefill needs, and the output projection of every prompt position is a
    large part of a prefill's work for a big vocabulary.
    """
    K, G, D = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    B, T = tokens.shape
    max_len = cache.k.shape[2]
    slots = pos + jnp.arange(T)  # cache slot of each new token
    positions = slots[None, :] - start[:, None]  # RoPE position: counted from the row's first real token
    cos, sin = layers.rope_cos_sin(positions, layers.rope_inv_freq(D, cfg.rope_theta, cfg.rope_scaling))
    keys = jnp.arange(max_len)
    # query at slot s sees keys at slots start[b] .. s
    visible = (keys[None, None, :] <= slots[None, :, None]) & (keys[None, None, :] >= start[:, None, None])
    x = jnp.take(params.embed, tokens, axis=0)

    def body(x, layer):
        p, k_cache, v_cache, window = layer
        h = layers.rms_norm(x, p.attn_norm, cfg.norm_eps)
        q = jnp.einsum("bte,ekgd->btkgd", h, p.wq.reshape(p.wq.shape[0], K, G, D))
        k = jnp.einsum("bte,ekd->btkd", h, p.wk)
        v = jnp.einsum("bte,ekd->btkd", h, p.wv)
        if p.bq is not None:
            q, k, v = q + p.bq.reshape(K, G, D), k + p.bk, v + p.bv
        if p.q_norm is not None:
            q = layers.rms_norm(q, p.q_norm, cfg.norm_eps)
            k = layers.rms_norm(k, p.k_norm, cfg.norm_eps)
        q = layers.apply_rope(q, cos, sin)
        k = layers.apply_rope(k, cos, sin)
        k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, pos, 0, 0))
        v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, pos, 0, 0))
        scores = jnp.einsum("btkgd,bskd->bkgts", q, k_cache, preferred_element_type=jnp.float32) / jnp.sqrt(D)
        seen = visible
        if window is not None:  # sliding window: keys within the last `window` slots
            seen = seen & (slots[None, :, None] - keys[None, None, :] < window)
        scores = jnp.where(seen[:, None, None], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype)
        attn = jnp.einsum("bkgts,bskd->btkgd", probs, v_cache).reshape(B, T, K * G * D)
        x = x + attn @ p.wo.reshape(-1, p.wo.shape[-1])
        return mlp_block(cfg, x, p)[0], (k_cache, v_cache)

    # The cache spans all layers; each stack (dense, then MoE) scans its slice.
    ks, vs, first = [], [], 0
    for (blocks, _), windows in zip(params.stacks(), layer_windows(cfg)):
        n = jax.tree.leaves(blocks)[0].shape[0]
        layer = (blocks, cache.k[first : first + n], cache.v[first : first + n], windows)
        x, (k, v) = jax.lax.scan(body, x, layer)
        ks.append(k)
        vs.append(v)
        first += n
    h = layers.rms_norm(x[:, -1:] if last_only else x, params.final_norm, cfg.norm_eps)
    if len(ks) > 1:  # (a dense model keeps its one cache array: no per-token copy)
        ks, vs = [jnp.concatenate(ks)], [jnp.concatenate(vs)]
    return (h @ output_weights(params)).astype(jnp.float32), KVCache(ks[0], vs[0])
