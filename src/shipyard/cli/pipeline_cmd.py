"""shipyard run, quickstart, reproduce, report: pipelines and run reports."""

from __future__ import annotations

from pathlib import Path


def _cmd_run(args) -> int:
    from shipyard.experiment.executor import run_pipeline

    run_pipeline(args.pipeline, tuple(args.force), args.dry_run, args.root, ray_address=args.ray)
    return 0


def _cmd_quickstart(args) -> int:
    import json
    from importlib import resources

    from shipyard.experiment.executor import fetch_output, run_pipeline
    from shipyard.storage import redact

    pipeline = resources.files("shipyard").joinpath("pipelines", "quickstart.yaml")
    planned = {p.step.name: p for p in run_pipeline(str(pipeline), dry_run=args.dry_run, root=args.root)}
    if args.dry_run:
        return 0
    # with a bucket root these two come from the bucket when this machine has no copy
    ev = json.loads((fetch_output(planned["eval"]) / "eval.json").read_text())
    held, base = ev["domains"]["heldout"], ev.get("unigram_baseline", {})
    sample = json.loads((fetch_output(planned["sample"]) / "sample.json").read_text())
    print("\nquickstart: every step's output, provenance.json and _SUCCESS are under", redact(args.root))
    for name in ("tokens-train", "train", "eval", "export", "report"):
        print(f"  {name:<13} {planned[name].location}")
    print(
        f"held-out: {held['bits_per_byte']:.3f} bits/byte (loss {held['loss']:.3f} nats/token); "
        f"unigram baseline {base.get('bits_per_byte', float('nan')):.3f} bits/byte "
        f"({1 - ev.get('bits_per_byte_vs_unigram', 1):.0%} below)"
    )
    print(f"sample: {sample['prompt']!r} -> {sample['completion']!r}")
    return 0


def _cmd_reproduce(args) -> int:
    from shipyard.experiment.executor import reproduce

    results = reproduce(args.output_dir, args.root)
    same = sum(r["identical"] for r in results)
    print(f"reproduce: {same} of {len(results)} steps identical")
    return 0 if same == len(results) else 7


def _cmd_report(args) -> int:
    from shipyard.run.report import write_report

    out = write_report(args.run_dir)
    print(f"wrote {out}")
    return 0


def register(sub) -> None:
    """Add this group's subcommands to the `shipyard` parser's subparsers."""
    ru = sub.add_parser("run", help="run a pipeline file: content-addressed steps, done ones skipped")
    ru.add_argument("pipeline", type=Path, help="pipeline YAML (root + steps)")
    ru.add_argument("--dry-run", action="store_true", help="print each step's status and why it would run")
    ru.add_argument(
        "--force", action="append", default=[], metavar="STEP", help="rerun this step (repeatable)"
    )
    ru.add_argument(
        "--root",
        help="output root instead of the file's `root`: a directory or a bucket (s3://bucket/prefix)",
    )
    ru.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="run the steps as Ray tasks on this cluster (`local` starts one here); the root must be shared storage",
    )
    ru.set_defaults(func=_cmd_run)

    qs = sub.add_parser(
        "quickstart",
        help="the whole pipeline on the embedded stdlib corpus: data, tokenizer, train, eval, export",
    )
    qs.add_argument(
        "--root",
        default="runs/quickstart",
        help="output root, a directory or a bucket (s3://bucket/prefix) (default runs/quickstart)",
    )
    qs.add_argument("--dry-run", action="store_true", help="print what would run and why")
    qs.set_defaults(func=_cmd_quickstart)

    rp = sub.add_parser(
        "reproduce", help="rerun the recorded steps behind a pipeline output and compare hashes"
    )
    rp.add_argument("output_dir", help="a finished step's directory or bucket prefix (holds provenance.json)")
    rp.add_argument(
        "--root", required=True, help="a fresh directory or bucket prefix (s3://...) to rerun into"
    )
    rp.set_defaults(func=_cmd_reproduce)

    rep = sub.add_parser("report", help="plot a run's metrics and write report.md")
    rep.add_argument("run_dir", type=Path)
    rep.set_defaults(func=_cmd_report)
