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
call's tokens while the next call is already running.

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
from shipyard.inference import cpu_decode
from shipyard.inference.decode import forward_cached, init_cache
from shipyard.inference.generate import decode_compiler_options, default_kv_dtype
from shipyard.inference.sampling import MIN_TEMPERATURE, filter_logits

log = logging.getLogger(__name__)

TOP_LOGPROBS = 5
"""Alternatives reported per generated token (OpenAI's completions API allows up to 5)."""


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How one request picks its tokens."""

    max_tokens: int
    """New tokens to generate at most (the prompt plus these must fit `max_len`)."""
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
    """Report each token's log-probability and the best alternatives (otherwise `on_tokens` gets None
    for each: a decode call computes them only when some request in it asks)."""


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

    def cancel(self) -> None:
        """Stop generating (a client went away, a stop string matched): the slot is freed at the next step."""
        self.cancelled = True


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


def sample_rows(logits: jax.Array, key: jax.Array, temperature, top_k, top_p) -> tuple[jax.Array, jax.Array]:
    """One token per row of logits [batch, vocab] with per-row settings: (tokens [batch], keys [batch]).

    Greedy rows (temperature 0) take the argmax and leave their key alone. The
    top-k / top-p filter sorts the vocabulary, so it runs only when some row
    asks for it.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled(_):
        scaled = logits / jnp.maximum(temperature, MIN_TEMPERATURE)[:, None]

        needs_filter = jnp.any((top_k > 0) | (top_p < 1.0))
        scaled = jax.lax.cond(needs_filter, lambda x: filter_logits(x, top_k, top_p), lambda x: x, scaled)
        split = jax.vmap(jax.random.split)(key)
        picks = jax.vmap(jax.random.categorical)(split[:, 1], scaled).astype(jnp.int32)
        hot = temperature > 0
        return jnp.where(hot, picks, greedy), jnp.where(hot, split[:, 0], key)

    return jax.lax.cond(jnp.any(temperature > 0), sampled, lambda _: (greedy, key), None)


def token_logprobs(logits: jax.Array, tokens: jax.Array, top: int = TOP_LOGPROBS):
    """log p of the chosen tokens [batch] and the `top` best (logprobs, ids) [batch, top] under the
    model's own distribution (before temperature or filtering, as OpenAI reports them)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    best, ids = jax.lax.top_k(logp, top)
    return chosen, best, ids.astype(jnp.int32)


def _no_logprobs(logits, tokens, top: int = TOP_LOGPROBS):
    B = tokens.shape[0]
    return jnp.zeros(B), jnp.zeros((B, top)), jnp.zeros((B, top), jnp.int32)


def _decode_steps(
    weights, rows: Rows, caches, want_logprobs, *, forward, chunk, n_rows: int, span: int, axes
):
    """`chunk` decode steps for the first `n_rows` rows over the first `span` cache slots:
    (tokens [chunk, n_rows], logprobs, rows, caches).

    The busy rows are the lowest slots and none reaches past `span` in this
    call, so the step runs on a copy of just that corner of the cache (rows and
    slots), written back in place afterwards: a decode step reads every cached
    key it covers, and with few short requests in a long, wide cache most of it
    would be idle rows and empty slots. `axes` gives each cache array's (row,
    slot) axes by its field name ("k" or "v").
    """
    full_rows, full_caches = rows, caches
    rows = jax.tree.map(lambda x: x[:n_rows], rows)
    caches = _map_cache(lambda name, a: _corner(a, *axes[name], n_rows, span), caches)
    out, rows, caches = _steps(weights, rows, caches, want_logprobs, forward=forward, chunk=chunk, span=span)
    rows = jax.tree.map(lambda full, part: full.at[:n_rows].set(part), full_rows, rows)
    caches = _map_cache(
        lambda name, full, part: jax.lax.dynamic_update_slice(full, part, [0] * full.ndim),
        full_caches,
        caches,
    )
    return out, rows, caches


def _corner(a, row_axis: int, slot_axis: int, n_rows: int, span: int):
    a = jax.lax.slice_in_dim(a, 0, n_rows, axis=row_axis)
    return jax.lax.slice_in_dim(a, 0, span, axis=slot_axis)


def _map_cache(fn, caches, *others):
    """fn(field name "k" / "v", array, *matching arrays of `others`) over a KVCache or per-layer caches."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(caches)
    rest = [jax.tree.leaves(o) for o in others]
    out = [fn(path[-1].name, a, *(r[i] for r in rest)) for i, (path, a) in enumerate(paths)]
    return jax.tree.unflatten(treedef, out)


def _steps(weights, rows: Rows, caches, want_logprobs, *, forward, chunk: int, span: int):
    B = rows.last.shape[0]

    def body(i, carry):
        out, rows, caches = carry
        logits, caches = forward(weights, rows.last[:, None], caches, rows.pos, rows.start)
        logits = logits[:, -1]
        tokens, key = sample_rows(logits, rows.key, rows.temperature, rows.top_k, rows.top_p)
        chosen, best, ids = jax.lax.cond(want_logprobs, token_logprobs, _no_logprobs, logits, tokens)
        out = jax.tree.map(lambda o, x: o.at[i].set(x), out, (tokens, chosen, best, ids))
        # a row past its end (it has finished; the host ignores it) keeps overwriting its last slot
        rows = rows._replace(last=tokens, pos=jnp.minimum(rows.pos + 1, span - 1), key=key)
        return out, rows, caches

    out = (
        jnp.zeros((chunk, B), jnp.int32),
        jnp.zeros((chunk, B), jnp.float32),
        jnp.zeros((chunk, B, TOP_LOGPROBS), jnp.float32),
        jnp.zeros((chunk, B, TOP_LOGPROBS), jnp.int32),
    )
    out, rows, caches = jax.lax.fori_loop(0, chunk, body, (out, rows, caches))
    return out, rows, caches


def _admit(
    params,
    rows: Rows,
    caches,
    tokens,
    start,
    slot,
    settings,
    *,
    cfg,
    max_len,
    kv_dtype,
    to_decode,
    batch_axis,
):
    """Prefill one prompt (tokens [1, P], left-padded by `start`) and write it into row `slot`.

    Returns (first token, its logprobs, rows, caches). `settings` is
    (temperature, top_k, top_p, key) of the request.
    """
    temperature, top_k, top_p, key = settings
    cache = init_cache(cfg, 1, max_len, kv_dtype)
    logits, cache = forward_cached(params, tokens, cache, jnp.int32(0), start, cfg, last_only=True)
    logits = logits[:, -1]
    t, k, p = temperature[None], top_k[None], top_p[None]
    token, key = sample_rows(logits, key[None], t, k, p)
    logprobs = token_logprobs(logits, token)
    one = to_decode(cache)
    caches = jax.tree.map(
        lambda all_rows, row: jax.lax.dynamic_update_slice_in_dim(
            all_rows, row.astype(all_rows.dtype), slot, batch_axis
        ),
        caches,
        one,
    )
    P = tokens.shape[1]
    new = (token[0], jnp.int32(P), start[0], key[0], temperature, top_k, top_p)
    rows = Rows(*(field.at[slot].set(value) for field, value in zip(rows, new)))
    return token[0], jax.tree.map(lambda x: x[0], logprobs), rows, caches


def prompt_bucket(n: int, max_len: int) -> int:
    """The padded prefill length for an n-token prompt: the next power of two from 16 (capped at
    max_len), so a server compiles a handful of prefill shapes, not one per prompt length."""
    return min(max(16, 1 << (n - 1).bit_length()), max_len)


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
    ):
        max_len = cfg.max_seq_len if max_len is None else max_len
        if not 1 <= max_len <= cfg.max_seq_len:
            raise ValueError(f"max_len must be in 1..{cfg.max_seq_len} (model.max_seq_len), got {max_len}")
        if max_batch < 1 or tokens_per_call < 1:
            raise ValueError("max_batch and tokens_per_call must be at least 1")
        self.cfg, self.max_batch, self.max_len = cfg, max_batch, max_len
        self.fixed_shape = fixed_shape
        """Every decode call covers all rows and slots: one compiled shape, so a row's arithmetic (and
        its greedy output) is bitwise the same whatever else runs. Sized calls (the default) are faster
        for few or short requests, but a different row count or span is a different program whose
        float rounding may differ: a near-tie can then go the other way."""
        self.params = jax.tree.map(jnp.asarray, params)
        kv_dtype = jnp.dtype(kv_dtype or default_kv_dtype(self.params))
        if cpu_decode.supported(self.params, cfg):
            self._weights = jax.jit(partial(cpu_decode.prepare_weights, cfg=cfg))(self.params)
            forward, to_decode = partial(cpu_decode.decode_step, cfg=cfg), cpu_decode.to_layer_caches
            axes = {"k": (0, 3), "v": (0, 2)}  # per-layer head-major caches: k [b, k, d, s], v [b, k, s, d]
        else:
            self._weights = self.params
            forward, to_decode = partial(forward_cached, cfg=cfg), lambda cache: cache
            axes = {"k": (1, 2), "v": (1, 2)}  # KVCache [layers, batch, slots, kv_heads, head_dim]
        batch_axis = axes["k"][0]
        self._caches = jax.jit(lambda: to_decode(init_cache(cfg, max_batch, max_len, kv_dtype)))()

        def zeros():  # a buffer per field: each is donated to the decode call
            return jnp.zeros(max_batch, jnp.int32)

        keys = jax.random.split(jax.random.key(0), max_batch)
        self._rows = Rows(zeros(), zeros(), zeros(), keys, jnp.zeros(max_batch), zeros(), jnp.ones(max_batch))
        self._admit = jax.jit(
            partial(
                _admit,
                cfg=cfg,
                max_len=max_len,
                kv_dtype=kv_dtype,
                to_decode=to_decode,
                batch_axis=batch_axis,
            ),
            donate_argnums=(1, 2),
        )
        self._decode = jax.jit(
            partial(_decode_steps, forward=forward, chunk=tokens_per_call, axes=axes),
            donate_argnums=(1, 2),
            static_argnames=("n_rows", "span"),
            compiler_options=decode_compiler_options(self.params),
        )
        self.tokens_per_call = tokens_per_call
        self._pos = [0] * max_batch  # each slot's cache position as the host knows it (busy slots: exact)
        self._slots: list[Request | None] = [None] * max_batch
        self._pending: queue.SimpleQueue[Request | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.error: BaseException | None = None

    # -- called from any thread -------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Queue a request; its prompt plus max_tokens must fit `max_len` (checked here)."""
        if not request.prompt:
            raise ValueError("a prompt needs at least one token")
        if len(request.prompt) + request.sampling.max_tokens > self.max_len:
            raise ValueError(
                f"a prompt of {len(request.prompt)} tokens + max_tokens {request.sampling.max_tokens} "
                f"exceeds the context of {self.max_len} tokens"
            )
        if self.error is not None:
            raise RuntimeError(f"the engine stopped: {self.error}")
        self._pending.put(request)

    def active(self) -> int:
        """Requests holding a slot now."""
        return sum(r is not None for r in self._slots)

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

    def compile(self, on_shape: Callable[[], None] | None = None) -> None:
        """Compile every decode shape and prefill bucket now (before `start`), so no request waits for a
        compilation mid-stream. Runs each once on the idle cache (idle rows hold nothing)."""
        if self._thread is not None:
            raise RuntimeError("compile the engine before starting it")
        for n_rows, span in self.shapes():
            out, self._rows, self._caches = self._decode(
                self._weights, self._rows, self._caches, np.bool_(False), n_rows=n_rows, span=span
            )
            jax.block_until_ready(out)
            if on_shape is not None:
                on_shape()
        for P in self._prefill_buckets():
            tokens, start = jnp.zeros((1, P), jnp.int32), jnp.zeros(1, jnp.int32)
            settings = (jnp.float32(0), jnp.int32(0), jnp.float32(1), jax.random.key(0))
            token, _, self._rows, self._caches = self._admit(
                self.params, self._rows, self._caches, tokens, start, jnp.int32(0), settings
            )
            jax.block_until_ready(token)
            if on_shape is not None:
                on_shape()

    def compilations(self) -> int:
        """How many programs `compile` builds."""
        return len(self.shapes()) + len(self._prefill_buckets())

    def _prefill_buckets(self) -> list[int]:
        """The padded prompt lengths `compile` prepares (a prompt that only fits unpadded compiles its own)."""
        return sorted({prompt_bucket(n, self.max_len) for n in range(1, self.max_len)} - {self.max_len})

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
        in_flight = None  # (device outputs, the request in each slot when the call was queued)
        while not self._stopping.is_set():
            self._admit_pending(block=in_flight is None and not any(self._slots))
            if not any(self._slots) and in_flight is None:
                continue
            queued = None
            if any(self._slots):
                n_rows, span = self.shape()
                want = any(r is not None and r.sampling.logprobs for r in self._slots[:n_rows])
                out, self._rows, self._caches = self._decode(
                    self._weights, self._rows, self._caches, np.bool_(want), n_rows=n_rows, span=span
                )
                queued = (out, list(self._slots[:n_rows]))
                for b in range(n_rows):
                    self._pos[b] = min(self._pos[b] + self.tokens_per_call, span - 1)
            if in_flight is not None:
                self._deliver(*in_flight)
            in_flight = queued
        for r in self._slots:
            if r is not None and not r.finished:
                self._finish(r, [], [], "cancelled")

    def shape(self) -> tuple[int, int]:
        """(rows, cache slots) the next decode call covers: the smallest of `shapes` covering the highest
        busy slot and the furthest position a busy row reaches in the call."""
        if self.fixed_shape:
            return self.max_batch, self.max_len
        busy = [b for b, r in enumerate(self._slots) if r is not None]
        reach = max(self._pos[b] for b in busy) + self.tokens_per_call
        n_rows = next(r for r in _sizes(1, self.max_batch) if r > max(busy))
        return n_rows, next(s for s in _sizes(64, self.max_len) if s >= reach or s == self.max_len)

    def _admit_pending(self, block: bool) -> None:
        """Prefill queued requests into free slots (waiting for one when `block` and nothing runs)."""
        while None in self._slots:
            try:
                request = self._pending.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if request is None or request.cancelled:
                if request is not None:
                    self._finish(request, [], [], "cancelled")
                continue
            self._start(request, self._slots.index(None))

    def _start(self, request: Request, slot: int) -> None:
        s = request.sampling
        P = prompt_bucket(len(request.prompt), self.max_len - s.max_tokens)
        P = max(P, len(request.prompt))
        tokens = np.zeros((1, P), np.int32)
        tokens[0, P - len(request.prompt) :] = request.prompt
        settings = (
            jnp.float32(s.temperature),
            jnp.int32(s.top_k),
            jnp.float32(s.top_p),
            jax.random.key(s.seed),
        )
        start = jnp.asarray([P - len(request.prompt)], jnp.int32)
        token, logprobs, self._rows, self._caches = self._admit(
            self.params, self._rows, self._caches, jnp.asarray(tokens), start, jnp.int32(slot), settings
        )
        self._slots[slot], self._pos[slot] = request, P
        self._take(request, [int(token)], [_host_logprobs(logprobs) if s.logprobs else None])

    def _deliver(self, out, owners: Sequence[Request | None]) -> None:
        tokens, chosen, best, ids = (np.asarray(x) for x in out)
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
        request.generated += len(tokens)
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
        while True:
            try:
                request = self._pending.get_nowait()
            except queue.Empty:
                return
            if request is not None and not request.finished:
                self._finish(request, [], [], "cancelled" if self.error is None else "error")


def _sizes(smallest: int, largest: int) -> list[int]:
    """smallest, 4 x smallest, 16 x ... below `largest`, then `largest`: the sizes a decode call is
    compiled for. Steps of 4 keep the compilations few (each costs about a second) at the price of
    covering up to 4x the busy rows or slots."""
    out = [smallest]
    while out[-1] * 4 < largest:
        out.append(out[-1] * 4)
    return [s for s in out if s < largest] + [largest]


def _host_logprobs(logprobs) -> tuple[float, list[tuple[int, float]]]:
    chosen, best, ids = (np.asarray(x) for x in logprobs)
    return float(chosen), list(zip(ids.tolist(), best.tolist()))


@partial(jax.jit, static_argnames=("cfg",))
def _prompt_logprobs(params, tokens, cfg: ModelConfig):
    cache = init_cache(cfg, 1, tokens.shape[1], default_kv_dtype(params))
    start = jnp.zeros(1, jnp.int32)
    logits, _ = forward_cached(params, tokens, cache, jnp.int32(0), start, cfg)
    logits = logits[0, :-1]
    return token_logprobs(logits, tokens[0, 1:])


def prompt_logprobs(params, cfg: ModelConfig, prompt: Sequence[int]) -> list[tuple[float, list]]:
    """log p(prompt[i] | prompt[:i]) with the top alternatives, for i = 1 .. len - 1 (an `echo` request).

    The prompt is right-padded to a power-of-two bucket (causal attention
    keeps the padding out of every scored position), so a server compiles
    few shapes.
    """
    n = len(prompt)
    if n < 2:
        return []
    width = max(16, 1 << (n - 1).bit_length())
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :n] = prompt
    chosen, best, ids = (np.asarray(x)[: n - 1] for x in _prompt_logprobs(params, jnp.asarray(tokens), cfg))
    return [(float(c), list(zip(i.tolist(), b.tolist()))) for c, b, i in zip(chosen, best, ids)]
