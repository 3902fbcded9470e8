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


class Generator:
    """Compiled prefill and decode steps for one model; reuse it across calls with the same shapes."""

    def __init__(self, params, cfg: ModelConfig):
        self.params, self.cfg = params, cfg
        self.prefill = jax.jit(partial(forward_cached, cfg=cfg))
        self.decode = jax.jit(partial(forward_cached, cfg=cfg), donate_argnums=(2,))
        self._sample = jax.jit(sample, static_argnames=("temperature", "top_k", "top_p"))

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
    ) -> list[list[int]]:
        """New tokens per prompt; a row ends at a stop id (kept) or when `stop(tokens)` says so."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        B, P = len(prompts), max(len(p) for p in prompts)
        tokens = np.zeros((B, P), np.int32)
        start = np.array([P - len(p) for p in prompts], np.int32)
        for b, p in enumerate(prompts):
            tokens[b, start[b] :] = p
        cache = init_cache(self.cfg, B, P + max_new_tokens, jnp.asarray(self.params.embed).dtype)
        start_j = jnp.asarray(start)
        logits, cache = self.prefill(self.params, jnp.asarray(tokens), cache, jnp.int32(0), start_j)
        key = jax.random.key(seed)
        out: list[list[int]] = [[] for _ in range(B)]
        done = np.zeros(B, bool)
        last = logits[:, -1]
        for i in range(max_new_tokens):
            key, sub = jax.random.split(key)
            nxt = np.asarray(self._sample(last, sub, temperature=temperature, top_k=top_k, top_p=top_p))
            for b in range(B):
                if done[b]:
                    continue
                out[b].append(int(nxt[b]))
                if on_token is not None:
                    on_token(b, int(nxt[b]))
                if int(nxt[b]) in stop_ids or (stop is not None and stop(out[b])):
                    done[b] = True
            if done.all() or i == max_new_tokens - 1:
                break
            logits, cache = self.decode(
                self.params, jnp.asarray(nxt[:, None], jnp.int32), cache, jnp.int32(P + i), start_j
            )
            last = logits[:, -1]
        return out
