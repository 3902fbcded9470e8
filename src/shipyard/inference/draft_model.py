"""Speculative decoding with a draft model: a small model with the served model's tokenizer guesses
each reply's next k tokens, and the engine checks them in one forward of the served model
(`engine._verify_drafts`: the same check and rejection rule as prompt lookup's drafts,
inference/speculation.py).

The draft keeps a KV cache of its own, laid out as the engine's: row b, slot s holds the draft's
keys and values of the token the engine's row b holds at slot s (prompts left-padded alike, RoPE
counted from the same first slot), with `fill` slots of headroom past the engine's `max_len` so
that a row's writes past its end never clamp back onto its real slots. `pos[b]` (host) is
how far row b's draft cache is right.

Each speculative call (`Drafter.drafts`):
1. catch up: a row whose draft cache lags more than `catch_up` tokens behind (a new prompt, a stretch
   of plain decode calls) is fed its missing tokens `fill` at a time;
2. propose: one forward over each row's missing tokens (at most `catch_up`: the row's last token and
   what the previous check kept), whose last position gives draft 1, then k-1 steps of one token.
The drafts are the draft model's greedy choices: a draft distribution with all its mass on one
token, which is the case the engine's rejection rule handles (`speculation.accept_sampled`), so a
sampled reply keeps plain sampling's distribution and a greedy one its text. After the check,
`advance` moves pos[b] over the drafts the served model kept (their keys and values are right).

A row given fewer new tokens than a call's width writes padding past its end: slots no query
looks at (a query at slot s sees slots start..s) and that later writes replace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from shipyard.config import ModelConfig
from shipyard.inference.decode import init_cache
from shipyard.inference.decode_path import decode_path, in_corner
from shipyard.inference.speculation import NO_DRAFT

FILL = 64
"""Tokens per row a catch-up call feeds (a new prompt of L tokens takes about L / FILL calls)."""

CATCH_UP = 16
"""New tokens per row the proposing forward takes (at least k + 2: the last token, the drafts the
previous check kept and its own token; more lets a few plain decode calls pass without a catch-up
call)."""


class Drafter:
    """A draft model's weights, its KV cache and how far each row of it is right."""

    def __init__(
        self,
        params,
        cfg: ModelConfig,
        *,
        max_batch: int,
        max_len: int,
        k: int,
        vocab: int,
        kv_dtype=None,
        program: Callable,
        compiler_options: dict | None = None,
    ):
        """`k` drafts a call for `max_batch` rows of `max_len` slots (the engine's); `vocab`: the served
        model's vocabulary size (drafts are picked among its ids); `program(key, jitted, example,
        **static)`: the engine's compiled program (or None while it compiles; `Engine._program`)."""
        if k < 1:
            raise ValueError(f"a draft model needs at least 1 draft token a call, got {k}")
        self.cfg, self.k, self.vocab = cfg, k, min(vocab, cfg.vocab_size)
        self.catch_up = max(CATCH_UP, k + 2)
        self.fill = max(FILL, self.catch_up)
        params = jax.tree.map(jnp.asarray, params)
        path = decode_path(params, cfg)
        self.weights = path.prepare(params)
        kv_dtype = kv_dtype or jnp.asarray(params.embed).dtype
        slots = max_len + self.fill
        self._caches = jax.jit(lambda: path.to_decode(init_cache(cfg, max_batch, slots, kv_dtype)))()
        self.max_batch = max_batch
        self.pos = [0] * max_batch
        """Row b's draft cache holds the right keys and values for its slots below pos[b]."""
        self._owner: list[object | None] = [None] * max_batch  # the request each row's cache was built for
        self._program = program
        jit = partial(jax.jit, donate_argnums=(1,), compiler_options=compiler_options)
        self._fill = jit(
            partial(_fill, forward=path.forward, axes=path.axes), static_argnames=("n_rows", "span")
        )
        self._propose = jit(
            partial(_propose, forward=path.forward, axes=path.axes, vocab=self.vocab, k=k),
            static_argnames=("n_rows", "span"),
        )

    def cache_bytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self._caches))

    def drafts(self, rows: Sequence[tuple[int, object, Sequence[int], int]], start, n_rows: int, span: int):
        """Drafts [max_batch, k] (int32, host; `speculation.NO_DRAFT` in rows not given) for `rows`, each (row b, its request, its context: prompt
        and tokens so far, the slot of its last token), in an engine call over `n_rows` rows and `span`
        slots; `start` [max_batch] (device): each row's first real slot. None while a program compiles
        (the call decodes plainly; nothing changed)."""
        span_d = span + self.fill
        fill = self._program(
            ("draft-fill", n_rows, span_d),
            self._fill,
            lambda: self._example(self.fill),
            n_rows=n_rows,
            span=span_d,
        )
        propose = self._program(
            ("draft", n_rows, span_d),
            self._propose,
            lambda: self._example(self.catch_up, propose=True),
            n_rows=n_rows,
            span=span_d,
        )
        if fill is None or propose is None:
            return None
        missing = {}  # row -> its tokens at slots pos[b]..last (the last included)
        for b, request, context, last in rows:
            first = last - (len(context) - 1)  # the row's first real slot
            if self._owner[b] is not request:  # a new request in this row: nothing of it cached yet
                self._owner[b], self.pos[b] = request, first
            missing[b] = list(context[self.pos[b] - first :])
        while any(len(m) > self.catch_up for m in missing.values()):
            tokens = np.zeros((self.max_batch, self.fill), np.int32)
            at = np.asarray(self.pos, np.int32)
            for b, m in missing.items():
                if len(m) > self.catch_up:
                    n = min(self.fill, len(m) - 1)  # the last token stays for the proposing forward
                    tokens[b, :n] = m[:n]
                    missing[b], self.pos[b] = m[n:], self.pos[b] + n
            self._caches = fill(self.weights, self._caches, tokens, at, start, np.int32(1))
        tokens = np.zeros((self.max_batch, self.catch_up), np.int32)
        count = np.ones(self.max_batch, np.int32)
        at = np.asarray(self.pos, np.int32)
        for b, m in missing.items():
            tokens[b, : len(m)], count[b] = m, len(m)
        drafts, self._caches = propose(
            self.weights, self._caches, tokens, count, at, start, np.int32(1), np.int32(self.k - 1)
        )
        drafts, out = np.asarray(drafts), np.full((self.max_batch, self.k), NO_DRAFT, np.int32)
        for b, _, _, last in rows:
            self.pos[b] = last + 1  # the last token's keys and values are in
            out[b] = drafts[b]  # (rows not asked about: no guess)
        return out

    def advance(self, b: int, kept: int) -> None:
        """Row b's check kept `kept` tokens (its drafts up to the first rejected, and one more): the
        drafts it kept were fed to the draft model, at the slots they now hold (all but the last)."""
        self.pos[b] += min(kept - 1, self.k - 1)

    def _example(self, width: int, propose: bool = False) -> list:
        B = self.max_batch
        tokens, at, start = np.zeros((B, width), np.int32), np.zeros(B, np.int32), np.zeros(B, np.int32)
        if propose:
            return [
                self.weights,
                self._caches,
                tokens,
                np.ones(B, np.int32),
                at,
                start,
                np.int32(1),
                np.int32(1),
            ]
        return [self.weights, self._caches, tokens, at, start, np.int32(1)]


def _fill(weights, caches, tokens, at, start, one, *, forward, axes, n_rows: int, span: int):
    """Write the draft's keys and values of `tokens` [max_batch, T] at slots at[b].. of each row."""

    def run(rows, caches):
        tokens, at, start = rows

        def once(_, caches):
            return forward(weights, tokens, caches, at, start)[1]

        # `one` (traced, always 1): as a loop XLA on CPU updates the cache in place (see engine._verify_drafts)
        return None, rows, jax.lax.fori_loop(0, one, once, caches)

    return in_corner(run, (tokens, at, start), caches, n_rows, span, axes)[2]


def _propose(
    weights, caches, tokens, count, at, start, one, steps, *, forward, axes, vocab: int, k: int, n_rows, span
):
    """Feed each row its `count[b]` new tokens (tokens [max_batch, T], written from slot at[b]), take
    its greedy choice after the last as draft 1, then draft 2..k one step each (`steps` = k - 1,
    traced: a loop XLA on CPU runs in place): (drafts [max_batch, k], caches)."""

    def run(rows, caches):
        tokens, count, at, start = rows
        B = tokens.shape[0]
        logits = jnp.zeros((B, tokens.shape[1], vocab), jnp.float32)

        def once(_, carry):
            logits, caches = forward(weights, tokens, carry[1], at, start)
            return logits[..., :vocab], caches

        # `one` (traced, always 1): as a loop XLA on CPU updates the cache in place (see engine._verify_drafts)
        logits, caches = jax.lax.fori_loop(0, one, once, (logits, caches))
        first = jnp.take_along_axis(logits, (count - 1)[:, None, None], axis=1)[:, 0]
        last = at + count - 1  # the slot of each row's last token
        drafts = jnp.zeros((B, k), jnp.int32).at[:, 0].set(jnp.argmax(first, axis=-1).astype(jnp.int32))

        def step(i, carry):
            drafts, caches = carry
            logits, caches = forward(weights, drafts[:, i - 1][:, None], caches, last + i, start)
            return drafts.at[:, i].set(jnp.argmax(logits[:, 0, :vocab], axis=-1).astype(jnp.int32)), caches

        drafts, caches = jax.lax.fori_loop(1, steps + 1, step, (drafts, caches))
        return drafts, rows, caches

    drafts, _, caches = in_corner(run, (tokens, count, at, start), caches, n_rows, span, axes)
    return drafts, caches
