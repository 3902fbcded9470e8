"""The `shipyard` command: build the parser from the command groups, dispatch, and turn errors into
one line and an exit code (tracebacks only with --debug)."""

from __future__ import annotations

import os
import sys

from shipyard.cli import (
    browse_cmd,
    config_cmd,
    data_cmd,
    eval_cmd,
    inference_cmd,
    interop_cmd,
    pipeline_cmd,
    plan_cmd,
    rl_cmd,
    serve_cmd,
    train_cmd,
)
from shipyard.cli.args import Parser
from shipyard.errors import ShipyardError

# The order `shipyard --help` lists them in.
GROUPS = (
    config_cmd,
    train_cmd,
    data_cmd,
    interop_cmd,
    inference_cmd,
    serve_cmd,
    eval_cmd,
    rl_cmd,
    plan_cmd,
    pipeline_cmd,
    browse_cmd,
)


def build_parser() -> Parser:
    p = Parser(prog="shipyard", description="Train, evaluate and export language models in JAX.")
    p.add_argument("--debug", action="store_true", help="show full tracebacks on error")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for group in GROUPS:
        group.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["plan", "data"]:  # `plan` takes a model config; the data plan lives under `data`
        argv = ["data", "plan", *argv[2:]]
    debug = "--debug" in argv
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        # argparse stops collecting positional overrides at the first flag;
        # `train tiny --overwrite train.steps=5` must still take train.steps=5.
        overrides = [a for a in extra if "=" in a and not a.startswith("-")]
        unknown = [a for a in extra if a not in overrides]
        if unknown or (overrides and not hasattr(args, "overrides")):
            parser.error(f"unrecognized arguments: {' '.join(unknown or overrides)}")
        if overrides:
            args.overrides = [*args.overrides, *overrides]
        return args.func(args)
    except ShipyardError as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:
        # A file-system problem (permissions, full disk, missing directory) is
        # the user's to fix, not a bug: one line, like every other input error.
        if debug:
            raise
        where = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    from shipyard import cpu_tuning

    cpu_tuning.reexec_with_fast_allocator()
    # XLA reads its flags once, when the backend starts: set them before that.
    cpu_tuning.apply_xla_flags()
    cpu_tuning.pin_cpu_platform()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())


if __name__ == "__main__":
    entry()
