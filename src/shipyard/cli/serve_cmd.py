"""shipyard serve: an OpenAI-compatible HTTP server for a model directory."""

from __future__ import annotations

import logging
import sys

from shipyard.cli.args import add_model_dir, add_quantize_flags, add_template_flag
from shipyard.errors import ConfigError


def _cmd_serve(args) -> int:
    from shipyard.inference.service import enable_compile_cache, load_service, serve

    if not 0 <= args.port <= 65535:
        raise ConfigError(f"serve: --port {args.port} is not a TCP port (0..65535)")
    if args.max_body_mb <= 0:
        raise ConfigError(f"serve: --max-body-mb must be positive, got {args.max_body_mb}")
    if args.api_key is not None and not args.api_key.strip():
        raise ConfigError("serve: --api-key is empty; give a key or leave the flag out")
    if args.admin_key is not None and not args.admin_key.strip():
        raise ConfigError("serve: --admin-key is empty; give a key or leave the flag out")
    if args.admin_key is not None and args.admin_key == args.api_key:
        raise ConfigError("serve: --admin-key must differ from --api-key (every client holds the API key)")
    if not args.watch_every > 0:
        raise ConfigError(f"serve: --watch-every must be positive seconds, got {args.watch_every}")
    watch = args.run_dir if args.watch is True else args.watch
    if watch is not None:  # before minutes of loading and compiling
        from shipyard.run.model_dir import open_model_dir

        if open_model_dir(watch, "serve --watch").kind != "run":
            raise ConfigError(
                f"serve --watch: {watch} is not a run directory (it has no checkpoints to watch)"
            )
    cache = enable_compile_cache(args.compile_cache)
    # the request log (one line per request); libraries below stay at warnings
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("shipyard.serve").setLevel(logging.INFO)
    service = load_service(
        args.run_dir,
        name=args.model_name,
        step=args.step,
        tokenizer=args.tokenizer,
        template=args.template,
        max_batch=args.max_batch,
        max_len=args.max_len,
        quantize=args.quantize,
        kv_dtype=args.kv_dtype,
        tokens_per_call=args.tokens_per_call,
        fixed_shape=args.fixed_shape,
        tool_parser=args.tool_parser,
        prefix_cache=args.prefix_cache,
        prefill_chunk=args.prefill_chunk,
        speculate=args.speculate,
        draft_model=args.draft_model,
    )
    if cache:
        print(
            f"serve: compiled programs cached in {cache} (a restart loads them instead of compiling; "
            "--compile-cache off)",
            file=sys.stderr,
        )
    key = "required (Bearer)" if args.api_key else "none (anyone who can reach the port may use it)"
    swaps = "POST /admin/swap with --admin-key" if args.admin_key else "off (no --admin-key)"
    watching = f", watching {watch} every {args.watch_every:g} s" if watch else ""
    print(
        f"serving {service.name!r} on http://{args.host}:{args.port}/v1 (max batch {service.engine.max_batch}, "
        f"context {service.engine.max_len} tokens, chat {'yes' if service.chat else 'no'}, API key {key}, "
        f"weights {service.engine.fingerprint}, swaps {swaps}{watching})",
        file=sys.stderr,
        flush=True,
    )
    return serve(
        service,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        max_body_bytes=int(args.max_body_mb * (1 << 20)),
        admin_key=args.admin_key,
        watch=watch,
        watch_every=args.watch_every,
    )


def register(sub) -> None:
    """Add this group's subcommands to the `shipyard` parser's subparsers."""
    sv = sub.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API (continuous batching)"
    )
    add_model_dir(sv)
    _add_server_flags(sv)
    _add_engine_flags(sv)
    sv.add_argument("--max-body-mb", type=float, default=1.0, help="refuse request bodies above this size")
    sv.add_argument(
        "--compile-cache",
        default=None,
        metavar="DIR|off",
        help="keep compiled programs here so a restart skips compiling (default: $JAX_COMPILATION_CACHE_DIR, "
        "else ~/.cache/shipyard/xla; off: compile every start)",
    )
    add_template_flag(sv, "chat template (default: the one the run trained with, else the model's own)")
    sv.add_argument(
        "--tool-parser",
        choices=("auto", "hermes", "llama3_json", "mistral", "none"),
        default="auto",
        help="the tool-call format replies are read in for chat requests with tools (default auto: from "
        "the chat template; none: tool_choice auto is refused)",
    )
    add_quantize_flags(sv)
    sv.set_defaults(func=_cmd_serve)


def _add_server_flags(sv) -> None:
    """Where the server listens, who may use it, the --watch run and the model's name in the API."""
    sv.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every request")
    sv.add_argument(
        "--admin-key",
        default=None,
        help="open /admin/swap and /admin/weights to requests with 'Authorization: Bearer KEY' (default: off)",
    )
    sv.add_argument(
        "--watch",
        nargs="?",
        const=True,
        default=None,
        metavar="RUN",
        help="swap in RUN's newest verified checkpoint as training writes it (RUN defaults to the served run)",
    )
    sv.add_argument(
        "--watch-every",
        type=float,
        default=10.0,
        help="seconds between looks at the --watch run (default 10)",
    )
    sv.add_argument(
        "--model-name", default=None, help="the model's name in the API (default: the directory's)"
    )


def _add_engine_flags(sv) -> None:
    """The engine's shape and shortcuts: cache rows and slots, steps per call, prefix cache, speculation."""
    sv.add_argument("--max-batch", type=int, default=8, help="requests decoded together (cache rows)")
    sv.add_argument(
        "--max-len",
        type=int,
        default=None,
        help="cache slots per row: prompt + reply (default: the model's context)",
    )
    sv.add_argument("--tokens-per-call", type=int, default=8, help="decode steps per device call")
    sv.add_argument(
        "--fixed-shape",
        action="store_true",
        help="decode every call over all --max-batch rows and --max-len slots: greedy output bitwise "
        "independent of other requests (default: calls sized to the busy rows, faster for few)",
    )
    sv.add_argument(
        "--prefix-cache",
        type=int,
        default=None,
        metavar="N",
        help="keep the keys and values of recent prompts' blocks (room for N prompts of up to 2,048 "
        "tokens; a block shared by several prompts is kept once), so a prompt that starts as one of them "
        "computes only the rest, with the same result bit for bit (default 2; 0: off)",
    )
    sv.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        metavar="T",
        help="prefill prompts in pieces of T tokens, the prefix cache's block size: smaller reuses more of "
        "a partly shared prompt, larger makes fewer, larger products (default 128)",
    )
    sv.add_argument(
        "--speculate",
        type=int,
        default=None,
        metavar="K",
        help="replies guess K tokens a call (from their own context, or --draft-model's) and keep what "
        "the model agrees with: the same text, sampled replies the same distribution, faster where the "
        "guesses are good (default: 4 with --draft-model, else 0: off)",
    )
    sv.add_argument(
        "--draft-model",
        default=None,
        metavar="DIR",
        help="a smaller model directory with the same tokenizer that makes the guesses (default: prompt "
        "lookup, the tokens that followed the reply's last few tokens earlier in its context)",
    )
