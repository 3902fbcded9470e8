"""Continuous batching: one decode loop on the device serves every request; requests join and leave it.

The engine owns a KV cache preallocated for `max_batch` rows of `max_len`
slots. A new request is prefilled alone (its prompt left-padded to a length
bucket, so few prefill shapes compile) and its cache row is written into a
free slot of the batch cache; from the next decode call on, it decodes with
the others. Each row keeps its own cache position, RoPE offset, sampling
settings and PRNG key on the device, so a row computes what it would alone
(the same math; see below for the rounding), and a seeded sampled reply does
not depend on what else is running. A finished (or cancelled) request
frees its slot at once; its stale cache row is simply overwritten by the
next request admitted there.

A decode call covers the lowest rows up to the highest busy one and the
cache slots up to the furthest position a busy row reaches, rounded up to a
few compiled sizes (1, 4, 16.. rows; 64, 256, 1024.. slots), all compiled
before serving: a lone short request does not pay for a wide, long cache.
Different sizes are different programs, so float rounding may differ between
them; `fixed_shape` keeps one shape (all rows, all slots) for outputs that are
bitwise independent of the other requests.

A decode call runs `tokens_per_call` steps on the device; the host reads one
call's tokens while the next call is already running. A structured reply
(`Request.constraint`, inference/grammar.py) needs the token before to know
which tokens may come next, so while one runs each call is one step with the
rows' allowed-token masks as an input, read before the next call is queued.

Two optional shortcuts keep every reply what it would be without them (tests/test_prefix_cache.py,
tests/test_speculation.py): the prefix cache (`prefix_cache`, inference/prefix_cache.py) prefills
only the blocks of a prompt that earlier prompts did not share (bitwise what the whole prefill
computes: prompts are prefilled in `prefill_chunk`-token pieces on a fixed grid, so a cached block
is the computation skipped, not an approximation of it), and speculation (`speculate`,
inference/speculation.py) checks a few tokens guessed from a reply's own context in one forward;
its programs have shapes of their own, compiled on a thread the first time they could be used.

Threads: `Engine.start` runs the loop in a daemon thread that is the only
user of the device state. `submit` (any thread) queues a `Request`; its
`on_tokens` callback is called from the engine thread with each burst of new
tokens (an HTTP server hands them to its event loop from there).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from shipyard.config import ModelConfig
from shipyard.inference import speculation
from shipyard.inference.decode import KVCache, forward_cached, init_cache
from shipyard.inference.decode_path import decode_path, in_corner
from shipyard.inference.draft_model import Drafter
from shipyard.inference.prefix_cache import SLOTS as PREFIX_SLOTS
from shipyard.inference.prefix_cache import BlockIndex, init_store, keep, prefill_grid, recall
from shipyard.inference.sampling import Sampling, pick_tokens, sampling_logits
from shipyard.model import quant
from shipyard.parallel import backend

log = logging.getLogger(__name__)

TOP_LOGPROBS = 5
"""Alternatives reported per generated token (OpenAI's completions API allows up to 5)."""


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request and its progress. `on_tokens(tokens, logprobs, finish)` gets each burst
    of new tokens with their log-probabilities (each a (logprob, [(id, logprob)] top alternatives)) and,
    on the last call, why it finished ("stop" or "length"; "cancelled" when `cancel` ended it)."""

    prompt: list[int]
    sampling: Sampling
    on_tokens: Callable[[list[int], list, str | None], None]
    generated: int = 0
    finished: bool = False
    cancelled: bool = False
    weights: str | None = None
    """The fingerprint of the weights it runs on (`Engine.swap`), set when it is queued."""
    constraint: object | None = None
    """Structured output (`grammar.Constraint`): `mask()` gives the tokens allowed next (uint32 bit
    words), `advance(token)` is told each token picked. Such a request decodes one token per call."""
    context: list[int] = dataclasses.field(default_factory=list)
    """The prompt and the tokens delivered so far, where an engine that speculates drafts from."""

    def cancel(self) -> None:
        """Stop generating (a client went away, a stop string matched): the slot is freed at the next step."""
        self.cancelled = True


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
    if not backend.on_cpu():
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


@dataclasses.dataclass(frozen=True)
class Completion:
    """What `Engine.generate` returns for one prompt."""

    tokens: tuple[int, ...]
    """The new tokens (a stop id that ended the reply included)."""
    logprobs: tuple[float, ...] | None
    """log p of each new token under the model (before temperature and filters), when the request's
    Sampling asked for logprobs; else None."""
    finish: str
    """Why it ended: "stop" (a stop id or the caller's `stop`) or "length" (max_tokens)."""


@dataclasses.dataclass(eq=False)
class _Swap:
    """New weights waiting in the queue: applied once every request queued before them has ended."""

    params: object
    decode_weights: object
    fingerprint: str | None
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: BaseException | None = None


class Rows(NamedTuple):
    """Per-slot decode state on the device, [max_batch] each."""

    last: jax.Array
    """The last token of each row (the next one fed to the model)."""
    pos: jax.Array
    """Cache slot the next token is written to."""
    start: jax.Array
    """First real (non-padding) slot of each row; RoPE positions count from it."""
    key: jax.Array
    """Each row's PRNG key."""
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array


def token_logprobs(logits: jax.Array, tokens: jax.Array, top: int = TOP_LOGPROBS):
    """log p of the chosen tokens [batch] and the `top` best (logprobs, ids) [batch, top] under the
    model's own distribution (before temperature or filtering, as OpenAI reports them)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    best, ids = jax.lax.top_k(logp, top)
    return chosen, best, ids.astype(jnp.int32)


def restrict(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """`logits` [batch, vocab] with every token whose bit is clear in `allowed` [batch, words]
    (uint32, token t is bit t % 32 of word t // 32) set to -inf."""
    ids = jnp.arange(logits.shape[-1])
    bits = (allowed[:, ids // 32] >> (ids % 32).astype(jnp.uint32)) & 1
    return jnp.where(bits.astype(bool), logits, -jnp.inf)


def _restricted(logits, allowed, masked):
    """`restrict` when `masked` (traced), else the logits as they are (no mask arithmetic)."""
    return jax.lax.cond(masked, restrict, lambda x, _: x, logits, allowed)


def _reported_logprobs(logits, tokens, settings, of_sampling: bool):
    """`token_logprobs` of the model's own distribution, or with `of_sampling` (static) of the one the
    tokens were drawn from (`sampling.sampling_logits` under `settings`: temperature, top_k, top_p)."""
    if of_sampling:
        logits = sampling_logits(logits, *settings)
    return token_logprobs(logits, tokens)


def _no_logprobs(logits, tokens, top: int = TOP_LOGPROBS):
    B = tokens.shape[0]
    return jnp.zeros(B), jnp.zeros((B, top)), jnp.zeros((B, top), jnp.int32)


def _decode_steps(
    weights,
    rows: Rows,
    caches,
    want_logprobs,
    steps,
    allowed,
    masked,
    *,
    forward,
    chunk,
    n_rows: int,
    span: int,
    axes,
    plain=False,
    sampling_logprobs=False,
):
    """`steps` (traced, at most `chunk`) decode steps for the first `n_rows` rows over the first `span`
    cache slots: (tokens [chunk, n_rows], logprobs, rows, caches); entries past `steps` are zeros.

    The busy rows are the lowest slots and none reaches past `span` in this
    call, so the step runs on a copy of just that corner of the cache (rows and
    slots), written back in place afterwards: a decode step reads every cached
    key it covers, and with few short requests in a long, wide cache most of it
    would be idle rows and empty slots. `axes` gives each cache array's (row,
    slot) axes by its field name ("k" or "v"). `plain` (static): every row is
    greedy and none wants log-probs, so each step is the argmax alone (see
    `Engine._tick`). `allowed` [max_batch, words] restricts the first step's pick when `masked`
    (structured output; `restrict`); the log-probs stay the model's own.
    """

    def run(rows, caches):
        return _steps(
            weights,
            rows,
            caches,
            want_logprobs,
            steps,
            allowed[:n_rows],
            masked,
            forward=forward,
            chunk=chunk,
            span=span,
            plain=plain,
            sampling_logprobs=sampling_logprobs,
        )

    return in_corner(run, rows, caches, n_rows, span, axes)


def _verify_drafts(
    weights, rows: Rows, caches, drafts, want_logprobs, one, *, forward, n_rows: int, span: int, axes
):
    """One speculative call (inference/speculation.py) for the first `n_rows` rows over the first
    `span` cache slots: each row's last token and its drafts [max_batch, k] in one forward, then
    (tokens [n_rows, k+1], kept [n_rows], their logprobs, rows, caches): row b's reply goes on with
    tokens[b, :kept[b]] (greedy rows by `speculation.verify`, sampled ones by
    `speculation.accept_sampled`). The caller makes sure every row's pos + k + 1 fits in `span`."""

    def run(rows, caches):
        drafted = drafts[:n_rows]
        tokens = jnp.concatenate([rows.last[:, None], jnp.maximum(drafted, 0)], axis=1)
        logits = jnp.zeros((*tokens.shape, weights.embed.shape[0]), jnp.float32)

        def once(_, carry):
            return forward(weights, tokens, carry[1], rows.pos, rows.start)

        # `one` (traced, always 1) makes this a loop as the decode steps are: XLA on CPU then updates
        # the cache in place; as a plain call (or a loop of a known single trip) it copied the whole
        # cache every call (47 ms against 6 for the `small` bench model's cache of 16 x 1,024 slots)
        logits, caches = jax.lax.fori_loop(0, one, once, (logits, caches))
        greedy, kept = speculation.verify(logits, drafted)
        hot = rows.temperature > 0

        def sampled(_):  # the rejection rule for the sampled rows (greedy ones keep the greedy check)
            picked, n, keys = speculation.accept_sampled(
                logits, drafted, rows.key, rows.temperature, rows.top_k, rows.top_p
            )
            return (
                jnp.where(hot[:, None], picked, greedy),
                jnp.where(hot, n, kept),
                jnp.where(hot, keys, rows.key),
            )

        tokens, kept, key = jax.lax.cond(jnp.any(hot), sampled, lambda _: (greedy, kept, rows.key), None)
        flat = logits.reshape(-1, logits.shape[-1])
        chosen, best, ids = jax.lax.cond(
            want_logprobs, token_logprobs, _no_logprobs, flat, tokens.reshape(-1)
        )
        n, t = tokens.shape
        logprobs = (chosen.reshape(n, t), best.reshape(n, t, -1), ids.reshape(n, t, -1))
        last = jnp.take_along_axis(tokens, (kept - 1)[:, None], axis=1)[:, 0]
        rows = rows._replace(last=last, pos=jnp.minimum(rows.pos + kept, span), key=key)
        return (tokens, kept, *logprobs), rows, caches

    return in_corner(run, rows, caches, n_rows, span, axes)


def _steps(
    weights,
    rows: Rows,
    caches,
    want_logprobs,
    steps,
    allowed,
    masked,
    *,
    forward,
    chunk: int,
    span: int,
    plain: bool,
    sampling_logprobs: bool = False,
):
    B = rows.last.shape[0]
    settings = (rows.temperature, rows.top_k, rows.top_p)

    def body(i, carry):
        out, rows, caches = carry
        logits, caches = forward(weights, rows.last[:, None], caches, rows.pos, rows.start)
        logits = logits[:, -1]
        tokens, key = pick_tokens(
            _restricted(logits, allowed, masked & (i == 0)),
            rows.key,
            rows.temperature,
            rows.top_k,
            rows.top_p,
            may_sample=not plain,
        )
        if plain:  # no sampling and no log-prob branch in the program
            chosen, best, ids = _no_logprobs(logits, tokens)
        else:
            chosen, best, ids = jax.lax.cond(
                want_logprobs,
                partial(_reported_logprobs, settings=settings, of_sampling=sampling_logprobs),
                _no_logprobs,
                logits,
                tokens,
            )
        out = jax.tree.map(lambda o, x: o.at[i].set(x), out, (tokens, chosen, best, ids))
        # A busy row ends a call at most at `span` (the call's shape covers pos + steps), the slot the
        # next call, of a larger shape, writes first: clamping it to span - 1 made that call write
        # over the row's last token. A finished row (the host ignores it) stops at `span`, where its
        # writes land in the last slot (out-of-range update slices are clamped).
        rows = rows._replace(last=tokens, pos=jnp.minimum(rows.pos + 1, span), key=key)
        return out, rows, caches

    out = (
        jnp.zeros((chunk, B), jnp.int32),
        jnp.zeros((chunk, B), jnp.float32),
        jnp.zeros((chunk, B, TOP_LOGPROBS), jnp.float32),
        jnp.zeros((chunk, B, TOP_LOGPROBS), jnp.int32),
    )
    # a traced trip count: the last call of a reply runs only the steps it still needs, in the same program
    out, rows, caches = jax.lax.fori_loop(0, steps, body, (out, rows, caches))
    return out, rows, caches


def _prefill_pieces(
    params, tokens, start, store, hit_ids, hit_count, put, piece: int, S: int, cfg, kv_dtype, aligned=False
):
    """`_admit`'s prefill of prompts longer than a piece: left-aligned (tokens [m, P], zeros after), in
    pieces of `piece` tokens over an S-slot scratch cache, then moved to the decode row's layout
    (left-padded to P; `aligned`: kept left-aligned). With a store, pieces [0, hit_count) come from
    its blocks `hit_ids` and piece j is kept in block put[j]. Returns (the last prompt tokens' logits
    [m, vocab], cache, store)."""
    m, P = tokens.shape
    lengths = P - start
    tokens = jnp.pad(tokens, ((0, 0), (0, S - P)))
    scratch = init_cache(cfg, m, S, kv_dtype)
    first = jnp.int32(0)
    if store is not None:
        scratch = recall(store, scratch, hit_ids, hit_count)
        first = hit_count
    last = (lengths - 1) // piece  # the piece holding each prompt's last token
    zero = jnp.zeros(m, jnp.int32)

    def step(j, carry):
        scratch, logits = carry
        at = j * piece
        part = jax.lax.dynamic_slice_in_dim(tokens, at, piece, axis=1)
        end = jnp.clip(lengths - 1 - at, 0, piece - 1)
        out, scratch = forward_cached(params, part, scratch, at, zero, cfg, logits_at=end)
        return scratch, jnp.where((j == last)[:, None], out[:, 0], logits)

    logits = jnp.zeros((m, params.embed.shape[0]), jnp.float32)  # (the engine refuses an int8 embedding)
    scratch, logits = jax.lax.fori_loop(first, jnp.max(last) + 1, step, (scratch, logits))
    if store is not None:
        store = keep(store, scratch, put)
    if aligned:
        return logits, KVCache(scratch.k[:, :, :P], scratch.v[:, :, :P]), store
    idx = jnp.arange(P)[None, :] - start[:, None]  # prompt i at slots start[i]..P-1, zeros before

    def shift(buf):
        got = jnp.take_along_axis(buf, jnp.clip(idx, 0, S - 1)[None, :, :, None, None], axis=2)
        return jnp.where((idx >= 0)[None, :, :, None, None], got, 0)

    return logits, KVCache(shift(scratch.k), shift(scratch.v)), store


def _prefill(
    params, tokens, start, store, hit_ids, hit_count, put, *, cfg, kv_dtype, chunk: int, aligned: bool
):
    """`_admit`'s prefill of m prompts (tokens [m, P]): (the logits at each prompt's last token
    [m, vocab], their cache [m rows of P slots], store).

    A bucket of up to `chunk` (static) slots is one piece: `tokens` come left-padded (row i's prompt
    at slots start[i]..P-1) and are prefilled in one forward into the decode row's layout. A longer
    one comes left-aligned (row i's prompt at slots 0..P-start[i]-1) and is computed in pieces on a
    fixed grid (`_prefill_pieces`, `prefix_cache.prefill_grid`), each piece attending over the pieces
    before it. `aligned` (static; an Engine built with training_numerics): every prompt comes left-aligned
    (start[i] is then its row's count of trailing pads) and stays so in its decode row. With the
    prefix cache (inference/prefix_cache.py; one prompt, m = 1) the first
    `hit_count` pieces come from store blocks `hit_ids` and are not computed, and piece j is kept
    in store block put[j] afterwards. (The one-piece path is the layout the engine had before
    pieces: it compiles and runs as fast as then, and a prompt of one piece never uses the store.)
    """
    m, P = tokens.shape
    piece, span = prefill_grid(P, chunk)
    # The prompt's cache is its bucket long, not max_len: its attention covers only the keys the
    # prompt has (a 16-token prompt of a 8,192-slot server once computed scores over all 8,192).
    if span == piece and aligned:  # one piece, left-aligned: each row's logits at its last token
        zero = jnp.zeros_like(start)
        logits, cache = forward_cached(
            params, tokens, init_cache(cfg, m, P, kv_dtype), 0, zero, cfg, logits_at=P - start - 1
        )
        return logits[:, 0], cache, store
    if span == piece:  # one piece, already left-padded (`Engine._start`): straight into the decode layout
        logits, cache = forward_cached(
            params, tokens, init_cache(cfg, m, P, kv_dtype), 0, start, cfg, last_only=True
        )
        return logits[:, -1], cache, store
    return _prefill_pieces(
        params, tokens, start, store, hit_ids, hit_count, put, piece, span, cfg, kv_dtype, aligned
    )


def _write_rows(caches, prefilled, src, slots, count, batch_axis: int):
    """`caches` with row src[j] of the `prefilled` cache written into cache row slots[j], for each of
    the first `count` requests (slots [0, P) of the row; the rest of it stays as it was)."""

    def write(j, caches):  # one cache row per real request: no copy of a prompt's row per sample
        def put(all_rows, new):
            row = jax.lax.dynamic_slice_in_dim(new, src[j], 1, axis=batch_axis).astype(all_rows.dtype)
            at = [jnp.int32(0)] * all_rows.ndim
            at[batch_axis] = slots[j]
            return jax.lax.dynamic_update_slice(all_rows, row, at)  # (slots [0, P) of the row)

        return jax.tree.map(put, caches, prefilled)

    return jax.lax.fori_loop(0, count, write, caches)


def _admit(
    params,
    rows: Rows,
    caches,
    tokens,
    start,
    src,
    slots,
    count,
    settings,
    allowed,
    masked,
    store=None,
    hit_ids=None,
    hit_count=None,
    put=None,
    *,
    cfg,
    kv_dtype,
    to_decode,
    batch_axis,
    chunk,
    plain=False,
    sampling_logprobs=False,
    aligned=False,
):
    """Prefill m distinct prompts (tokens [m, P], row i's prompt at slots 0..P-start[i]-1, zeros
    after) once each, and start k requests on them: request j continues prompt src[j] in cache row
    slots[j] (the first `count` requests are real; the rest pad the shape, and their slots, max_batch
    or more, are dropped). So n samples of one prompt cost one prefill, and each samples its own
    first token.

    Returns (first tokens [k], their logprobs, rows, caches, store). `settings` is (temperature,
    top_k, top_p, key), each [k], of the requests; `allowed` [k, words] restricts their first tokens
    when `masked` (structured output). `plain` (static): every request is greedy and none wants
    log-probs (the program leaves out sampling and log-probs; see `Engine._tick`). How the prompts
    come laid out and how they are prefilled (in pieces, from the prefix cache's `store`, `aligned`):
    `_prefill`.
    """
    temperature, top_k, top_p, key = settings
    P = tokens.shape[1]
    logits, cache, store = _prefill(
        params,
        tokens,
        start,
        store,
        hit_ids,
        hit_count,
        put,
        cfg=cfg,
        kv_dtype=kv_dtype,
        chunk=chunk,
        aligned=aligned,
    )
    logits = logits[src]
    token, key = pick_tokens(
        _restricted(logits, allowed, masked), key, temperature, top_k, top_p, may_sample=not plain
    )
    if plain:
        logprobs = _no_logprobs(logits, token)
    else:
        logprobs = _reported_logprobs(logits, token, (temperature, top_k, top_p), sampling_logprobs)
    caches = _write_rows(caches, to_decode(cache), src, slots, count, batch_axis)
    if aligned:  # each row goes on after its own last token; no pads before it
        pos, first = P - start[src], jnp.zeros_like(start)[src]
    else:
        pos, first = jnp.full(src.shape[0], P, jnp.int32), start[src]
    new = (token, pos, first, key, temperature, top_k, top_p)
    rows = Rows(*(field.at[slots].set(value, mode="drop") for field, value in zip(rows, new)))
    return token, logprobs, rows, caches, store


PREFILL_CHUNK = 128
"""Tokens a prompt is prefilled per piece (a longer bucket loops over pieces), and the prefix cache's
block: a block is reused whole, so a smaller one reuses more of a partly shared prompt and computes
fewer rows on a hit, and a larger one makes fewer, larger matrix products (bench/prefill_chunk.py
measures what pieces cost against one)."""


def prompt_bucket(n: int, max_len: int) -> int:
    """The padded prefill length for an n-token prompt: the next power of two from 16 (capped at
    max_len), so a server compiles a handful of prefill shapes, not one per prompt length."""
    return min(max(16, 1 << (n - 1).bit_length()), max_len)


def _check_sizes(cfg: ModelConfig, max_len, max_batch, tokens_per_call, prefix_cache, prefill_chunk) -> None:
    """Refuse a cache, call, prefix-cache or piece size an engine cannot have (ValueError)."""
    if not 1 <= max_len <= cfg.max_seq_len:
        raise ValueError(f"max_len must be in 1..{cfg.max_seq_len} (model.max_seq_len), got {max_len}")
    if max_batch < 1 or tokens_per_call < 1:
        raise ValueError("max_batch and tokens_per_call must be at least 1")
    if prefix_cache < 0:
        raise ValueError(f"prefix_cache is a number of prompts to keep (0: off), got {prefix_cache}")
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk is a number of tokens (at least 1), got {prefill_chunk}")


def _check_speculation(speculate, draft, sampling_logprobs, fixed_shape) -> None:
    """Refuse speculation settings that are out of range or break another setting's promise (ValueError)."""
    if speculate < 0:
        raise ValueError(f"speculate is a number of draft tokens per call (0: off), got {speculate}")
    if draft is not None and not speculate:
        raise ValueError("a draft model drafts `speculate` tokens a call: give speculate >= 1 with it")
    if speculate and sampling_logprobs:
        raise ValueError(
            "sampling_logprobs reports each step's sampling distribution; speculate checks drafts"
        )
    if speculate and fixed_shape:
        # a check of k+1 positions rounds differently (within 1e-5) from one decode step
        raise ValueError(
            "speculate with fixed_shape: fixed_shape promises replies bitwise independent of other "
            "requests, and whether a call speculates depends on them; use one of them"
        )


def _check_embedding(params) -> None:
    """Refuse weights whose embedding is int8 (ValueError): the engine cannot generate with them."""
    if quant.is_quantized(params.embed):
        # forward_cached and decode_step look tokens up with jnp.take, which needs an array
        raise ValueError(
            "Engine: an int8 embedding (quantize_params(..., embed=True)) is for the full forward "
            "only; quantize with embed=False (the default) to generate"
        )


def _batch_cache(cfg: ModelConfig, max_batch: int, max_len: int, kv_dtype, to_decode):
    """The engine's KV cache, `max_batch` rows of `max_len` slots, in its decode path's layout."""
    return jax.jit(lambda: to_decode(init_cache(cfg, max_batch, max_len, kv_dtype)))()


def _prefix_store(cfg: ModelConfig, max_len: int, prefix_cache: int, prefill_chunk: int, kv_dtype):
    """(the prefix cache's index, its store of K/V blocks) with room for `prefix_cache` prompts of up
    to `prefix_cache.SLOTS` tokens in `prefill_chunk`-token blocks; (None, None) when it is off."""
    if not prefix_cache:
        return None, None
    blocks = prefix_cache * -(-min(max_len, PREFIX_SLOTS) // prefill_chunk)
    index = BlockIndex(blocks, prefill_chunk, prefix_cache)
    return index, jax.jit(lambda: init_store(cfg, blocks, prefill_chunk, kv_dtype))()


def _idle_rows(max_batch: int) -> Rows:
    """The decode state of `max_batch` idle rows (zeros, greedy, a PRNG key each)."""

    def zeros():  # a buffer per field: each is donated to the decode call
        return jnp.zeros(max_batch, jnp.int32)

    keys = jax.random.split(jax.random.key(0), max_batch)
    return Rows(zeros(), zeros(), zeros(), keys, jnp.zeros(max_batch), zeros(), jnp.ones(max_batch))


def _programs(
    params, cfg: ModelConfig, path, kv_dtype, prefill_chunk, tokens_per_call, sampling_logprobs, aligned
):
    """The engine's jitted programs (each compiles per shape on first use): (admit: prefill prompts
    and start requests on them, decode: `tokens_per_call` steps, verify: check speculation's drafts).
    `aligned`: the prefill lays rows out as the trainer's, compiled with the decode step's options
    (`Engine(training_numerics=True)`)."""
    admit = jax.jit(
        partial(
            _admit,
            cfg=cfg,
            kv_dtype=kv_dtype,
            to_decode=path.to_decode,
            batch_axis=path.axes["k"][0],
            chunk=prefill_chunk,
            sampling_logprobs=sampling_logprobs,
            aligned=aligned,
        ),
        donate_argnums=(1, 2, 11),
        static_argnames=("plain",),
        compiler_options=decode_compiler_options(params) if aligned else None,
    )
    decode = jax.jit(
        partial(
            _decode_steps,
            forward=path.forward,
            chunk=tokens_per_call,
            axes=path.axes,
            sampling_logprobs=sampling_logprobs,
        ),
        donate_argnums=(1, 2),
        static_argnames=("n_rows", "span", "plain"),
        compiler_options=decode_compiler_options(params),
    )
    verify = jax.jit(
        partial(_verify_drafts, forward=path.forward, axes=path.axes),
        donate_argnums=(1, 2),
        static_argnames=("n_rows", "span"),
        compiler_options=decode_compiler_options(params),
    )
    return admit, decode, verify


def _drafter(
    draft, cfg: ModelConfig, max_batch: int, max_len: int, speculate: int, program
) -> Drafter | None:
    """The draft model that guesses speculation's tokens, from `draft` = (params, cfg); None (no
    `draft`): replies draft from their own context (prompt lookup)."""
    if draft is None:
        return None
    draft_params, draft_cfg = draft
    return Drafter(
        draft_params,
        draft_cfg,
        max_batch=max_batch,
        max_len=max_len,
        k=speculate,
        vocab=cfg.vocab_size,
        program=program,
        compiler_options=decode_compiler_options(draft_params),
    )


class Engine:
    """The continuous-batching decode loop for one model (see the module docstring)."""

    def __init__(
        self,
        params,
        cfg: ModelConfig,
        *,
        max_batch: int = 8,
        max_len: int | None = None,
        kv_dtype=None,
        tokens_per_call: int = 8,
        fixed_shape: bool = False,
        fingerprint: str | None = None,
        prefix_cache: int = 0,
        prefill_chunk: int = PREFILL_CHUNK,
        speculate: int = 0,
        draft=None,
        sampling_logprobs: bool = False,
        share_prefill: bool = True,
        training_numerics: bool = False,
    ):
        max_len = cfg.max_seq_len if max_len is None else max_len
        _check_sizes(cfg, max_len, max_batch, tokens_per_call, prefix_cache, prefill_chunk)
        _check_speculation(speculate, draft, sampling_logprobs, fixed_shape)
        self.cfg, self.max_batch, self.max_len = cfg, max_batch, max_len
        self.share_prefill = share_prefill
        """Requests admitted together with the same prompt (n samples, RL's group) share one prefill
        row; False prefills each on its own (what sharing saves: bench/rl_throughput.py)."""
        self.sampling_logprobs = sampling_logprobs
        """Requests that ask for log-probs get those of the distribution each token was drawn from
        (temperature, top-k, top-p applied: `sampling.sampling_logits`) instead of the model's own:
        what RL's importance ratio needs (rl/rollout.py)."""
        self.training_numerics = training_numerics
        """Rows laid out as the trainer's (each prompt left-aligned in its cache row, not left-padded:
        attention's `ordered` core sums keys in blocks counted from slot 0) and the prefill compiled
        with the decode step's XLA options (`decode_compiler_options`; on CPU: no YNNPACK fusions,
        whose products round a row by how many rows share the call). With `model.attention_impl:
        ordered`, each token's logits are then bitwise what the trainer's full forward compiled
        with the same options gives (RL's engine mode, rl/step.py; tests/test_rl.py). Costs
        prefill speed on long prompts."""
        self.fixed_shape = fixed_shape
        """Every decode call covers all rows and slots: one compiled shape, so a row's arithmetic (and
        its greedy output) is bitwise the same whatever else runs. Sized calls (the default) are faster
        for few or short requests, but a different row count or span is a different program whose
        float rounding may differ: a near-tie can then go the other way."""
        _check_embedding(params)
        self.params = jax.tree.map(jnp.asarray, params)
        kv_dtype = jnp.dtype(kv_dtype or default_kv_dtype(self.params))
        path = decode_path(self.params, cfg)
        self._decode_weights_of = path.prepare
        self.decode_weights = self._decode_weights_of(self.params)
        self.fingerprint = fingerprint
        """The content hash of the weights serving now (given by the caller: `hot_swap.fingerprint`)."""
        self._queued = (self.params, fingerprint)  # what a request queued now will run on
        self._queue_lock = threading.Lock()  # a swap and a caller's several requests queue one at a time
        self._swap: _Swap | None = None  # taken from the queue: waits for the requests ahead of it
        self.kv_dtype = kv_dtype
        """The KV cache's dtype (default: the embedding's, fp32 for int8 weights)."""
        self.uses_cpu_decode = path.cpu
        """Whether decode runs `cpu_decode.decode_step` (else `decode.forward_cached`)."""
        self._caches = _batch_cache(cfg, max_batch, max_len, kv_dtype, path.to_decode)
        self.prefill_chunk = prefill_chunk
        """Tokens of a prompt prefilled per piece (`_admit`), and the prefix cache's block size."""
        prefix, self._store = _prefix_store(cfg, max_len, prefix_cache, prefill_chunk, kv_dtype)
        self.prefix = prefix
        """The prefix cache's index (None: off); its counters are what /metrics reports."""
        self._rows = _idle_rows(max_batch)
        self.tokens_per_call = tokens_per_call
        self._init_programs(path, kv_dtype)
        self._init_speculation(speculate, draft)
        self.mask_words = -(-cfg.vocab_size // 32)
        """uint32 words of a token mask (`Request.constraint`)."""
        self._open: dict[int, jax.Array] = {}  # all-allowed masks by row count, kept on the device
        self._init_loop_state()

    def _init_programs(self, path, kv_dtype) -> None:
        """The jitted programs of this engine's settings (`_programs`) and the ones compiled aside."""
        self.platform = backend.platform()
        """The platform the programs are built for ("cpu", "gpu", "tpu"): the decode path and XLA options
        are chosen for it (`lower_for` lowers them for a target's devices of that platform)."""
        self._admit, self._decode, self._verify = _programs(
            self.params,
            self.cfg,
            path,
            kv_dtype,
            self.prefill_chunk,
            self.tokens_per_call,
            self.sampling_logprobs,
            self.training_numerics,
        )
        # programs compiled on first use: Compiled, None while compiling
        self._aside: dict[tuple, object] = {}
        self._lazy = False  # compile(first_only=True): decode shapes and prefill buckets come from _aside
        self._compiler = None  # the thread that compiles them for a started engine

    def _init_speculation(self, speculate: int, draft) -> None:
        """Speculation's settings, its draft model (`_drafter`) and the counters /metrics reports."""
        self.speculate = speculate
        """Draft tokens a reply checks per call (inference/speculation.py; 0: off)."""
        self.draft = _drafter(draft, self.cfg, self.max_batch, self.max_len, speculate, self._program)
        """The draft model (`draft_model.Drafter`) that makes the drafts; None: prompt lookup."""
        self.drafted = 0
        """Draft tokens checked (counted for /metrics)."""
        self.accepted = 0
        """Draft tokens the model agreed with."""
        self._kept_per_call = 1.0  # running mean of drafts kept per speculative call
        self._pause = 0  # plain calls left before speculation is tried again
        self._next_pause = speculation.PAUSE_CALLS  # the length of the next pause

    def _init_loop_state(self) -> None:
        """The host's side of the loop: each slot's request and position, the queue, the thread."""
        self._pos = [
            0
        ] * self.max_batch  # each slot's cache position as the host knows it (busy slots: exact)
        self._slots: list[Request | None] = [None] * self.max_batch
        self._pending: queue.SimpleQueue[Request | list[Request] | None] = queue.SimpleQueue()
        self._held: list[Request] | None = None  # a group taken from the queue, waiting for enough slots
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._in_flight = None  # (device outputs, the request in each slot when queued, steps it runs)
        self._driving = threading.Lock()  # one caller of `generate` drives an unstarted engine at a time
        self.error: BaseException | None = None

    # -- called from any thread -------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Queue a request; its prompt plus max_tokens must fit `max_len` (checked here)."""
        self.submit_groups([[request]])

    def submit_group(self, requests: Sequence[Request]) -> None:
        """Queue requests that start together (n samples of one prompt: its prefill is computed once
        and each sample continues from it in its own slot); at most `max_batch` of them."""
        self.submit_groups([requests])

    def submit_groups(self, groups: Sequence[Sequence[Request]]):
        """Queue several groups (`submit_group`; a group of one is a lone request) with nothing queued
        between them, so all run on one set of weights even while a `swap` is queued from another
        thread. Returns (params, fingerprint) of those weights (an `echo` scores its prompt on them)."""
        for requests in groups:
            if not 1 <= len(requests) <= self.max_batch:
                raise ValueError(f"a group of {len(requests)} requests does not fit {self.max_batch} slots")
            for r in requests:
                self._check(r)
        with self._queue_lock:
            params, fingerprint = self._queued
            for requests in groups:
                for r in requests:
                    r.weights = fingerprint
                self._pending.put(requests[0] if len(requests) == 1 else list(requests))
        return params, fingerprint

    def swap(
        self, params, fingerprint: str | None = None, timeout: float | None = None, wait: bool = True
    ) -> None:
        """Serve `params` from now on: requests queued before the call finish on the old weights,
        requests queued after it run on the new ones (and record `fingerprint`). The new weights must
        have the old ones' tree, shapes and dtypes (the compiled programs are reused as they are); a
        ValueError names the first difference and nothing changes.

        A started engine applies the swap once the requests ahead of it have ended, admitting none
        behind it meanwhile (so for a moment a new request waits for the longest running one), and
        this call waits for that (unless not `wait`: then it returns once the swap is queued, and may
        be called from a request's callback); both weight sets are in memory until then. An unstarted
        engine swaps at once.
        """
        # from the engine thread, the loop that applies the swap would be waiting for itself
        if wait and threading.current_thread() is self._thread:
            raise RuntimeError(
                "swap(wait=True) from the engine thread (a request's callback) would never end"
            )
        params = jax.tree.map(jnp.asarray, params)
        _check_same_layout(self.params, params)
        swap = _Swap(params, self._decode_weights_of(params), fingerprint)
        if self._thread is None:
            with self._driving:
                self._apply(swap)
            return
        with self._queue_lock:
            if self.error is not None or self._stopping.is_set():
                raise RuntimeError(f"the engine stopped: {self.error}")
            self._queued = (params, fingerprint)
            self._pending.put(swap)
        if not wait:
            return
        if not swap.done.wait(timeout):
            raise TimeoutError(
                f"the swap waited {timeout} s for the running requests; it applies when they end"
            )
        if swap.error is not None:
            raise RuntimeError(f"the engine stopped before the swap: {swap.error}")

    def _apply(self, swap: _Swap) -> None:
        if self.prefix is not None:  # the K/V it holds came from the old weights
            self.prefix.clear()
        self.params, self.decode_weights, self.fingerprint = (
            swap.params,
            swap.decode_weights,
            swap.fingerprint,
        )
        self._queued = (swap.params, swap.fingerprint)
        swap.done.set()

    def _check(self, request: Request) -> None:
        if not request.prompt:
            raise ValueError("a prompt needs at least one token")
        if len(request.prompt) + request.sampling.max_tokens > self.max_len:
            raise ValueError(
                f"a prompt of {len(request.prompt)} tokens + max_tokens {request.sampling.max_tokens} "
                f"exceeds the context of {self.max_len} tokens"
            )
        if self.error is not None:
            raise RuntimeError(f"the engine stopped: {self.error}")

    def active(self) -> int:
        """Requests holding a slot now."""
        return sum(r is not None for r in self._slots)

    def pending(self) -> int:
        """Queued requests and groups waiting for free slots (approximately: read from another thread)."""
        return self._pending.qsize() + (self._held is not None)

    def kv_tokens(self) -> int:
        """KV cache positions the requests holding a slot fill (read from another thread: a snapshot)."""
        slots, pos = list(self._slots), list(self._pos)
        return sum(p for r, p in zip(slots, pos) if r is not None)

    def prefix_cache_bytes(self) -> int:
        """Bytes the prefix cache's store takes (0: off)."""
        return sum(x.nbytes for x in jax.tree.leaves(self._store)) if self._store is not None else 0

    def kv_cache_bytes(self) -> int:
        """Bytes the preallocated KV cache takes (`max_batch` rows of `max_len` slots)."""
        return sum(x.nbytes for x in jax.tree.leaves(self._caches))

    def start(self) -> Engine:
        self._thread = threading.Thread(target=self._run, name="shipyard-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Finish the loop (requests still running are cancelled) and wait for the thread."""
        self._stopping.set()
        self._pending.put(None)  # wake an idle loop
        if self._thread is not None:
            self._thread.join()

    def shapes(self) -> list[tuple[int, int]]:
        """Every (rows, cache slots) a decode call may cover (`shape`)."""
        if self.fixed_shape:
            return [(self.max_batch, self.max_len)]
        return [(r, s) for r in _sizes(1, self.max_batch) for s in _sizes(64, self.max_len)]

    def compile(self, on_shape: Callable[[], None] | None = None, first_only: bool = False) -> None:
        """Compile every decode shape and prefill bucket now (before `start`), so no request waits for a
        compilation mid-stream. Runs each once on the idle cache (idle rows hold nothing).

        `first_only`: only `first_programs` now; `compile_rest`, once the engine is started, compiles
        the others on the engine's compile thread while it serves. Until one is ready a call runs
        on the smallest compiled shape that covers it (the whole cache at worst, which is always
        compiled first) and a prompt on the smallest compiled bucket it fits; a prompt that fits
        none compiled waits for its own."""
        if self._thread is not None:
            raise RuntimeError("compile the engine before starting it")
        shapes, buckets = self.first_programs() if first_only else (self.shapes(), self._prefill_buckets())
        self._lazy = first_only
        for n_rows, span in shapes:
            if first_only:
                program = self._compiled(("decode", n_rows, span))
            else:  # (the jitted function's own cache, which calls use without `_lazy`)
                program = partial(self._decode, n_rows=n_rows, span=span)
            out, self._rows, self._caches = program(*self._decode_example())
            jax.block_until_ready(out)
            if on_shape is not None:
                on_shape()
        for P in buckets:
            program = self._compiled(("admit", P)) if first_only else self._admit
            token, _, self._rows, self._caches, self._store = program(*self._admit_example(P))
            jax.block_until_ready(token)
            if on_shape is not None:
                on_shape()

    def first_programs(self) -> tuple[list[tuple[int, int]], list[int]]:
        """What `compile(first_only=True)` compiles: one row over the first 256+ slots (a short prompt
        and reply alone), the whole cache (where a call that fits nothing smaller yet runs), and
        the prefill buckets of up to 256 slots (most chat and completion prompts)."""
        shapes = self.shapes()
        lone = next(((r, s) for r, s in shapes if r == 1 and s >= 256), shapes[-1])
        buckets = self._prefill_buckets()
        return list(dict.fromkeys([lone, shapes[-1]])), [b for b in buckets if b <= max(256, buckets[0])]

    def compile_rest(self) -> int:
        """Queue what `compile(first_only=True)` left out on the compile thread (smallest first, the
        ones short requests need soonest); returns how many. Call it once the engine is started."""
        if self._thread is None:
            raise RuntimeError("compile_rest compiles beside a started engine; start it first")
        first_shapes, first_buckets = self.first_programs()
        rest = [(r * s, ("decode", r, s)) for r, s in self.shapes() if (r, s) not in first_shapes]
        rest += [(P, ("admit", P)) for P in self._prefill_buckets() if P not in first_buckets]
        for _, key in sorted(rest):
            self._compiled(key)
        return len(rest)

    def lower_for(self, devices: Sequence[jax.Device]) -> dict[tuple, jax.stages.Lowered]:
        """The programs `compile(first_only=True)` builds (`first_programs`), lowered for `devices` (a
        target's compile-only ones, parallel/targets.py) on the first of them, one serving replica as
        `shipyard serve` runs one: {("decode", rows, slots) or ("admit", P): lowered program}. Build
        the engine inside `backend.compiling_for(devices)`: its decode path and XLA options are
        chosen, when it is built, for the platform it is built for."""
        platform = backend.platform_of(devices)
        if platform != self.platform:
            raise ValueError(
                f"an engine built for {self.platform} cannot be lowered for {platform}: build it inside "
                "backend.compiling_for(devices)"
            )
        mesh = jax.sharding.Mesh(np.array(devices[:1]), ("replica",))
        whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

        def placed(example: list) -> list:
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=whole), example)

        shapes, buckets = self.first_programs()
        lowered = {}
        with backend.compiling_for(devices):
            for rows, span in shapes:
                decode = placed(self._decode_example())
                lowered[("decode", rows, span)] = self._decode.lower(*decode, n_rows=rows, span=span)
            for P in buckets:
                lowered[("admit", P)] = self._admit.lower(*placed(self._admit_example(P)))
        return lowered

    def _compiled(self, key: tuple):
        """`_program` for a decode shape ("decode", rows, slots) or a started engine's prefill bucket
        ("admit", P)."""
        if key[0] == "decode":
            return self._program(key, self._decode, self._decode_example, n_rows=key[1], span=key[2])
        return self._program(key, self._admit, lambda: self._admit_example(key[1]))

    def _decode_example(self) -> list:
        """Arguments of a decode call that runs `tokens_per_call` steps over the idle cache."""
        return [
            self.decode_weights,
            self._rows,
            self._caches,
            np.bool_(False),
            np.int32(self.tokens_per_call),
            self._open_mask(self.max_batch),
            np.bool_(False),
        ]

    def _admit_example(self, P: int) -> list:
        """Arguments of a started engine's prefill of one P-slot prompt that starts no request."""
        k = self.max_batch  # a started engine starts every request or group with this many targets
        tokens, start = jnp.zeros((1, P), jnp.int32), jnp.zeros(1, jnp.int32)
        settings = (
            jnp.zeros(k),
            jnp.zeros(k, jnp.int32),
            jnp.ones(k),
            jax.random.split(jax.random.key(0), k),
        )
        src, slots = jnp.zeros(k, jnp.int32), jnp.full(k, self.max_batch, jnp.int32)
        return [
            self.params,
            self._rows,
            self._caches,
            tokens,
            start,
            src,
            slots,
            np.int32(0),
            settings,
            self._open_mask(k),
            np.bool_(False),
            *self._keep_at(P),
        ]

    def decode_compilations(self) -> int:
        """How many decode programs have been compiled so far (one per (rows, slots) shape used)."""
        return self._decode._cache_size()

    def compilations(self) -> int:
        """How many programs `compile` builds."""
        return len(self.shapes()) + len(self._prefill_buckets())

    def _prefill_buckets(self) -> list[int]:
        """The padded prompt lengths `compile` prepares (a prompt that only fits unpadded compiles its own)."""
        return sorted({prompt_bucket(n, self.max_len) for n in range(1, self.max_len)} - {self.max_len})

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling | Sequence[Sampling],
        *,
        stop: Callable[[list[int]], bool] | None = None,
        on_token: Callable[[int, int], None] | None = None,
        timeout: float | None = None,
    ) -> list[Completion]:
        """Complete every prompt (each its own request; `sampling` one for all or one per prompt) and
        wait for them: the synchronous client that `shipyard generate`, `chat`, lm-eval and the
        pipeline use. A single prompt is a batch of one.

        A reply ends at a stop id (kept), at max_tokens, or at the first token after which
        `stop(tokens so far)` is true (that token kept; finish "stop"). `on_token(i, token)` sees
        every kept token of prompt i, in order, as it arrives. A started engine (`start`, as a
        server runs it) gets the requests beside whatever else it is serving; an unstarted one runs
        its loop in this thread until they are done. Raises RuntimeError if the engine failed or
        stopped before they finished.
        """
        sampling = [sampling] * len(prompts) if isinstance(sampling, Sampling) else list(sampling)
        if len(sampling) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling)} sampling settings")
        results: list[Completion | None] = [None] * len(prompts)
        failures: list[BaseException] = []
        done = threading.Event()
        left = [len(prompts)]

        def collect(i: int, s: Sampling) -> Request:
            tokens: list[int] = []
            logprobs: list[float] = []
            ended: list[str] = []  # "stop" once `stop` matched: later tokens are dropped

            def on_tokens(new, new_logprobs, finish) -> None:
                for t, lp in zip(new, new_logprobs):
                    if ended:
                        break
                    tokens.append(t)
                    if s.logprobs:
                        logprobs.append(lp[0])
                    try:
                        if on_token is not None:
                            on_token(i, t)
                        if stop is not None and stop(tokens):
                            ended.append("stop")
                            request.cancel()
                    except Exception as e:  # raised in the caller, not swallowed by the engine loop
                        failures.append(e)
                        ended.append("error")
                        request.cancel()
                if finish is not None:
                    end = ended[0] if ended else finish
                    results[i] = Completion(tuple(tokens), tuple(logprobs) if s.logprobs else None, end)
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()

            request = Request(list(prompts[i]), s, on_tokens)
            return request

        requests = [collect(i, s) for i, s in enumerate(sampling)]
        if not requests:
            return []
        if self._thread is not None:
            self.submit_groups([[r] for r in requests])  # one set of weights for all (see `swap`)
            if not done.wait(timeout):
                for r in requests:
                    r.cancel()
                raise TimeoutError(f"{left[0]} of {len(requests)} requests did not finish in {timeout} s")
        else:
            with self._driving:
                for r in requests:
                    self.submit(r)
                self._drive(done)
        if failures:
            raise failures[0]
        bad = [c.finish for c in results if c.finish in ("error", "cancelled")]
        if bad:
            raise RuntimeError(f"{len(bad)} of {len(requests)} requests ended early ({bad[0]}): {self.error}")
        return results

    def _drive(self, done: threading.Event) -> None:
        """Run the loop in this thread until `done` (an unstarted engine's `generate`)."""
        try:
            while not done.is_set():
                self._admit_pending(block=False, group=True)
                self._tick()
        except BaseException as e:
            self.error = e
            raise
        finally:
            # what is still queued for the finished requests' rows is of no use: drop it so the next
            # call starts with no stale delivery
            self._in_flight = None

    def warmup(self) -> None:
        """Run one tiny request through the started engine (the smallest prefill and decode shape)."""
        done = threading.Event()
        self.submit(Request([0], Sampling(max_tokens=2), lambda _t, _l, finish: finish and done.set()))
        done.wait()

    # -- the engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # the server reports it; requests waiting must not hang
            log.exception("engine loop failed")
            self.error = e
            for r in self._slots:
                if r is not None and not r.finished:
                    self._finish(r, [], [], "error")
        finally:
            self._drain_pending()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            idle = self._in_flight is None and not any(self._slots)
            if self._swap is not None and self._held is None and idle:  # everything ahead of it ended
                swap, self._swap = self._swap, None
                self._apply(swap)
            self._admit_pending(block=idle and self._swap is None)
            self._tick()
        for r in self._slots:
            if r is not None and not r.finished:
                self._finish(r, [], [], "cancelled")

    def _tick(self) -> None:
        """Queue a decode call for the busy rows, then deliver the previous call's tokens (so the device
        computes the next chunk while the host hands out the last one).

        While a structured reply (`Request.constraint`) runs, its next token's mask depends on the
        token before, so each call is one step, delivered before the next is queued (the rows
        beside it get one token a call meanwhile)."""
        for r in self._slots:  # a cancelled row frees its slot now, whether or not a call is in flight
            if r is not None and r.cancelled and not r.finished:
                self._finish(r, [], [], "cancelled")
        # With a plain call in flight, drafts from the context without its tokens decide whether to
        # give up the overlap (a draft model's: whether a check may run at all); once delivered, the
        # drafts are made again from the whole context.
        if self.speculate and self._in_flight is not None and self._speculation(draft=False) is not None:
            self._deliver(*self._in_flight)
            self._in_flight = None
        speculating = self._speculation() if self._in_flight is None else None
        if speculating is not None:
            self._speculate(*speculating)
            return
        if any(r is not None and r.constraint is not None for r in self._slots):
            if self._in_flight is not None:
                self._deliver(*self._in_flight)
                self._in_flight = None
            queued = self._call(min(self._steps_needed(), 1), constrained=True)
            if queued is not None:
                self._deliver(*queued)
            return
        queued = self._call(self._steps_needed())
        if self._in_flight is not None:
            self._deliver(*self._in_flight)
        self._in_flight = queued

    def _call(self, steps: int, constrained: bool = False):
        """Queue one decode call of `steps` steps over the busy rows: (outputs, the request in each row,
        steps), or None when no row needs a step. `constrained`: the first step is restricted to each
        structured row's allowed tokens."""
        # (the masks first: a structured reply whose grammar fails ends there and frees its row)
        allowed = self._masks(self._slots, self.max_batch) if constrained else self._open_mask(self.max_batch)
        if not steps or not any(self._slots):
            return None
        n_rows, span = self.shape(steps)
        decode = partial(self._decode, n_rows=n_rows, span=span)
        if self._lazy and self._thread is not None:
            decode, (n_rows, span) = self._compiled_decode(n_rows, span)
        busy = [r for r in self._slots[:n_rows] if r is not None]
        want = any(r.sampling.logprobs for r in busy)
        # A started engine (a server) runs the general program, compiled ahead for every shape; the
        # synchronous client (generate, chat, lm-eval) compiles what it needs, and for greedy rows
        # without log-probs that is the argmax alone: half the compile time of the general step.
        plain = self._thread is None and not want and all(r.sampling.temperature <= 0 for r in busy)
        args = (self.decode_weights, self._rows, self._caches, np.bool_(want), np.int32(steps), allowed)
        if isinstance(decode, partial):
            out, self._rows, self._caches = decode(*args, np.bool_(constrained), plain=plain)
        else:
            out, self._rows, self._caches = decode(*args, np.bool_(constrained))
        for b in range(n_rows):
            self._pos[b] = min(self._pos[b] + steps, span)
        return out, list(self._slots[:n_rows]), steps

    def _compiled_admit(self, P: int, requests: list[Request]):
        """(bucket, prefill program) for prompts of bucket P: P's own once compiled (queued on the
        compile thread if it is not), meanwhile the smallest compiled bucket that leaves room for
        every request's max_tokens, else P's jitted program (compiled now: this request waits)."""
        self._compiled(("admit", P))
        room = self.max_len - max(r.sampling.max_tokens for r in requests)
        for bucket in sorted(
            key[1] for key, program in list(self._aside.items()) if key[0] == "admit" and program
        ):
            if P <= bucket <= room:
                return bucket, self._aside[("admit", bucket)]
        return P, self._admit

    def _compiled_decode(self, n_rows: int, span: int):
        """(the compiled decode program, its (rows, slots)): the shape asked for once it is compiled
        (queued on the compile thread if it is not), meanwhile the smallest compiled one covering it."""
        self._compiled(("decode", n_rows, span))
        covering = sorted((r * s, r, s) for r, s in self.shapes() if r >= n_rows and s >= span)
        for _, r, s in covering:
            program = self._aside.get(("decode", r, s))
            if program is not None:
                return program, (r, s)
        raise RuntimeError("no compiled decode program covers the call (the whole cache's was not compiled)")

    def _open_mask(self, rows: int) -> jax.Array:
        """An all-allowed mask of `rows` rows (on the device, made once per row count)."""
        if rows not in self._open:
            self._open[rows] = jnp.full((rows, self.mask_words), 0xFFFFFFFF, jnp.uint32)
        return self._open[rows]

    def _masks(self, requests: Sequence[Request | None], rows: int) -> jax.Array:
        """Each structured request's allowed next tokens in its row, all allowed in the others. A
        request whose grammar fails ends with "error" (its row is then ignored), never the loop."""
        allowed = np.full((rows, self.mask_words), 0xFFFFFFFF, np.uint32)
        for b, r in enumerate(list(requests)):
            if r is not None and r.constraint is not None and not r.finished:
                try:
                    allowed[b] = r.constraint.mask()
                except Exception:
                    log.exception("structured output failed")
                    self._finish(r, [], [], "error")
        return jnp.asarray(allowed)

    def _steps_needed(self) -> int:
        """Decode steps the next call runs: up to `tokens_per_call`, as many as the busy row furthest from
        its max_tokens still needs beyond the call in flight (0: every busy row's last token is already
        being computed, so no call is queued; a row may still end sooner at a stop id)."""
        ahead = {}
        if self._in_flight is not None:
            _, owners, steps = self._in_flight
            ahead = {id(r): steps for r in owners if r is not None}
        need = [
            r.sampling.max_tokens - r.generated - ahead.get(id(r), 0) for r in self._slots if r is not None
        ]
        return max(0, min(max(need, default=0), self.tokens_per_call))

    def shape(self, steps: int | None = None) -> tuple[int, int]:
        """(rows, cache slots) the next decode call (of `steps` steps, default `tokens_per_call`) covers:
        the smallest of `shapes` covering the highest busy slot and the furthest position a busy row
        reaches in the call."""
        if self.fixed_shape:
            return self.max_batch, self.max_len
        busy = [b for b, r in enumerate(self._slots) if r is not None]
        reach = max(self._pos[b] for b in busy) + (self.tokens_per_call if steps is None else steps)
        n_rows = next(r for r in _sizes(1, self.max_batch) if r > max(busy))
        return n_rows, next(s for s in _sizes(64, self.max_len) if s >= reach or s == self.max_len)

    def _admit_pending(self, block: bool, group: bool = False) -> None:
        """Prefill queued requests into free slots (waiting for one when `block` and nothing runs).

        Alone, each request is prefilled by itself: the prefill programs `compile` prepared. With
        `group` (a caller's `generate` on an unstarted engine, which compiles as it goes), the
        requests taken now that share a prompt bucket are prefilled in one call, their count rounded
        up to a power of two (padding rows are dropped), so a batch of prompts costs one prefill.
        """
        taken: dict[int, list[Request]] = {}
        free = self._slots.count(None)
        while free:
            if self._held is not None:
                item, self._held = self._held, None
            elif self._swap is not None:  # what is queued behind a swap waits for the new weights
                break
            else:
                try:
                    item = self._pending.get(block=block, timeout=0.5 if block else None)
                except queue.Empty:
                    break
            block = False
            if item is None:
                continue
            if isinstance(item, _Swap):
                self._swap = item
                continue
            live = []
            for r in item if isinstance(item, list) else [item]:
                if r.cancelled:
                    self._finish(r, [], [], "cancelled")
                else:
                    live.append(r)
            if not live:
                continue
            if len(live) > free:  # a group waits, first in line, until enough slots are free
                self._held = live
                break
            free -= len(live)
            if not group:
                self._start(live)
                continue
            taken.setdefault(self._bucket(live[0]), []).extend(live)
        for requests in taken.values():
            self._start(requests)

    def _bucket(self, request: Request) -> int:
        """The padded prompt length a request is prefilled at."""
        n = len(request.prompt)
        return max(prompt_bucket(n, self.max_len - request.sampling.max_tokens), n)

    def _start(self, requests: list[Request]) -> None:
        """Prefill `requests` (one bucket) in one call into free slots and hand out their first tokens;
        requests with the same prompt (n samples of it) share one prefill row. A lone prompt with a
        prefix the prefix cache holds computes only the pieces after its cached blocks (`_admit`)."""
        P, admit = self._bucket(requests[0]), self._admit
        if self._lazy and self._thread is not None:
            P, admit = self._compiled_admit(P, requests)
        prompts = [tuple(r.prompt) for r in requests]
        prompts = list(dict.fromkeys(prompts)) if self.share_prefill else prompts
        m = 1 << (len(prompts) - 1).bit_length()
        # a started engine uses the one target count `compile` prepared; generate's batches their own
        n = self.max_batch if self._thread is not None else 1 << (len(requests) - 1).bit_length()
        piece, span = prefill_grid(P, self.prefill_chunk)
        tokens = np.zeros((m, P), np.int32)  # one piece: left-padded; more: left-aligned (`_admit`)
        start = np.full(m, P - 1, np.int32)
        for i, p in enumerate(prompts):
            start[i] = P - len(p)
            if span == piece and not self.training_numerics:
                tokens[i, start[i] :] = p
            else:
                tokens[i, : len(p)] = p
        src = np.zeros(n, np.int32)
        slots = np.full(n, self.max_batch, np.int32)  # out of range: dropped
        temperature, top_k, top_p = np.zeros(n, np.float32), np.zeros(n, np.int32), np.ones(n, np.float32)
        seeds = np.zeros(n, np.int32)
        free = [b for b, r in enumerate(self._slots) if r is None]
        row = {p: i for i, p in enumerate(prompts)}
        for i, (r, slot) in enumerate(zip(requests, free)):
            s = r.sampling
            src[i], slots[i] = (row[tuple(r.prompt)] if self.share_prefill else i), slot
            temperature[i], top_k[i], top_p[i], seeds[i] = s.temperature, s.top_k, s.top_p, s.seed
        keys = jax.vmap(jax.random.key)(jnp.asarray(seeds))
        settings = (jnp.asarray(temperature), jnp.asarray(top_k), jnp.asarray(top_p), keys)
        plain = self._thread is None and all(
            r.sampling.temperature <= 0 and not r.sampling.logprobs for r in requests
        )
        constrained = any(r.constraint is not None for r in requests)
        cached = self.prefix is not None and m == 1 and span > piece
        reuse = self.prefix.plan(list(prompts[0]), span // piece) if cached else None
        args = [
            self.params,
            self._rows,
            self._caches,
            jnp.asarray(tokens),
            jnp.asarray(start),
            jnp.asarray(src),
            jnp.asarray(slots),
            np.int32(len(requests)),
            settings,
            self._masks(requests, n) if constrained else self._open_mask(n),
            np.bool_(constrained),
            *self._keep_at(P, reuse),
        ]
        if admit is self._admit:  # (jitted: compiled on first use, also for `plain`)
            token, logprobs, self._rows, self._caches, self._store = self._admit(*args, plain=plain)
        else:
            token, logprobs, self._rows, self._caches, self._store = admit(*args)
        if reuse is not None:
            self.prefix.commit(reuse)
        token = np.asarray(token).tolist()
        host = [np.asarray(x) for x in logprobs] if any(r.sampling.logprobs for r in requests) else None
        for i, (r, slot) in enumerate(zip(requests, free)):
            if r.finished:  # its grammar failed before its first token
                continue
            self._slots[slot] = r
            self._pos[slot] = len(r.prompt) if self.training_numerics else P
            if self.speculate:
                r.context = list(r.prompt)
            lp = (float(host[0][i]), list(zip(host[2][i].tolist(), host[1][i].tolist()))) if host else None
            self._take(r, [token[i]], [lp if r.sampling.logprobs else None])

    def _keep_at(self, P: int, reuse=None) -> tuple:
        """The prefix cache's (store, hit ids, hit count, put ids) arguments of a P-slot prefill: ()
        when the cache is off; no hit and nothing kept without a plan (`compile`, a batch)."""
        if self._store is None:
            return ()
        piece, span = prefill_grid(P, self.prefill_chunk)
        n = span // piece if span > piece else 1
        if reuse is None:
            return self._store, np.zeros(n, np.int32), np.int32(0), np.full(n, self.prefix.blocks, np.int32)
        return self._store, *reuse.arrays(n, self.prefix.blocks)

    def _program(self, key: tuple, jitted, example: Callable[[], list], **static):
        """`jitted` compiled for arguments shaped as `example()` (and `static`), or None while it is not
        compiled (`example` is called only for a program not met before, off the hot path): for programs `compile` does not prepare (each use case's own shapes). An engine
        that serves (started) compiles them on a thread of its own and runs what it has meanwhile,
        so no request waits for a compilation; an unstarted one (`generate`) compiles now, as it
        does every program it meets."""
        if key in self._aside:
            return self._aside[key]
        specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), example())

        def build():
            return jitted.lower(*specs, **static).compile()

        if self._thread is None:
            self._aside[key] = build()
            return self._aside[key]
        if self._compiler is None:
            from concurrent.futures import ThreadPoolExecutor

            self._compiler = ThreadPoolExecutor(1, thread_name_prefix="shipyard-compile")
        self._aside[key] = None

        def done(future):
            if future.exception() is None:
                self._aside[key] = future.result()
            else:
                log.error("compiling %s failed: %s", key, future.exception())

        self._compiler.submit(build).add_done_callback(done)
        return None

    def programs_ready(self) -> bool:
        """Whether every program the engine started compiling on its thread is compiled."""
        return all(program is not None for program in list(self._aside.values()))

    # -- speculative decoding (inference/speculation.py) --

    def _speculation(self, draft: bool = True):
        """(compiled verify program, rows, span, drafts) when the next call may speculate: no busy row
        is structured, a reply needs more than one more token, the k+1 slots fit, and some row has a
        draft; else None (a plain decode call). Without `draft`, a draft model is not run: True when
        it could be (the row contexts may lag a call in flight)."""
        k = self.speculate
        busy = [(b, r) for b, r in enumerate(self._slots) if r is not None]
        if not k or not busy or self._steps_needed() < 2:
            return None
        if self._pause:  # the drafts were mostly wrong lately: plain calls for a while, then try again
            self._pause -= 1
            return None
        if any(r.constraint is not None for _, r in busy):
            return None
        n_rows, span = self.shape(k + 1)
        if max(self._pos[b] for b, _ in busy) + k + 1 > span:  # (near the end of the context)
            return None
        if self.draft is not None and not draft:
            return True

        def example():
            zeros = np.zeros((self.max_batch, k), np.int32)
            return [self.decode_weights, self._rows, self._caches, zeros, np.bool_(False), np.int32(1)]

        program = self._program(("verify", n_rows, span), self._verify, example, n_rows=n_rows, span=span)
        if program is None:
            return None
        if self.draft is not None:
            rows = [(b, r, r.context, self._pos[b]) for b, r in busy]
            drafts = self.draft.drafts(rows, self._rows.start, n_rows, span)
            if drafts is None:  # (its programs compile)
                return None
        else:
            drafts = np.full((self.max_batch, k), speculation.NO_DRAFT, np.int32)
            for b, r in busy:
                drafts[b] = speculation.lookup_draft(r.context, k)
        if (drafts[:, 0] == speculation.NO_DRAFT).all():  # nothing to check: a plain call does as well
            return None
        return program, n_rows, span, drafts

    def _speculate(self, program, n_rows: int, span: int, drafts: np.ndarray) -> None:
        """One speculative call, delivered at once (the next call's drafts depend on its tokens)."""
        owners = list(self._slots[:n_rows])
        want = any(r.sampling.logprobs for r in owners if r is not None)
        out, self._rows, self._caches = program(
            self.decode_weights, self._rows, self._caches, jnp.asarray(drafts), np.bool_(want), np.int32(1)
        )
        greedy, kept, chosen, best, ids = (np.asarray(x) for x in out)
        guessed = [b for b, r in enumerate(owners) if r is not None and drafts[b, 0] != speculation.NO_DRAFT]
        now = float(np.mean(kept[guessed] - 1))
        self._kept_per_call = 0.8 * self._kept_per_call + 0.2 * now
        if self._kept_per_call < speculation.PAUSE_BELOW:
            # Pause; the first call after it decides alone (the mean starts at the threshold), and
            # each pause that follows a poor retry is twice as long: drafts that keep failing (a
            # draft model that does not fit the text) then cost a check every 64 plain calls at most.
            self._pause, self._kept_per_call = self._next_pause, speculation.PAUSE_BELOW
            self._next_pause = min(2 * self._next_pause, speculation.MAX_PAUSE_CALLS)
        elif now >= speculation.PAUSE_BELOW:
            self._next_pause = speculation.PAUSE_CALLS
        for b, request in enumerate(owners):
            self._pos[b] = min(self._pos[b] + int(kept[b]), span)
            if self.draft is not None and request is not None:
                self.draft.advance(b, int(kept[b]))
            if request is None or request.finished:
                continue
            if request.cancelled:
                self._finish(request, [], [], "cancelled")
                continue
            n = int(kept[b])
            self.drafted += int((drafts[b] != speculation.NO_DRAFT).sum())
            self.accepted += n - 1
            lp = [None] * n
            if request.sampling.logprobs:
                lp = [
                    (float(chosen[b, i]), list(zip(ids[b, i].tolist(), best[b, i].tolist())))
                    for i in range(n)
                ]
            self._take(request, greedy[b, :n].tolist(), lp)

    def _deliver(self, out, owners: Sequence[Request | None], steps: int) -> None:
        tokens, chosen, best, ids = (np.asarray(x)[:steps] for x in out)
        for b, request in enumerate(owners):
            if request is None or request.finished:
                continue
            if request.cancelled:
                self._finish(request, [], [], "cancelled")
                continue
            lp = [None] * len(tokens)
            if request.sampling.logprobs:
                lp = [
                    (float(chosen[i, b]), list(zip(ids[i, b].tolist(), best[i, b].tolist())))
                    for i in range(len(tokens))
                ]
            self._take(request, tokens[:, b].tolist(), lp)

    def _take(self, request: Request, tokens: list[int], logprobs: list) -> None:
        """Hand new tokens to the request, up to its end (a stop id, kept; or max_tokens)."""
        s, finish = request.sampling, None
        for n, t in enumerate(tokens, 1):
            if t in s.stop_ids:
                finish = "stop"
            elif request.generated + n >= s.max_tokens:
                finish = "length"
            if finish:
                tokens, logprobs = tokens[:n], logprobs[:n]
                break
        if request.constraint is not None:
            try:
                for t in tokens:
                    request.constraint.advance(t)
            except Exception:  # a grammar that cannot go on: the reply ends as an error, never unconstrained
                log.exception("structured output failed")
                self._finish(request, [], [], "error")
                return
        request.generated += len(tokens)
        if self.speculate:
            request.context.extend(tokens)
        if finish:
            self._finish(request, tokens, logprobs, finish)
            return
        try:
            request.on_tokens(tokens, logprobs, None)
        except Exception:  # a callback's failure ends its request, never the loop
            log.exception("request callback failed")
            self._finish(request, [], [], "error")

    def _finish(self, request: Request, tokens: list[int], logprobs: list, finish: str) -> None:
        request.finished = True
        if request in self._slots:
            self._slots[self._slots.index(request)] = None
        try:
            request.on_tokens(tokens, logprobs, finish)
        except Exception:
            log.exception("request callback failed")

    def _drain_pending(self) -> None:
        held, self._held = self._held or [], None
        swaps, self._swap = [self._swap] if self._swap is not None else [], None
        with self._queue_lock:  # no swap is queued after this one: `swap` sees the stop
            self._stopping.set()
            while True:
                try:
                    item = self._pending.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, _Swap):
                    swaps.append(item)
                else:
                    held.extend(item if isinstance(item, list) else [item] if item is not None else [])
        for request in held:
            if not request.finished:
                self._finish(request, [], [], "cancelled" if self.error is None else "error")
        for swap in swaps:
            swap.error = self.error or RuntimeError("the engine stopped")
            swap.done.set()


def _check_same_layout(old, new) -> None:
    """A ValueError naming the first weight whose place, shape or dtype differs between two trees."""
    old_leaves, old_tree = jax.tree_util.tree_flatten_with_path(old)
    new_leaves, new_tree = jax.tree_util.tree_flatten_with_path(new)
    if old_tree != new_tree:
        theirs = {jax.tree_util.keystr(p) for p, _ in new_leaves}
        mine = {jax.tree_util.keystr(p) for p, _ in old_leaves}
        diff = sorted(theirs ^ mine)
        raise ValueError(f"the new weights have another structure (e.g. {diff[0] if diff else 'the tree'})")
    for (path, a), (_, b) in zip(old_leaves, new_leaves):
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(
                f"the new weights differ at {jax.tree_util.keystr(path)}: {b.dtype}{list(b.shape)} where the "
                f"served model has {a.dtype}{list(a.shape)}"
            )


def engine_for(
    params, cfg: ModelConfig, prompts: Sequence[Sequence[int]], max_tokens: int, **options
) -> Engine:
    """An engine sized for one batch of prompts: a row per prompt, and a cache just long enough for the
    longest prompt's prefill bucket plus `max_tokens` (so a decode call covers no empty slots).
    `options` go to `Engine` (kv_dtype, tokens_per_call, fixed_shape)."""
    if not prompts:
        raise ValueError("engine_for needs at least one prompt")
    longest = max(prompt_bucket(len(p), cfg.max_seq_len) for p in prompts)
    max_len = max(min(cfg.max_seq_len, longest + max_tokens), 1)
    return Engine(params, cfg, max_batch=len(prompts), max_len=max_len, **options)


def _sizes(smallest: int, largest: int) -> list[int]:
    """smallest, 4 x smallest, 16 x ... below `largest`, then `largest`: the sizes a decode call is
    compiled for. Steps of 4 keep the compilations few (each costs about a second) at the price of
    covering up to 4x the busy rows or slots."""
    out = [smallest]
    while out[-1] * 4 < largest:
        out.append(out[-1] * 4)
    return [s for s in out if s < largest] + [largest]
