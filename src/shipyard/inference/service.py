"""Build what `shipyard serve` serves from a model directory, and run the HTTP server until SIGTERM.

`load_service` opens any model directory (a run, an `import hf` output, a
Hugging Face directory), optionally quantizes it to int8, starts the
continuous-batching engine and compiles it before the port opens; `serve`
runs uvicorn. uvicorn's own shutdown handles SIGTERM/SIGINT: it stops
accepting connections, lets in-flight requests (streams included) finish,
then the lifespan hook stops the engine, and the process exits 0.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from shipyard.errors import ConfigError, DataError
from shipyard.inference.engine import PREFILL_CHUNK, Engine, default_kv_dtype
from shipyard.inference.hot_swap import Swapper, fingerprint, tokenizer_digest
from shipyard.inference.prefix_cache import SLOTS as PREFIX_SLOTS
from shipyard.inference.server import Service, create_app
from shipyard.inference.tool_calls import family_of
from shipyard.output import progress

log = logging.getLogger("shipyard.serve")


CACHE_MAX_BYTES = 4 << 30
"""The compile cache's size bound (JAX evicts the least recently used programs past it)."""

PREFIX_CACHE = 2
"""Prompts of up to 2,048 tokens (`prefix_cache.SLOTS`) `serve` sizes the prefix cache for by default
(`--prefix-cache`): as much as 2 KV cache rows, a quarter of the default 8 rows' memory. Blocks are
shared, so that holds one system prompt in front of any number of conversations and their recent
turns."""


def enable_compile_cache(directory: str | None) -> str | None:
    """Turn on JAX's persistent compilation cache so a restarted server loads its decode and prefill
    programs instead of compiling them again (minutes for a real model on a CPU). `directory`: where
    (None: `$JAX_COMPILATION_CACHE_DIR` when set, else `$XDG_CACHE_HOME/shipyard/xla`); "off": leave
    it off. Returns the directory in use. Programs are keyed by their HLO, compile options, devices
    and JAX version, so a changed model or flag compiles anew and never reads a stale program."""
    import os

    from shipyard.data.published import cache_dir

    if directory == "off":
        return None
    own = str(cache_dir("xla"))
    directory = directory or os.environ.get("JAX_COMPILATION_CACHE_DIR") or own
    jax.config.update("jax_compilation_cache_dir", directory)
    # every program, however quick to compile (JAX's default keeps those over 1 s): a restart then
    # compiles nothing, and a program near the threshold is not cached on one start and not the next
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    # Bounded (least recently used go first) only in shipyard's own directory. A bounded cache keeps
    # an access-time file beside each program and fails every write in a directory holding a program
    # without one, which any unbounded JAX process (a training run with $JAX_COMPILATION_CACHE_DIR)
    # writes: a server sharing such a directory would then cache nothing and recompile on restart.
    if directory == own and jax.config.jax_compilation_cache_max_size < 0:
        jax.config.update("jax_compilation_cache_max_size", CACHE_MAX_BYTES)
    return directory


DRAFT_TOKENS = 4
"""Draft tokens a call with a draft model and no --speculate K (a check of 5 positions costs about one
decode step on CPU, and a good draft model's 4th guess is still often right)."""


def load_service(
    model,
    *,
    name: str | None = None,
    step: int | None = None,
    tokenizer: str | Path | None = None,
    template: str | None = None,
    max_batch: int = 8,
    max_len: int | None = None,
    quantize: str | None = None,
    kv_dtype: str | None = None,
    tokens_per_call: int = 8,
    fixed_shape: bool = False,
    tool_parser: str = "auto",
    prefix_cache: int | None = None,
    prefill_chunk: int | None = None,
    speculate: int | None = None,
    draft_model: str | Path | None = None,
) -> Service:
    """A started, warmed-up `Service` for the model directory `model`, ready to swap in others
    (`hot_swap.Swapper`) of the same kind. `tool_parser`: the tool-call format replies are read in
    (`tool_calls.FAMILIES`), "auto" from the chat template, "none" for no tool calls.
    `prefix_cache`: the prefix cache's size in prompts of up to `prefix_cache.SLOTS` tokens (None:
    `PREFIX_CACHE`; 0: off); `prefill_chunk`: tokens a prompt is prefilled per piece, the cache's block
    (None: `engine.PREFILL_CHUNK`).
    `speculate`: draft tokens a reply checks per decode call (None: `DRAFT_TOKENS` with a draft model,
    else 0: off); `draft_model`: a model directory with the same vocabulary whose guesses they are
    (default: prompt lookup)."""
    from shipyard.data.tokenizer import load_tokenizer, special_token_ids
    from shipyard.run.model_dir import open_model_dir

    model_dir = open_model_dir(model, "serve", tokenizer)
    tok_dir = model_dir.require_tokenizer("serve")
    gen = model_dir.generation("serve")
    context = model_dir.config.model.max_seq_len
    _check_flags(context, max_len, max_batch, tokens_per_call, prefix_cache)
    prefix_cache, prefill_chunk, speculate = _resolve_defaults(
        prefix_cache, prefill_chunk, speculate, draft_model, fixed_shape
    )
    tok = load_tokenizer(tok_dir)
    draft = _draft_model(draft_model, tok) if draft_model is not None else None
    ids = special_token_ids(tok_dir, tok)
    chat, missing = _chat_format(model_dir, tok_dir, template)
    cfg, step, params, weights = _load_weights(model_dir, model, step, quantize)
    fitted = _fitted_max_len(params, cfg.model, max_len, max_batch, prefix_cache, kv_dtype)
    engine = Engine(
        params,
        cfg.model,
        max_batch=max_batch,
        max_len=max_len if fitted is None else fitted[0],
        kv_dtype=kv_dtype,
        tokens_per_call=tokens_per_call,
        fixed_shape=fixed_shape,
        fingerprint=weights,
        prefix_cache=prefix_cache,
        prefill_chunk=prefill_chunk,
        speculate=speculate,
        draft=draft,
    )
    _describe(engine, _why_max_len(max_len, fitted, context), prefix_cache, draft, draft_model, speculate)
    _warm_up(engine)
    eos = tuple(dict.fromkeys(i for i in (ids["eos_token"], *gen.eos_ids) if i is not None))
    specials = {k: (tok.id_to_token(v) if v is not None else None) for k, v in ids.items()}
    hf_template = _template_source(chat)
    if tool_parser == "auto":
        tool_parser = family_of(hf_template)
    return Service(
        name=name or Path(model).resolve().name,
        engine=engine,
        tok=tok,
        eos_ids=eos,
        chat=chat,
        chat_missing=missing,
        defaults=gen,
        specials=specials,
        chat_template=hf_template,
        tool_parser=None if tool_parser == "none" else tool_parser,
        swapper=_swapper(engine, model, step, tokenizer, quantize, tok_dir),
    )


def _chat_format(model_dir, tok_dir, template: str | None) -> tuple:
    """(the chat format, "") of `template`, else of the run's template, else of the tokenizer's own;
    (None, why there is none) when there is none (a chat request is refused with the reason)."""
    from shipyard.run.model_dir import chat_format_of, run_template

    chat, missing = None, ""
    try:
        chat = chat_format_of(tok_dir, template or run_template(model_dir.config))
    except DataError as e:
        missing = str(e)
    return chat, missing


def _load_weights(model_dir, model, step: int | None, quantize: str | None) -> tuple:
    """(config, step, params, their fingerprint) of the model directory, quantized as asked; says
    what was loaded, from where and how long it took."""
    from shipyard.model.quantize import maybe_quantize

    t0 = time.perf_counter()
    cfg, step, params = model_dir.load(step, what="serve")  # (a refusal here is the only line printed)
    params = maybe_quantize(params, cfg.model, quantize)
    weights = fingerprint(params)
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    where = f"{model}" + (f" checkpoint {step}" if step is not None else "")
    _say(
        f"serve: {n / 1e6:.1f}M parameters ({weights}) loaded from {where} in {time.perf_counter() - t0:.1f} s"
    )
    return cfg, step, params, weights


def _template_source(chat) -> str | None:
    """The Hugging Face chat template's text the chat format renders with (None: a built-in format)."""
    hf_template = getattr(getattr(chat, "template", None), "source", None)
    return hf_template if isinstance(hf_template, str) else None


def _swapper(engine: Engine, model, step: int | None, tokenizer, quantize: str | None, tok_dir) -> Swapper:
    """What loads other weights of the same kind into `engine` (/admin/swap, --watch): the served
    directory (a URL as given), its step, tokenizer, quantization and tokenizer digest."""
    return Swapper(
        engine,
        str(Path(model).resolve()) if "://" not in str(model) else str(model),
        step,
        tokenizer=tokenizer,
        quantize=quantize,
        tokenizer_sha256=tokenizer_digest(tok_dir),
    )


def _check_flags(context: int, max_len, max_batch: int, tokens_per_call: int, prefix_cache) -> None:
    """Refuse --max-len, --max-batch, --tokens-per-call and --prefix-cache out of range (ConfigError)."""
    if max_len is not None and not 1 <= max_len <= context:
        raise ConfigError(f"serve: --max-len {max_len} must be in 1..{context} (the model's context)")
    if max_batch < 1:
        raise ConfigError(f"serve: --max-batch must be at least 1, got {max_batch}")
    if tokens_per_call < 1:
        raise ConfigError(f"serve: --tokens-per-call must be at least 1, got {tokens_per_call}")
    if prefix_cache is not None and prefix_cache < 0:
        raise ConfigError(f"serve: --prefix-cache is a number of prompts (0: off), got {prefix_cache}")


def _resolve_defaults(
    prefix_cache, prefill_chunk, speculate, draft_model, fixed_shape: bool
) -> tuple[int, int, int]:
    """(prefix_cache, prefill_chunk, speculate) with their defaults filled in, each checked (ConfigError)."""
    if prefill_chunk is None:
        prefill_chunk = PREFILL_CHUNK
    if prefill_chunk < 1:
        raise ConfigError(f"serve: --prefill-chunk is a number of tokens (at least 1), got {prefill_chunk}")
    if prefix_cache is None:
        prefix_cache = PREFIX_CACHE
    if speculate is not None and speculate < 0:
        raise ConfigError(f"serve: --speculate is a number of draft tokens (0: off), got {speculate}")
    if draft_model is not None and speculate == 0:
        raise ConfigError("serve: --draft-model with --speculate 0: the draft model would never be asked")
    if speculate is None:
        speculate = DRAFT_TOKENS if draft_model is not None else 0
    if speculate and fixed_shape:
        raise ConfigError(
            "serve: --speculate/--draft-model with --fixed-shape: a check of several positions rounds "
            "differently (within 1e-5) from one step, so replies would depend on which calls speculated; "
            "leave one of them out"
        )
    return prefix_cache, prefill_chunk, speculate


def _fitted_max_len(params, cfg, max_len, max_batch: int, prefix_cache: int, kv_dtype):
    """`fitting_max_len` of this process's memory when no --max-len was given, on CPU (device memory
    is XLA's own); else None."""
    if max_len is not None or jax.default_backend() != "cpu":
        return None
    return fitting_max_len(
        cfg,
        weight_bytes(params),
        max_batch,
        prefix_cache,
        kv_dtype or default_kv_dtype(params),
        _memory(),
    )


def _why_max_len(max_len, fitted, context: int) -> str:
    """Why the cache has the slots it has, for the start-up line (`_fitted_max_len`'s `fitted`)."""
    if max_len is not None:
        return f"--max-len {max_len}"
    if fitted is not None and fitted[0] < context:
        return (
            f"the model's context of {context} would take about {fitted[1] / 2**30:.1f} GiB with the rest of "
            f"the server, and {fitted[2] / 2**30:.1f} GiB is available: the longest that fits; --max-len L sets it"
        )
    return "the model's whole context: --max-len L takes less"


def _describe(engine: Engine, why: str, prefix_cache: int, draft, draft_model, speculate: int) -> None:
    """The start-up lines of the engine's memory: KV cache, prefix cache, draft model."""
    _say(
        f"serve: KV cache {engine.max_batch} rows x {engine.max_len} slots x {jnp.dtype(engine.kv_dtype).name} "
        f"= {engine.kv_cache_bytes() / 2**20:.1f} MiB (--max-batch {engine.max_batch}; {why})"
    )
    if engine.prefix is not None:
        _say(
            f"serve: prefix cache {engine.prefix.blocks} blocks x {engine.prefill_chunk} tokens = "
            f"{engine.prefix_cache_bytes() / 2**20:.1f} MiB (--prefix-cache {prefix_cache} prompts' worth; 0: off)"
        )
    if engine.draft is not None:
        n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(draft[0]))
        _say(
            f"serve: draft model {draft_model} ({n / 1e6:.1f}M parameters) guesses {speculate} tokens a call; "
            f"its KV cache {engine.draft.cache_bytes() / 2**20:.1f} MiB"
        )


def _warm_up(engine: Engine) -> None:
    """Compile what the first requests need (`_compile`), start the engine, compile the rest beside it."""
    _compile(engine)
    if jax.default_backend() == "cpu":  # (the allocator's business on CPU; device memory is XLA's own)
        from shipyard.cpu_tuning import release_free_memory

        release_free_memory()  # what loading and compiling freed, which the allocator would keep
    engine.start()
    engine.compile_rest()


RUNTIME_BYTES = 1.6 * 2**30
"""What a CPU server holds besides its weights and caches (runtime, libraries, HTTP server, compiled
programs): the constant of docs/serving.md's memory formula, fitted by bench/serve_startup.py."""


def predicted_bytes(weights: int, cache: int) -> float:
    """docs/serving.md's resident-memory formula for a CPU server: the runtime, the weights twice (the
    decode step's fused copy), the KV and prefix caches and a tenth more (decode calls' corner copies)."""
    return RUNTIME_BYTES + 2 * weights + 1.1 * cache


def fitting_max_len(cfg, weights: int, max_batch: int, prefix_cache: int, kv_dtype, available: int | None):
    """(max_len, predicted bytes at the model's whole context, available bytes) when the whole context
    would not fit `available` (`predicted_bytes` over 90% of it): the longest of context / 2, / 4, ..
    (down to 256) that does, else the shortest; None when the whole context fits or nothing is known."""
    if available is None:
        return None
    per_slot = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(kv_dtype).itemsize

    def need(slots: int) -> float:
        return predicted_bytes(
            weights, per_slot * (max_batch * slots + prefix_cache * min(slots, PREFIX_SLOTS))
        )

    whole = need(cfg.max_seq_len)
    if whole <= 0.9 * available:
        return None
    slots = cfg.max_seq_len
    while slots > 256 and need(slots) > 0.9 * available:
        slots //= 2
    return max(slots, min(256, cfg.max_seq_len)), whole, available


def weight_bytes(params) -> int:
    return sum(int(x.nbytes) for x in jax.tree.leaves(params))


def _memory() -> int | None:
    """Bytes this process could hold: what it holds now plus what the OS says is available (Linux)."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        return (int(info["MemAvailable"].split()[0]) + int(status["VmRSS"].split()[0])) * 1024
    except (OSError, KeyError, ValueError):
        return None


def _draft_model(path, tok) -> tuple:
    """(params, ModelConfig) of the draft model directory `path`, refused in one line unless its
    tokenizer gives every token the served one's id (a draft is token ids: with other ids, no draft
    would ever be kept)."""
    from shipyard.data.tokenizer import load_tokenizer
    from shipyard.run.model_dir import open_model_dir

    what = "serve --draft-model"
    model_dir = open_model_dir(path, what)
    theirs, mine = load_tokenizer(model_dir.require_tokenizer(what)).get_vocab(), tok.get_vocab()
    if theirs != mine:
        token = min(set(theirs.items()) ^ set(mine.items()), key=lambda x: x[1])[0]  # the lowest id
        raise ConfigError(
            f"{what}: {path}'s tokenizer is not the served model's ({len(theirs)} vs {len(mine)} tokens; "
            f"they differ at {token!r}); a draft model must share the served model's vocabulary"
        )
    cfg, _, params = model_dir.load(None, what=what)
    return params, cfg.model


def _say(line: str) -> None:
    """A start-up line on stderr, terminal or not (a server's log shows what it is doing)."""
    print(line, file=sys.stderr, flush=True)


def _compile(engine: Engine) -> None:
    """The programs the first requests need now (`Engine.first_programs`), not in the middle of
    someone's stream: a bar on a terminal, a line per program in a log. The rest compile on the
    engine's compile thread once it serves (`Engine.compile_rest`)."""
    shapes, buckets = engine.first_programs()
    total, t0 = len(shapes) + len(buckets), time.perf_counter()
    later = engine.compilations() - total
    _say(
        f"serve: compiling {total} programs now (decode shapes {shapes}, prefill lengths {buckets}); "
        f"{later} more on a thread once serving"
    )
    if sys.stderr.isatty():
        with progress(desc="serve: compiling", unit="program", total=total) as bar:
            engine.compile(on_shape=bar.update, first_only=True)
        return
    done = [0]

    def line():
        done[0] += 1
        _say(f"serve: compiled {done[0]}/{total} ({time.perf_counter() - t0:.0f} s)")

    engine.compile(on_shape=line, first_only=True)


def serve(
    service: Service,
    *,
    host: str,
    port: int,
    api_key: str | None,
    max_body_bytes: int,
    admin_key: str | None = None,
    watch: str | None = None,
    watch_every: float = 10.0,
) -> int:
    """Run the HTTP server until it is told to stop (SIGTERM / SIGINT drain in-flight requests first).
    `watch`: a run directory whose newest verified checkpoint is swapped in (polled every `watch_every` s)."""
    import uvicorn

    app = create_app(service, api_key=api_key, max_body_bytes=max_body_bytes, admin_key=admin_key)
    if watch is not None:
        service.swapper.watch(watch, watch_every)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        service.swapper.stop()
        service.engine.stop()

    # The guard wraps the FastAPI app; the lifespan hook stops the engine once uvicorn has drained.
    app.app.router.lifespan_context = lifespan
    config = uvicorn.Config(app, host=host, port=port, log_level="info", access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    # uvicorn drains on SIGTERM / SIGINT, then re-raises the signal into the handler that was installed
    # before it; a no-op there makes a drained shutdown exit 0 instead of dying by the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 0 if service.engine.error is None else 1
