"""Text generation: batched prompts, KV cache, greedy or sampled (temperature, top-k, top-p), stops.

One jitted prefill for the padded prompt batch, then one jitted decode step per
token with fixed shapes (the cache is preallocated), so nothing recompiles per
token. Sampling is seeded: the same seed gives the same text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from shipyard.config import ModelConfig
from shipyard.model.decode import forward_cached, init_cache


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


def _decode(params, tokens, cache, pos, start, key, *, cfg, temperature, top_k, top_p):
    """Feed one token per row at cache slot `pos` and sample the next: (tokens [batch], cache, key)."""
    logits, cache = forward_cached(params, tokens[:, None], cache, pos, start, cfg)
    key, sub = jax.random.split(key)
    return sample(logits[:, -1], sub, temperature, top_k, top_p).astype(jnp.int32), cache, key


_SAMPLING = ("temperature", "top_k", "top_p")


def _decode_compiler_options() -> dict[str, str] | None:
    """XLA options for the decode step: on CPU, no YNNPACK fusions.

    cpu_tuning turns YNNPACK dot and elementwise fusions on, which pays off
    for large matrices (training, and the prefill here). A decode step
    multiplies a few rows by each weight matrix, and there the YNNPACK calls
    cost more than they save: measured on 2 cores with the `small` model
    (bench/generate_throughput.py), a decode step takes ~14 ms with them and
    ~11 ms with XLA's own kernels.
    """
    return {"xla_cpu_experimental_ynn_fusion_type": ""} if jax.default_backend() == "cpu" else None


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
        self.decode = jit(partial(_decode, cfg=cfg), compiler_options=_decode_compiler_options())

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
                    self.params, nxt, cache, np.int32(P + i), start_j, key, **sampling
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
