"""shipyard eval: held-out loss / perplexity / bits-per-byte and tasks."""

from __future__ import annotations

from pathlib import Path

from shipyard.cli.args import add_model_dir, add_quantize_flags, whole_number
from shipyard.errors import ConfigError


def _cmd_eval(args) -> int:
    import json

    from shipyard.eval.evaluate import run_eval

    domains = {}
    for item in args.tokens:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"eval --tokens {item!r}: expected NAME=SHARD_DIR")
        domains[name] = path
    tasks = []
    for item in args.task:
        kind, sep, path = item.partition(":")
        if not sep:
            raise ConfigError(
                f"eval --task {item!r}: expected mc:FILE.jsonl, cloze:FILE.jsonl or chat:FILE.jsonl"
            )
        tasks.append((kind, path))
    report = run_eval(
        args.run_dir, domains, tasks, args.max_sequences, args.step, args.tokenizer, quantize=args.quantize
    )
    from shipyard import storage
    from shipyard.output import write_atomic
    from shipyard.run.model_dir import open_model_dir

    out = args.out
    if out is None and open_model_dir(args.run_dir, "eval").kind == "run":
        # an import or HF directory is read, never written into; a run URL gets it in the bucket
        out = storage.join(args.run_dir, "eval.json")
    if out is not None:
        text = json.dumps(report.to_json(), indent=2) + "\n"
        if storage.is_url(out):
            storage.write_bytes(str(out), text.encode())  # one PUT: whole or absent
        else:
            write_atomic(Path(out), text)
    for name, m in report.domains.items():
        bpb = f", {m.bits_per_byte:.4f} bits/byte" if m.bits_per_byte else ""
        print(f"{name}: loss {m.loss:.4f}, perplexity {m.perplexity:.2f}{bpb} ({m.tokens:,} tokens)")
    for name, m in report.tasks.items():
        print(
            f"{name}: "
            + ", ".join(
                f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                for k, v in m.items()
                if not isinstance(v, (list, dict))  # examples stay in the JSON report
            )
        )
    print(f"wrote {out}" if out is not None else "(report not written: give --out FILE)")
    return 0


def register(sub) -> None:
    """Add this group's subcommands to the `shipyard` parser's subparsers."""
    ev = sub.add_parser("eval", help="held-out loss / perplexity / bits-per-byte and log-likelihood tasks")
    add_model_dir(ev)
    ev.add_argument(
        "--tokens", action="append", default=[], metavar="NAME=DIR", help="a held-out token-shard set"
    )
    ev.add_argument(
        "--task",
        action="append",
        default=[],
        metavar="KIND:FILE",
        help="mc:FILE.jsonl, cloze:FILE.jsonl or chat:FILE.jsonl (exact match of the last assistant reply)",
    )
    ev.add_argument(
        "--max-sequences", type=whole_number(1), default=64, help="sequences scored per token set"
    )
    ev.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON report (default: <run>/eval.json for a run; imports and HF directories are not written into)",
    )
    add_quantize_flags(ev, kv_cache=False)
    ev.set_defaults(func=_cmd_eval)
