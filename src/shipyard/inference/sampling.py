"""The sampling rules, written once: the token picker (`pick_tokens`, with the top-k / top-p filter and
the temperature floor) that the engine and the exported programs both run; the ranges a setting may
take (`check_temperature`, `check_top_k`, `check_top_p`); and the one precedence rule every entry
point resolves its settings by (`resolve_sampling`: what the caller gives, else the model's
generation_config.json, else the entry point's `Defaults`)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import jax

# jax is imported inside the two traced functions only: the CLI reads `Defaults` and the `check_*`
# ranges while building its parser, which `shipyard --help` should not make wait for JAX.

TEMPERATURE_MAX = 2.0
"""The highest temperature accepted (OpenAI's bound): beyond it samples are close to uniform noise."""

MIN_TEMPERATURE = 1e-6
"""Positive temperatures below this divide by it instead: logits / 1e-40 overflow float32 to inf (or
to nan, where a subnormal is flushed to zero), and categorical over several infs picks the first of
them, not the best. At this floor, sampling is greedy but for logits within ~1e-5 of the best."""


def check_temperature(value: float) -> float:
    """`value` if it is a temperature the samplers accept (0 = greedy, up to TEMPERATURE_MAX), else ValueError."""
    if not 0.0 <= value <= TEMPERATURE_MAX:  # (also refuses nan)
        raise ValueError(f"temperature must be between 0 (greedy) and {TEMPERATURE_MAX:g}, got {value:g}")
    return value


def check_top_k(value: int) -> int:
    """`value` if it is a top-k the samplers accept (0 or -1, vLLM's spelling, mean every token), else ValueError."""
    if value < -1:
        raise ValueError(f"top-k must be a number of tokens >= 1, or 0 (or -1) for all of them; got {value}")
    return value


def check_top_p(value: float) -> float:
    """`value` if it is a nucleus mass the samplers accept, in (0, 1] (1 = every token), else ValueError."""
    if not 0.0 < value <= 1.0:
        raise ValueError(f"top-p must be a probability mass in (0, 1] (1 keeps every token), got {value:g}")
    return value


def filter_logits(logits: jax.Array, top_k, top_p) -> jax.Array:
    """logits [batch, vocab] with the tokens outside the top-k and the top-p nucleus set to -inf.

    `top_k` and `top_p` are numbers or arrays, one value for the batch or [batch] (a value per row);
    top_k 0 (or below) keeps every token, and so does a top_p of 1 or more. Top-p keeps the smallest
    prefix of the ranked tokens whose mass reaches it, computed after top-k (always at least the best
    token). One descending sort serves both (masking below the k-th value keeps that order).
    """
    import jax
    import jax.numpy as jnp

    batch, vocab = logits.shape
    top_k = jnp.reshape(jnp.asarray(top_k), (-1, 1))
    top_p = jnp.reshape(jnp.asarray(top_p), (-1, 1))
    order = jnp.argsort(-logits, axis=-1)
    ranked = jnp.take_along_axis(logits, order, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(ranked, jnp.broadcast_to(k - 1, (batch, 1)), axis=-1)
    logits = jnp.where(logits < kth, -jnp.inf, logits)
    ranked = jnp.where(ranked < kth, -jnp.inf, ranked)
    probs = jax.nn.softmax(ranked, axis=-1)
    # top_p >= 1 keeps all: the float32 cumulative sum can reach 1.0 before the tail, which would
    # drop a row's last few tokens; the best token (rank 0) stays whatever top_p is.
    before = jnp.cumsum(probs, axis=-1) - probs
    drop_ranked = (before >= top_p) & (top_p < 1.0) & (jnp.arange(vocab) > 0)
    drop = jnp.zeros_like(drop_ranked).at[jnp.arange(batch)[:, None], order].set(drop_ranked)
    return jnp.where(drop, -jnp.inf, logits)


def _per_row(batch: int, temperature, top_k, top_p) -> tuple:
    """The settings as [batch] arrays (each given as a number for all rows or one per row)."""
    import jax.numpy as jnp

    return tuple(
        jnp.broadcast_to(jnp.asarray(x, dtype), (batch,))
        for x, dtype in ((temperature, jnp.float32), (top_k, jnp.int32), (top_p, jnp.float32))
    )


def sampling_logits(logits: jax.Array, temperature, top_k, top_p) -> jax.Array:
    """The logits of the distribution a sampled row draws from: logits [batch, vocab] divided by the
    row's temperature (floored at MIN_TEMPERATURE), the tokens outside its top-k / top-p at -inf.
    Greedy rows (temperature 0) keep the model's own logits. `pick_tokens` samples from these, and
    RL's trainer takes its log-probs from them (rl/step.py), so both sides apply one transform."""
    import jax
    import jax.numpy as jnp

    temperature, top_k, top_p = _per_row(logits.shape[0], temperature, top_k, top_p)
    scaled = logits / jnp.maximum(temperature, MIN_TEMPERATURE)[:, None]
    needs_filter = jnp.any((top_k > 0) | (top_p < 1.0))
    scaled = jax.lax.cond(needs_filter, lambda x: filter_logits(x, top_k, top_p), lambda x: x, scaled)
    return jnp.where((temperature > 0)[:, None], scaled, logits)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How one request picks its tokens (every entry point builds one with `resolve_sampling`)."""

    max_tokens: int
    """New tokens to generate at most (the prompt plus these must fit the engine's `max_len`)."""
    temperature: float = 0.0
    """0 is greedy (argmax); otherwise logits are divided by it before sampling."""
    top_k: int = 0
    """Sample among the k most likely tokens; 0 means all."""
    top_p: float = 1.0
    """Sample among the smallest set of most likely tokens whose probability reaches p."""
    seed: int = 0
    """PRNG seed of this request alone: the same seed gives the same reply, whatever else runs."""
    stop_ids: tuple[int, ...] = ()
    """Token ids that end the reply (kept in the output; the caller decides whether to show them)."""
    logprobs: bool = False
    """Report each token's log-probability and the best alternatives (otherwise they are None: a decode
    call computes them only when some request in it asks)."""


@dataclasses.dataclass(frozen=True)
class Defaults:
    """An entry point's sampling settings for what neither its caller nor the model's
    generation_config.json sets."""

    temperature: float
    """0 is greedy."""
    top_k: int
    """0 keeps every token."""
    top_p: float
    """1 keeps every token."""
    max_tokens: int
    """New tokens per reply."""


GENERATE = Defaults(temperature=0.0, top_k=0, top_p=1.0, max_tokens=64)
"""`shipyard generate`, the pipeline's sample step and lm-eval's generate_until: greedy, so a script,
a pipeline output or a benchmark score is the same text on every run."""
CHAT = Defaults(temperature=0.7, top_k=50, top_p=0.95, max_tokens=256)
"""`shipyard chat`: a person talking to the model expects varied replies, not the greedy loops a small
model falls into."""
API = Defaults(temperature=1.0, top_k=0, top_p=1.0, max_tokens=16)
"""`shipyard serve`: OpenAI's documented defaults, which its clients are written against."""


def resolve_sampling(
    defaults: Defaults,
    model=None,
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    stop_ids=(),
    logprobs: bool = False,
) -> Sampling:
    """The one precedence rule: each setting the caller gives (a flag, a request field; None when
    unset), else the model's generation_config.json value (`model`: an `interop.hf_config.
    GenerationDefaults`, or None), else the entry point's `defaults`.

    top_k -1 (vLLM's spelling) and 0 both mean every token (and one above the vocabulary is all of
    it: `filter_logits`). The caller checks its own values' ranges (`check_*`). The model's `max_length` is not used: it counts prompt and reply together, and many
    Hugging Face models carry transformers' placeholder of 20 there.
    """

    def pick(given, field: str):
        if given is not None:
            return given
        value = getattr(model, field, None)
        return value if value is not None else getattr(defaults, field)

    return Sampling(
        max_tokens=int(max_tokens if max_tokens is not None else defaults.max_tokens),
        temperature=float(pick(temperature, "temperature")),
        top_k=max(int(pick(top_k, "top_k")), 0),
        top_p=float(pick(top_p, "top_p")),
        seed=int(seed),
        stop_ids=tuple(stop_ids),
        logprobs=logprobs,
    )


def pick_tokens(
    logits: jax.Array, keys: jax.Array, temperature, top_k, top_p, *, may_sample: bool = True
) -> tuple[jax.Array, jax.Array]:
    """The token picker of every sampler: one token per row of logits [batch, vocab] with per-row
    settings ([batch] arrays, or scalars for the whole batch) and per-row PRNG keys [batch].

    Returns (tokens [batch] int32, the keys for the next step). Greedy rows (temperature 0) take the
    argmax and leave their key alone, so a greedy row consumes no randomness; a sampled row splits
    its key, divides by the temperature (floored at MIN_TEMPERATURE) and draws from the top-k /
    top-p filtered distribution. The filter sorts the vocabulary, so it runs only when some row asks.
    `may_sample` False (static: the caller knows every row is greedy) leaves the sampling branch out
    of the program altogether.
    """
    import jax
    import jax.numpy as jnp

    temperature, top_k, top_p = _per_row(logits.shape[0], temperature, top_k, top_p)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not may_sample:
        return greedy, keys

    def sampled(_):
        scaled = sampling_logits(logits, temperature, top_k, top_p)
        split = jax.vmap(jax.random.split)(keys)
        picks = jax.vmap(jax.random.categorical)(split[:, 1], scaled).astype(jnp.int32)
        hot = temperature > 0
        return jnp.where(hot, picks, greedy), jnp.where(hot, split[:, 0], keys)

    return jax.lax.cond(jnp.any(temperature > 0), sampled, lambda _: (greedy, keys), None)
