"""Text generation: batched prompts, KV cache, greedy or sampled (temperature, top-k, top-p), stops.

One jitted prefill for the padded prompt batch, then one jitted decode step per
token with fixed shapes (the cache is preallocated), so nothing recompiles per
token. Sampling is seeded: the same seed gives the same text.

On CPU, dense models decode with a step specialised for one token per row
(`_cpu_decode_forward`): a decode step is a handful of [batch, in] x [in, out]
products with tiny batch, bound by reading the weights, and XLA runs each such
product on one thread. The specialised step reads weights prepared once per
Generator, fused (q|k|v) and cut into column blocks, so independent products
run on all cores; layers are unrolled (no per-step slicing of stacked weights)
and the cache is updated in place. It computes what `model.decode.forward_cached`
computes (tested step against step); models using anything it does not
implement (MoE, q/k/v biases, sliding windows, options added later) decode
with `forward_cached`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from shipyard.config import ModelConfig
from shipyard.model import layers
from shipyard.model.decode import KVCache, forward_cached, init_cache
from shipyard.model.transformer import output_weights


def sample(
    logits: jax.Array, key: jax.Array, temperature: float, top_k: int | None, top_p: float | None
) -> jax.Array:
    """Next token ids [batch] from last-position logits [batch, vocab]; temperature 0 is greedy."""
    if temperature <= 0:
        return jnp.argmax(logits, axis=-1)
    logits = logits / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the best token)
        drop_sorted = (cum - jax.nn.softmax(sorted_logits, axis=-1)) >= top_p
        drop = jnp.zeros_like(drop_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(drop_sorted)
        logits = jnp.where(drop, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1)


def _prefill(params, tokens, cache, start, key, *, cfg, temperature, top_k, top_p):
    """Run the prompts into the cache and sample the first new token: (tokens [batch], cache, key)."""
    logits, cache = forward_cached(params, tokens, cache, jnp.int32(0), start, cfg)
    key, sub = jax.random.split(key)
    return sample(logits[:, -1], sub, temperature, top_k, top_p).astype(jnp.int32), cache, key


def _decode(params, tokens, cache, pos, start, key, *, forward, temperature, top_k, top_p):
    """Feed one token per row at cache slot `pos` and sample the next: (tokens [batch], cache, key)."""
    logits, cache = forward(params, tokens[:, None], cache, pos, start)
    key, sub = jax.random.split(key)
    return sample(logits[:, -1], sub, temperature, top_k, top_p).astype(jnp.int32), cache, key


_SAMPLING = ("temperature", "top_k", "top_p")


def _decode_compiler_options() -> dict[str, str] | None:
    """XLA options for the decode step: on CPU, no YNNPACK fusions.

    cpu_tuning turns YNNPACK dot and elementwise fusions on, which pays off
    for large matrices (training, and the prefill here). A decode step
    multiplies a few rows by each weight matrix, and there the YNNPACK calls
    cost more than they save (forward_cached's decode step for the `small`
    model on 2 cores: about 12-14 ms with them, 8-11 ms without).
    """
    return {"xla_cpu_experimental_ynn_fusion_type": ""} if jax.default_backend() == "cpu" else None


# ModelConfig fields `_cpu_decode_forward` implements or that do not change the forward pass; a field
# added later disables it (at a non-default value) until it is taught here.
_CPU_DECODE_FIELDS = frozenset(
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
        "tie_embeddings",
        "init_std",
        "remat",
        "scan_unroll",
    ]
)
_CPU_DECODE_BLOCK_PARAMS = frozenset(
    ["attn_norm", "wq", "wk", "wv", "wo", "q_norm", "k_norm", "mlp_norm", "w_gate", "w_up", "w_down"]
)


def _cpu_decode_supported(params, cfg: ModelConfig) -> bool:
    if jax.default_backend() != "cpu" or getattr(params, "moe_blocks", None) is not None:
        return False
    for name, field in type(cfg).model_fields.items():
        if name not in _CPU_DECODE_FIELDS and getattr(cfg, name) != field.default:
            return False
    blocks = params.blocks
    if blocks is None or not dataclasses.is_dataclass(blocks):
        return False
    return all(
        f.name in _CPU_DECODE_BLOCK_PARAMS or getattr(blocks, f.name) is None
        for f in dataclasses.fields(blocks)
    )


def _column_blocks(w: jax.Array, n: int) -> tuple[jax.Array, ...]:
    """[in, out] -> n matrices [in, ~out/n]: products XLA can run concurrently."""
    cuts = [w.shape[1] * i // n for i in range(n + 1)]
    return tuple(w[:, a:b] for a, b in zip(cuts, cuts[1:]) if b > a)


def _cpu_decode_weights(params, cfg: ModelConfig, n: int) -> dict:
    """Per-layer weights for `_cpu_decode_forward`: q|k|v fused, every matrix cut into n column blocks."""
    b, E = params.blocks, cfg.hidden_size
    out = []
    for i in range(cfg.num_layers):
        qkv = jnp.concatenate([b.wq[i].reshape(E, -1), b.wk[i].reshape(E, -1), b.wv[i].reshape(E, -1)], 1)
        out.append(
            {
                "attn_norm": b.attn_norm[i],
                "qkv": _column_blocks(qkv, n),
                "q_norm": None if b.q_norm is None else b.q_norm[i],
                "k_norm": None if b.k_norm is None else b.k_norm[i],
                "wo": _column_blocks(b.wo[i].reshape(-1, E), n),
                "mlp_norm": b.mlp_norm[i],
                "gate": _column_blocks(b.w_gate[i], n),
                "up": _column_blocks(b.w_up[i], n),
                "down": _column_blocks(b.w_down[i], n),
            }
        )
    return {
        "embed": params.embed,
        "layers": out,
        "final_norm": params.final_norm,
        "head": _column_blocks(output_weights(params), n),
    }


def _matmul(x: jax.Array, blocks: tuple[jax.Array, ...]) -> jax.Array:
    return jnp.concatenate([x @ w for w in blocks], axis=-1)


def _cpu_decode_forward(weights, tokens, cache: KVCache, pos, start, *, cfg: ModelConfig):
    """forward_cached for one token per row ([batch, 1]) of a dense model, on `_cpu_decode_weights`."""
    K, H, D = cfg.num_kv_heads, cfg.num_heads, cfg.head_dim
    G, B = H // K, tokens.shape[0]
    positions = (pos - start)[:, None]  # RoPE position: counted from the row's first real token
    cos, sin = layers.rope_cos_sin(positions, layers.rope_inv_freq(D, cfg.rope_theta, cfg.rope_scaling))
    keys = jnp.arange(cache.k.shape[2])
    visible = ((keys[None, :] <= pos) & (keys[None, :] >= start[:, None]))[:, None, None, None]
    x = jnp.take(weights["embed"], tokens, axis=0)  # [B, 1, E]
    ks, vs = cache.k, cache.v
    for i, p in enumerate(weights["layers"]):
        qkv = _matmul(layers.rms_norm(x, p["attn_norm"], cfg.norm_eps), p["qkv"])
        q = qkv[..., : H * D].reshape(B, 1, K, G, D)
        k = qkv[..., H * D : (H + K) * D].reshape(B, 1, K, D)
        v = qkv[..., (H + K) * D :].reshape(B, 1, K, D)
        if p["q_norm"] is not None:
            q = layers.rms_norm(q, p["q_norm"], cfg.norm_eps)
            k = layers.rms_norm(k, p["k_norm"], cfg.norm_eps)
        q, k = layers.apply_rope(q, cos, sin), layers.apply_rope(k, cos, sin)
        ks = jax.lax.dynamic_update_slice(ks, k[None].astype(ks.dtype), (i, 0, pos, 0, 0))
        vs = jax.lax.dynamic_update_slice(vs, v[None].astype(vs.dtype), (i, 0, pos, 0, 0))
        scores = jnp.einsum("btkgd,bskd->bkgts", q, ks[i], preferred_element_type=jnp.float32)
        scores = jnp.where(visible, scores / math.sqrt(D), jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(vs.dtype)
        attn = jnp.einsum("bkgts,bskd->btkgd", probs, vs[i]).reshape(B, 1, H * D)
        x = x + _matmul(attn, p["wo"])
        h = layers.rms_norm(x, p["mlp_norm"], cfg.norm_eps)
        x = x + _matmul(jax.nn.silu(_matmul(h, p["gate"])) * _matmul(h, p["up"]), p["down"])
    h = layers.rms_norm(x, weights["final_norm"], cfg.norm_eps)
    return _matmul(h, weights["head"]).astype(jnp.float32), KVCache(ks, vs)


class Generator:
    """Compiled prefill and decode steps for one model; reuse it across calls with the same shapes.

    Each step samples on the device and its token feeds the next step there:
    the host reads a step's tokens (for stops and callbacks) while the next
    step is already running, so Python never stalls the decode loop.
    """

    def __init__(self, params, cfg: ModelConfig):
        self.params, self.cfg = params, cfg
        jit = partial(jax.jit, donate_argnums=(2,), static_argnames=_SAMPLING)
        self.prefill = jit(partial(_prefill, cfg=cfg))
        if _cpu_decode_supported(params, cfg):
            blocks = min(os.cpu_count() or 1, 4)
            self._decode_params = jax.jit(partial(_cpu_decode_weights, cfg=cfg, n=blocks))(params)
            forward = partial(_cpu_decode_forward, cfg=cfg)
        else:
            self._decode_params = params
            forward = partial(forward_cached, cfg=cfg)
        self.decode = jit(partial(_decode, forward=forward), compiler_options=_decode_compiler_options())

    def __call__(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        stop_ids: Sequence[int] = (),
        stop: Callable[[list[int]], bool] | None = None,
        on_token: Callable[[int, int], None] | None = None,
        pad_multiple: int = 1,
    ) -> list[list[int]]:
        """New tokens per prompt; a row ends at a stop id (kept) or when `stop(tokens)` says so.

        `pad_multiple` rounds the padded prompt length up (more left padding,
        which is masked): calls with prompts of similar lengths then share
        one compiled prefill and decode step.
        """
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if max_new_tokens < 1:
            return [[] for _ in prompts]
        B = len(prompts)
        P = -(-max(len(p) for p in prompts) // pad_multiple) * pad_multiple
        tokens = np.zeros((B, P), np.int32)
        start = np.array([P - len(p) for p in prompts], np.int32)
        for b, p in enumerate(prompts):
            tokens[b, start[b] :] = p
        sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
        cache = init_cache(self.cfg, B, P + max_new_tokens, jnp.asarray(self.params.embed).dtype)
        start_j = jnp.asarray(start)
        nxt, cache, key = self.prefill(
            self.params, jnp.asarray(tokens), cache, start_j, jax.random.key(seed), **sampling
        )
        out: list[list[int]] = [[] for _ in range(B)]
        done = np.zeros(B, bool)
        stop_set = set(stop_ids)
        for i in range(max_new_tokens):
            following = None
            if i < max_new_tokens - 1:  # queued before this step's tokens reach the host
                following, cache, key = self.decode(
                    self._decode_params, nxt, cache, np.int32(P + i), start_j, key, **sampling
                )
            for b, t in enumerate(np.asarray(nxt).tolist()):
                if done[b]:
                    continue
                out[b].append(t)
                if on_token is not None:
                    on_token(b, t)
                if t in stop_set or (stop is not None and stop(out[b])):
                    done[b] = True
            if done.all() or following is None:
                break
            nxt = following
        return out
