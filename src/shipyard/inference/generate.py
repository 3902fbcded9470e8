"""Text generation: batched prompts, KV cache, greedy or sampled (temperature, top-k, top-p), stops.

One jitted prefill for the padded prompt batch (it computes logits for the
last position only), then jitted decode calls with fixed shapes (the cache is
preallocated), so nothing recompiles per token. A decode call runs up to
`tokens_per_call` steps in a loop on the device, sampling included; the host
reads one call's tokens while the next call runs. Sampling is seeded: the same
seed gives the same text, whatever `tokens_per_call`.

On CPU, dense models decode with `inference.cpu_decode.decode_step`, a step
specialised for one token per row (weights fused and unrolled once per
Generator, per-layer caches laid out for plain batched matmuls); it computes
what `inference.decode.forward_cached` computes, with the same attention
functions (`model.attention`). Models it does not implement (MoE, LoRA
adapters, options added later) decode with `forward_cached`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from shipyard.config import ModelConfig
from shipyard.inference import cpu_decode
from shipyard.inference.decode import forward_cached, init_cache
from shipyard.inference.sampling import MIN_TEMPERATURE, filter_logits
from shipyard.model import quant


def sample(
    logits: jax.Array, key: jax.Array, temperature: float, top_k: int | None, top_p: float | None
) -> jax.Array:
    """Next token ids [batch] from last-position logits [batch, vocab]; temperature 0 is greedy."""
    if temperature <= 0:
        return jnp.argmax(logits, axis=-1)
    logits = logits / max(temperature, MIN_TEMPERATURE)
    if top_k is not None or top_p is not None:  # (the filter sorts the vocabulary: only when asked)
        logits = filter_logits(logits, top_k or 0, 2.0 if top_p is None else top_p)
    return jax.random.categorical(key, logits, axis=-1)


def _prefill(
    params, tokens, start, key, *, cfg, max_len, kv_dtype, to_decode_cache, temperature, top_k, top_p
):
    """Run the prompts into a new cache of `max_len` slots (`kv_dtype`) and sample the first new token.

    Returns (tokens [batch], the cache converted by `to_decode_cache` for the decode step, key).
    """
    cache = init_cache(cfg, tokens.shape[0], max_len, kv_dtype)
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


def decode_compiler_options(params=None) -> dict[str, str] | None:
    """XLA options for the decode step: on CPU, no YNNPACK fusions (but its dots for int8 `params`).

    cpu_tuning turns YNNPACK dot and elementwise fusions on, which pays off
    for large matrices (training, and the prefill here). A decode step
    multiplies a few rows by each weight matrix, and there the YNNPACK calls
    cost more than they save (forward_cached's decode step for the `small`
    model on 2 cores: about 12-14 ms with them, 8-11 ms without). int8
    weights (`model.quant`) are the exception: XLA's own int8 dot is a slow
    generic loop, YNNPACK's reads the int8 weights at close to memory speed.
    """
    if jax.default_backend() != "cpu":
        return None
    return {"xla_cpu_experimental_ynn_fusion_type": QUANTIZED_DECODE_YNN if is_quantized_tree(params) else ""}


QUANTIZED_DECODE_YNN = "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"
"""YNNPACK fusions of the int8 decode step (see `decode_compiler_options`)."""


def is_quantized_tree(params) -> bool:
    """Whether any weight in `params` is an int8 `quant.QuantizedMatrix`."""
    leaves = jax.tree.leaves(params, is_leaf=quant.is_quantized)
    return any(quant.is_quantized(leaf) for leaf in leaves)


def default_kv_dtype(params):
    """The KV cache dtype when none is asked for: the embedding's, fp32 for a quantized one."""
    embed = params.embed
    return jnp.float32 if quant.is_quantized(embed) else jnp.asarray(embed).dtype


class Generator:
    """Compiled prefill and decode steps for one model; reuse it across calls with the same shapes.

    Sampling happens on the device and each token feeds the next step there.
    Decode steps run `tokens_per_call` at a time (one jitted loop); the host
    reads a call's tokens (for stops and callbacks) while the next call is
    already running, so Python never stalls decoding. `on_token` therefore
    sees tokens in bursts of up to `tokens_per_call`, and a batch whose rows
    have all stopped has computed up to that many tokens more than it needed.
    """

    def __init__(self, params, cfg: ModelConfig, *, tokens_per_call: int = 8, kv_dtype=None):
        """`params` plain or from `model.quantize.quantize_params` (int8 weights); `kv_dtype` the KV
        cache's dtype (default: the embedding's, fp32 for a quantized embedding)."""
        if tokens_per_call < 1:
            raise ValueError(f"tokens_per_call must be at least 1, got {tokens_per_call}")
        self.params, self.cfg, self.tokens_per_call = params, cfg, tokens_per_call
        if quant.is_quantized(params.embed):
            # forward_cached and decode_step look tokens up with jnp.take, which needs an array
            raise ValueError(
                "Generator: an int8 embedding (quantize_params(..., embed=True)) is for the full forward "
                "only; quantize with embed=False (the default) to generate"
            )
        self.kv_dtype = jnp.dtype(kv_dtype or default_kv_dtype(params))
        if cpu_decode.supported(params, cfg):
            self._decode_params = jax.jit(partial(cpu_decode.prepare_weights, cfg=cfg))(params)
            forward, to_decode_cache = partial(cpu_decode.decode_step, cfg=cfg), cpu_decode.to_layer_caches
        else:
            self._decode_params = params
            forward, to_decode_cache = partial(forward_cached, cfg=cfg), lambda cache: cache
        self.prefill = jax.jit(
            partial(_prefill, cfg=cfg, kv_dtype=self.kv_dtype, to_decode_cache=to_decode_cache),
            static_argnames=(*_SAMPLING, "max_len"),
        )
        self.decode = jax.jit(
            partial(_decode_steps, forward=forward, chunk=tokens_per_call),
            donate_argnums=(2,),  # the cache: updated in place
            static_argnames=_SAMPLING,
            compiler_options=decode_compiler_options(params),
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
