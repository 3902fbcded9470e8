"""Speculative decoding: guess a reply's next tokens, check them all in one forward, keep what the
model agrees with. The guesses come from prompt lookup (here) or a draft model
(inference/draft_model.py); the check and the keep rules are the same for both.

Drafting (`lookup_draft`, on the host): the longest of the reply's last 3 or 2 tokens that
occurred earlier in the prompt or reply, and the `k` tokens that followed its latest occurrence
(one token alone matches too often to guess well).
Code, structured data, quotes and summaries repeat their context, and there the guess is often
right, with nothing to load or keep in step.

Verifying (`verify`, on the device): one forward over [last token, d1..dk] at the row's next k+1
slots gives the model's greedy choice after each; the drafts are kept up to the first one that
differs from the model's choice, and the model's choice there is kept too, so every call yields
1..k+1 tokens, each the token greedy decoding picks at its place. The K/V written for the drafts
past that point sit at slots beyond the row's position, where no query looks and the next call
writes over them. What is lossless for greedy rows is the text, while the log-probs come from a
forward over k+1 positions instead of one, so they round differently (within 1e-5;
tests/test_speculation.py). Sampled rows keep drafts by the rejection rule (`accept_sampled`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

NGRAM = 3
"""The longest tail of the context looked up (then shorter ones, down to `MIN_NGRAM`)."""

MIN_NGRAM = 2
"""The shortest tail looked up."""

PAUSE_BELOW = 0.5
"""Draft tokens kept per speculative call (a running mean) under which speculation does not pay: a
check of k+1 positions costs about one decode step, and plain calls run 8 steps a call beside the
host's reading."""

PAUSE_CALLS = 4
"""Plain decode calls (of up to 8 steps) an engine makes before it tries speculating again, when
the drafts kept fell under `PAUSE_BELOW` (doubled after each retry that keeps too few, up to
`MAX_PAUSE_CALLS`; back to this once a call keeps enough)."""

MAX_PAUSE_CALLS = 64
"""The longest pause: drafts that never fit cost one check per this many plain calls."""

NO_DRAFT = -1
"""A draft slot with no guess: it matches no token (the row then gets the model's one token)."""


def lookup_draft(context, k: int, ngram: int = NGRAM, min_ngram: int = MIN_NGRAM) -> np.ndarray:
    """Up to `k` tokens that followed the latest earlier occurrence of the context's last `ngram`
    (else fewer, down to `min_ngram`) tokens, padded with NO_DRAFT to `k`."""
    out = np.full(k, NO_DRAFT, np.int32)
    arr = np.asarray(context, np.int64)
    for n in range(min(ngram, len(arr) - 1), min_ngram - 1, -1):
        # windows starting at 0..len-1-n: each has a token after it, and none is the tail itself
        windows = sliding_window_view(arr[:-1], n)
        found = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if found.size:
            follow = arr[found[-1] + n : found[-1] + n + k]
            out[: len(follow)] = follow
            return out
    return out


def verify(logits: jax.Array, drafts: jax.Array):
    """The model's greedy choices [batch, k+1] at each of the k+1 positions, and how many to keep
    [batch] (1..k+1): the drafts that match the choices before them, plus the choice after."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    agree = (drafts == greedy[:, :-1]).astype(jnp.int32)
    kept = jnp.cumprod(agree, axis=1).sum(axis=1) + 1
    return greedy, kept


def accept_sampled(logits: jax.Array, drafts: jax.Array, keys: jax.Array, temperature, top_k, top_p):
    """The standard rejection rule for sampled rows, with prompt lookup's drafts as a draft
    distribution that puts all its mass on the guessed token: draft d_i is kept with probability
    p_i(d_i) under the row's own sampling distribution (temperature, top-k, top-p applied as
    `sampling.pick_tokens` applies them), and at the first one rejected the row draws from p_i with
    d_i taken out (the rule's max(0, p - q), renormalised); with every draft kept it draws from the
    distribution after the last. So each token kept has exactly the distribution plain sampling
    gives it (tests/test_speculation.py checks it statistically).

    logits [batch, k+1, vocab], drafts [batch, k], keys [batch] and settings [batch]: (tokens
    [batch, k+1], kept [batch], the next keys).
    """
    from shipyard.inference.sampling import MIN_TEMPERATURE, filter_logits

    batch, t, vocab = logits.shape
    k = t - 1
    scaled = logits / jnp.maximum(temperature, MIN_TEMPERATURE)[:, None, None]
    flat = filter_logits(scaled.reshape(batch * t, vocab), jnp.repeat(top_k, t), jnp.repeat(top_p, t))
    logp = jax.nn.log_softmax(flat.reshape(batch, t, vocab), axis=-1)
    split = jax.vmap(lambda key: jax.random.split(key, 3))(keys)
    u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(split[:, 1])
    guessed = drafts >= 0
    p_draft = jnp.exp(jnp.take_along_axis(logp[:, :k], jnp.maximum(drafts, 0)[..., None], axis=-1)[..., 0])
    agree = (u < p_draft) & guessed
    n = jnp.cumprod(agree.astype(jnp.int32), axis=1).sum(axis=1)  # drafts kept, 0..k
    at = jnp.take_along_axis(logp, n[:, None, None], axis=1)[:, 0]  # [batch, vocab]
    rejected = jnp.where(
        n < k,
        jnp.take_along_axis(jnp.pad(drafts, ((0, 0), (0, 1)), constant_values=-1), n[:, None], axis=1)[:, 0],
        -1,
    )
    residual = jnp.where(jnp.arange(vocab)[None] == rejected[:, None], -jnp.inf, at)
    extra = jax.vmap(jax.random.categorical)(split[:, 2], residual).astype(jnp.int32)
    tokens = jnp.concatenate([jnp.maximum(drafts, 0), jnp.zeros((batch, 1), jnp.int32)], axis=1)
    tokens = jnp.where(jnp.arange(t)[None] == n[:, None], extra[:, None], tokens)
    return tokens, n + 1, split[:, 0]
