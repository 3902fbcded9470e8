"""Text generation: batched prompts, KV cache, greedy or sampled (temperature, top-k, top-p), stops.

One jitted prefill for the padded prompt batch (it computes logits for the
last position only), then jitted decode calls with fixed shapes (the cache is
preallocated), so nothing recompiles per token. A decode call runs up to
`tokens_per_call` steps in a loop on the device, sampling included; the host
reads one call's tokens while the next call runs. Sampling is seeded: the same
seed gives the same text, whatever `tokens_per_call`.

On CPU, dense models decode with a step specialised for one token per row
(`_cpu_decode_forward`): a decode step is a handful of [batch, in] x [in, out]
products with tiny batch, bound by reading the weights from memory. The
specialised step reads weights prepared once per Generator, q|k|v and gate|up
fused (four products per layer), with layers unrolled (no per-step slicing of
stacked weights), and keeps one cache per layer in layouts that make both
attention products plain batched matmuls, updated in place (the stacked
KVCache layout cost a transposed copy of each layer's cache every step). Cutting
weights into column blocks so products run on both cores, and XLA's XNNPACK
dots, measured no faster. It computes what `model.decode.forward_cached`
computes (tested step against step); models using anything it does not
implement (MoE, q/k/v biases, sliding windows, options added later) decode
with `forward_cached`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from shipyard.config import ModelConfig
from shipyard.inference.decode import KVCache, forward_cached, init_cache
from shipyard.model import layers
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


def _prefill(params, tokens, start, key, *, cfg, max_len, to_decode_cache, temperature, top_k, top_p):
    """Run the prompts into a new cache of `max_len` slots and sample the first new token.

    Returns (tokens [batch], the cache converted by `to_decode_cache` for the decode step, key).
    """
    cache = init_cache(cfg, tokens.shape[0], max_len, jnp.asarray(params.embed).dtype)
    logits, cache = forward_cached(params, tokens, cache, jnp.int32(0), start, cfg, last_only=True)
    token, key = _sample_next(logits[:, -1], key, temperature, top_k, top_p)
    return token, to_decode_cache(cache), key


def _sample_next(logits, key, temperature, top_k, top_p) -> tuple[jax.Array, jax.Array]:
    """(next tokens [batch] int32, key for the step after); greedy decoding leaves the key alone."""
    if temperature <= 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), key
    key, sub = jax.random.split(key)
    return sample(logits, sub, temperature, top_k, top_p).astype(jnp.int32), key


def _decode(params, tokens, cache, pos, start, key, *, forward, temperature, top_k, top_p):
    """Feed one token per row at cache slot `pos` and sample the next: (tokens [batch], cache, key)."""
    logits, cache = forward(params, tokens[:, None], cache, pos, start)
    token, key = _sample_next(logits[:, -1], key, temperature, top_k, top_p)
    return token, cache, key


def _decode_steps(
    params, tokens, cache, pos, start, key, steps, *, forward, chunk, temperature, top_k, top_p
):
    """`steps` (at most `chunk`) decode steps in one call, from cache slot `pos`.

    Returns (sampled tokens [chunk, batch], row i from step i and rows from
    `steps` on unused; the last sampled token [batch]; cache; key). One call
    per `chunk` tokens spares the host a dispatch per token (hundreds of
    microseconds for a jitted call with this many weight arguments, taken
    from the cores doing the work); `steps` is traced, so the last, shorter
    chunk of a call runs only what it needs without a second compilation.
    """

    def body(i, carry):
        out, tokens, cache, key = carry
        tokens, cache, key = _decode(
            params,
            tokens,
            cache,
            pos + i,
            start,
            key,
            forward=forward,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
        )
        return out.at[i].set(tokens), tokens, cache, key

    out = jnp.zeros((chunk, tokens.shape[0]), jnp.int32)
    out, tokens, cache, key = jax.lax.fori_loop(0, steps, body, (out, tokens, cache, key))
    return out, tokens, cache, key


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


class _LayerCache(NamedTuple):
    """One layer's decode cache, laid out so both attention products are plain batched matmuls."""

    k: jax.Array
    """[batch, kv_heads, head_dim, max_len]: keys transposed, so q @ k needs no copy of the cache."""
    v: jax.Array
    """[batch, kv_heads, max_len, head_dim]"""


def _to_layer_caches(cache: KVCache) -> tuple[_LayerCache, ...]:
    """KVCache [layers, batch, max_len, kv_heads, head_dim] -> per-layer `_LayerCache`s (once, after prefill).

    One array per layer keeps each in-place update small and lets XLA reuse
    each layer's buffer on its own; the layouts avoid the per-layer copies
    (transposes of the whole layer cache) that the KVCache layout costs in
    every decode step.
    """
    return tuple(
        _LayerCache(cache.k[i].transpose(0, 2, 3, 1), cache.v[i].transpose(0, 2, 1, 3))
        for i in range(cache.k.shape[0])
    )


def _from_layer_caches(caches: Sequence[_LayerCache]) -> KVCache:
    """The inverse of `_to_layer_caches` (for tests)."""
    k = jnp.stack([c.k.transpose(0, 3, 1, 2) for c in caches])
    v = jnp.stack([c.v.transpose(0, 2, 1, 3) for c in caches])
    return KVCache(k, v)


def _cpu_decode_weights(params, cfg: ModelConfig) -> dict:
    """Per-layer weights for `_cpu_decode_forward`: q|k|v and gate|up fused, so a layer is four matmuls."""
    b, E = params.blocks, cfg.hidden_size
    out = []
    for i in range(cfg.num_layers):
        qkv = jnp.concatenate([b.wq[i].reshape(E, -1), b.wk[i].reshape(E, -1), b.wv[i].reshape(E, -1)], 1)
        out.append(
            {
                "attn_norm": b.attn_norm[i],
                "qkv": qkv,
                "q_norm": None if b.q_norm is None else b.q_norm[i],
                "k_norm": None if b.k_norm is None else b.k_norm[i],
                "wo": b.wo[i].reshape(-1, E),
                "mlp_norm": b.mlp_norm[i],
                "gate_up": jnp.concatenate([b.w_gate[i], b.w_up[i]], 1),
                "down": b.w_down[i],
            }
        )
    return {
        "embed": params.embed,
        "layers": out,
        "final_norm": params.final_norm,
        "head": output_weights(params),
    }


def _cpu_decode_forward(weights, tokens, caches: tuple[_LayerCache, ...], pos, start, *, cfg: ModelConfig):
    """forward_cached for one token per row ([batch, 1]) of a dense model, on `_cpu_decode_weights`.

    Returns logits [batch, 1, vocab] and the updated per-layer caches.
    """
    K, H, D, F = cfg.num_kv_heads, cfg.num_heads, cfg.head_dim, cfg.intermediate_size
    G, B = H // K, tokens.shape[0]
    positions = (pos - start)[:, None]  # RoPE position: counted from the row's first real token
    cos, sin = layers.rope_cos_sin(positions, layers.rope_inv_freq(D, cfg.rope_theta, cfg.rope_scaling))
    keys = jnp.arange(caches[0].v.shape[2])
    visible = ((keys[None, :] <= pos) & (keys[None, :] >= start[:, None]))[:, None, None, :]  # [B, 1, 1, S]
    x = jnp.take(weights["embed"], tokens[:, 0], axis=0)  # [B, E]
    new_caches = []
    for p, c in zip(weights["layers"], caches):
        qkv = layers.rms_norm(x, p["attn_norm"], cfg.norm_eps) @ p["qkv"]
        q = qkv[:, : H * D].reshape(B, 1, K, G, D)
        k = qkv[:, H * D : (H + K) * D].reshape(B, 1, K, D)
        v = qkv[:, (H + K) * D :].reshape(B, K, 1, D)
        if p["q_norm"] is not None:
            q = layers.rms_norm(q, p["q_norm"], cfg.norm_eps)
            k = layers.rms_norm(k, p["k_norm"], cfg.norm_eps)
        q, k = (
            layers.apply_rope(q, cos, sin)[:, 0],
            layers.apply_rope(k, cos, sin)[:, 0],
        )  # [B,K,G,D], [B,K,D]
        c = _LayerCache(
            jax.lax.dynamic_update_slice(c.k, k[..., None].astype(c.k.dtype), (0, 0, 0, pos)),
            jax.lax.dynamic_update_slice(c.v, v.astype(c.v.dtype), (0, 0, pos, 0)),
        )
        new_caches.append(c)
        scores = jnp.matmul(q, c.k, preferred_element_type=jnp.float32)  # [B, K, G, S]
        scores = jnp.where(visible, scores / math.sqrt(D), jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(c.v.dtype)
        x = x + jnp.matmul(probs, c.v).reshape(B, H * D) @ p["wo"]
        gate_up = layers.rms_norm(x, p["mlp_norm"], cfg.norm_eps) @ p["gate_up"]
        x = x + (jax.nn.silu(gate_up[:, :F]) * gate_up[:, F:]) @ p["down"]
    h = layers.rms_norm(x, weights["final_norm"], cfg.norm_eps)
    return (h @ weights["head"]).astype(jnp.float32)[:, None], tuple(new_caches)


class Generator:
    """Compiled prefill and decode steps for one model; reuse it across calls with the same shapes.

    Sampling happens on the device and each token feeds the next step there.
    Decode steps run `tokens_per_call` at a time (one jitted loop); the host
    reads a call's tokens (for stops and callbacks) while the next call is
    already running, so Python never stalls decoding. `on_token` therefore
    sees tokens in bursts of up to `tokens_per_call`, and a batch whose rows
    have all stopped has computed up to that many tokens more than it needed.
    """

    def __init__(self, params, cfg: ModelConfig, *, tokens_per_call: int = 8):
        if tokens_per_call < 1:
            raise ValueError(f"tokens_per_call must be at least 1, got {tokens_per_call}")
        self.params, self.cfg, self.tokens_per_call = params, cfg, tokens_per_call
        if _cpu_decode_supported(params, cfg):
            self._decode_params = jax.jit(partial(_cpu_decode_weights, cfg=cfg))(params)
            forward, to_decode_cache = partial(_cpu_decode_forward, cfg=cfg), _to_layer_caches
        else:
            self._decode_params = params
            forward, to_decode_cache = partial(forward_cached, cfg=cfg), lambda cache: cache
        self.prefill = jax.jit(
            partial(_prefill, cfg=cfg, to_decode_cache=to_decode_cache),
            static_argnames=(*_SAMPLING, "max_len"),
        )
        self.decode = jax.jit(
            partial(_decode_steps, forward=forward, chunk=tokens_per_call),
            donate_argnums=(2,),  # the cache: updated in place
            static_argnames=_SAMPLING,
            compiler_options=_decode_compiler_options(),
        )

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
        start_j = jnp.asarray(start)
        last, cache, key = self.prefill(
            self.params,
            jnp.asarray(tokens),
            start_j,
            jax.random.key(seed),
            max_len=P + max_new_tokens,
            **sampling,
        )
        out: list[list[int]] = [[] for _ in range(B)]
        done = np.zeros(B, bool)
        stop_set = set(stop_ids)
        block, rows = last[None], 1  # sampled tokens [rows, batch] the host has not read yet
        pos = P  # cache slot of the next token fed to the model
        while True:
            following = None
            if pos < P + max_new_tokens - 1:  # queued before `block` reaches the host
                steps = min(self.tokens_per_call, P + max_new_tokens - 1 - pos)
                following, last, cache, key = self.decode(
                    self._decode_params, last, cache, np.int32(pos), start_j, key, np.int32(steps), **sampling
                )
                pos += steps
            for step_tokens in np.asarray(block)[:rows].tolist():
                for b, t in enumerate(step_tokens):
                    if done[b]:
                        continue
                    out[b].append(t)
                    if on_token is not None:
                        on_token(b, t)
                    if t in stop_set or (stop is not None and stop(out[b])):
                        done[b] = True
                if done.all():
                    return out
            if following is None:
                return out
            block, rows = following, steps
