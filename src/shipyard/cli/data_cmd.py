"""shipyard data: the data stages one at a time, the whole chain (`prepare`), shard verification."""

from __future__ import annotations

import sys
from pathlib import Path

from shipyard.cli.args import command_group, fraction, positive_number, whole_number


def _cmd_data_bytes(args) -> int:
    from shipyard.data.bytecorpus import write_byte_tokens

    stats = write_byte_tokens(args.out, split=args.split, max_bytes=args.max_bytes)
    print(
        f"wrote {stats['tokens']:,} byte tokens from {stats['files']} stdlib files ({args.split}) to {args.out}"
    )
    return 0


def _cmd_data_stdlib(args) -> int:
    from shipyard.data.stdlib import write_stdlib_documents

    stats = write_stdlib_documents(args.out, overwrite=args.overwrite)
    train, val = stats["train"], stats["validation"]
    print(
        f"wrote {train['documents']} train and {val['documents']} validation documents "
        f"({(train['bytes'] + val['bytes']) / 1e6:.1f} MB) to {args.out}"
    )
    return 0


def _stage_common(args, schema, section: str | None = None):
    """(stage config, read config, workers: a count or a Ray cluster) from --config / --set / flags."""
    from shipyard.data.cluster import RayCluster
    from shipyard.data.configs import ReadConfig, build_schema, load_stage_config
    from shipyard.data.stage import default_workers

    cfg = load_stage_config(schema, args.config, args.set, f"data {args.data_command}")
    read = build_schema(
        ReadConfig,
        {"text_field": args.text_field, "max_bad_fraction": args.max_bad_fraction},
        f"data {args.data_command}",
    )
    if getattr(args, "ray", None):
        return cfg, read, RayCluster(args.ray)
    return cfg, read, getattr(args, "workers", None) or default_workers()


def location(text: str) -> str | Path:
    """An argparse type for paths that may be URLs: a URL stays a str (Path would fold its '//'),
    anything else is a Path. Unknown schemes are refused where the path is used (storage.check_scheme)."""
    return text if "://" in text else Path(text)


def _report_stage(args, stats: dict) -> int:
    from shipyard import storage
    from shipyard.data.prepare import describe

    print(f"{args.data_command}: {describe(stats)}")
    out = storage.redact(args.out)
    print(f"wrote {out} (stats in {storage.redact(storage.join(args.out, 'stats.json'))})")
    return 0


def _cmd_data_stage(args) -> int:
    from shipyard.data import configs

    if args.data_command == "extract":
        from shipyard.data.extract import run_extract as run

        cfg, read, workers = _stage_common(args, configs.ExtractConfig)
    elif args.data_command == "filter":
        from shipyard.data.filters import run_filter as run

        cfg, read, workers = _stage_common(args, configs.FilterConfig)
    elif args.data_command == "dedup":
        from shipyard.data.dedup import run_dedup as run

        cfg, read, workers = _stage_common(args, configs.DedupConfig)
    elif args.data_command == "decontaminate":
        from shipyard.data.decontaminate import run_decontaminate as run

        cfg, read, workers = _stage_common(args, configs.DecontaminateConfig)
        if args.eval:
            cfg = cfg.model_copy(update={"eval_sets": (*cfg.eval_sets, *map(str, args.eval))})
    else:
        raise AssertionError(args.data_command)
    return _report_stage(args, run(args.inputs, args.out, cfg, read, workers, args.overwrite))


def _cmd_data_tokenizer_train(args) -> int:
    from shipyard.data.configs import TokenizerTrainConfig
    from shipyard.data.tokenizer import run_tokenizer_train

    cfg, read, _ = _stage_common(args, TokenizerTrainConfig)
    return _report_stage(args, run_tokenizer_train(args.inputs, args.out, cfg, read, args.overwrite))


def _cmd_data_tokenize(args) -> int:
    from shipyard.data.configs import TokenizeConfig
    from shipyard.data.tokenize import run_tokenize

    cfg, read, workers = _stage_common(args, TokenizeConfig)
    return _report_stage(
        args, run_tokenize(args.inputs, args.out, args.tokenizer, cfg, read, workers, args.overwrite)
    )


def _cmd_data_classifier_train(args) -> int:
    from shipyard import storage
    from shipyard.data.classifier import run_classifier_train
    from shipyard.data.configs import ClassifierTrainConfig

    cfg, read, _ = _stage_common(args, ClassifierTrainConfig)
    report = run_classifier_train(args.positive, args.negative, args.out, cfg, read, args.overwrite)
    held, counts = report["held_out"], report["counts"]
    trained = ", ".join(f"{k} {v['train']:,} train / {v['held_out']:,} held out" for k, v in counts.items())
    if held["accuracy"] is None:
        print(f"classifier-train: {trained}; no held-out documents (held_out_fraction=0)")
    else:
        print(
            f"classifier-train: {trained}; held-out accuracy {held['accuracy']:.4f}, "
            f"precision {held['precision'] or 0:.4f}, recall {held['recall'] or 0:.4f}"
        )
    print(f"wrote {storage.redact(args.out)} (model.bin, report.json)")
    return 0


def _cmd_data_classify(args) -> int:
    from shipyard.data.classifier import run_classify
    from shipyard.data.configs import ClassifyConfig, build_schema

    cfg, read, workers = _stage_common(args, ClassifyConfig)
    flags = {
        k: v for k, v in (("threshold", args.threshold), ("top_fraction", args.top_fraction)) if v is not None
    }
    if flags:  # the flags override the config's rule (a config threshold and a --top-fraction flag: the flag)
        fields = {**cfg.model_dump(), "threshold": None, "top_fraction": None, **flags}
        cfg = build_schema(ClassifyConfig, fields, "data classify")
    return _report_stage(
        args, run_classify(args.inputs, args.out, args.model, cfg, read, workers, args.overwrite)
    )


def _cmd_data_prepare(args) -> int:
    from shipyard import storage
    from shipyard.data.configs import load_prepare_config
    from shipyard.data.prepare import run_prepare

    cfg = load_prepare_config(args.config, args.set)
    if args.ray:
        cfg = cfg.model_copy(update={"ray": args.ray})
    summary = run_prepare(cfg, overwrite=args.overwrite)
    print(f"train shards: {summary['train_shards']}")
    if "validation_shards" in summary:
        print(f"validation shards: {summary['validation_shards']}")
    print(f"tokenizer: {summary['tokenizer']}")
    print(f"summary: {storage.redact(storage.join(cfg.out, 'prepare.json'))} ({summary['seconds']:.1f} s)")
    return 0


def _cmd_data_verify(args) -> int:
    from shipyard import storage
    from shipyard.data.shards import verify_shards

    manifest = verify_shards(args.shards)
    print(
        f"ok: {len(manifest['shards'])} shard(s), {manifest['tokens']:,} tokens, "
        f"{manifest['documents']:,} documents match {storage.redact(storage.join(args.shards, 'manifest.json'))}"
    )
    return 0


INPUTS_HELP = (
    "document files or directories (jsonl[.gz|.zst], parquet, txt, html), or URLs of objects or prefixes"
)


def _stage_arguments(st) -> None:
    """The flags every data stage takes: --out, --config, --set, reading, --overwrite."""
    st.add_argument(
        "--out", type=location, required=True, help="output directory or URL (written atomically / published)"
    )
    st.add_argument("--config", type=Path, default=None, help="YAML file with this stage's settings")
    st.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one setting (repeatable)",
    )
    st.add_argument("--text-field", default="text", help="jsonl field / parquet column holding the text")
    st.add_argument(
        "--max-bad-fraction",
        type=fraction(),
        default=0.01,
        help="fail when more records than this are bad",
    )
    st.add_argument("--overwrite", action="store_true", help="replace an existing output directory")


def _register_classifier(data_sub) -> None:
    """`data classifier-train` and `data classify` (the fastText quality classifier)."""
    ct = data_sub.add_parser(
        "classifier-train", help="train a fastText quality classifier on positive vs. negative documents"
    )
    ct.add_argument("--positive", nargs="+", required=True, help="good documents: " + INPUTS_HELP)
    ct.add_argument("--negative", nargs="+", required=True, help="bad documents: " + INPUTS_HELP)
    _stage_arguments(ct)
    ct.set_defaults(func=_cmd_data_classifier_train)

    cl = data_sub.add_parser("classify", help="score documents with a quality classifier and keep the best")
    cl.add_argument("inputs", nargs="+", help=INPUTS_HELP)
    cl.add_argument(
        "--model", type=location, required=True, help="a `data classifier-train` output directory"
    )
    # Plain floats, checked by ClassifyConfig: the same one-line errors as --set threshold=...
    cl.add_argument("--threshold", type=float, default=None, help="keep scores >= T (default 0.5)")
    cl.add_argument(
        "--top-fraction", type=float, default=None, help="keep this fraction, highest scores first"
    )
    _worker_arguments(cl)
    _stage_arguments(cl)
    cl.set_defaults(func=_cmd_data_classify)


RAY_HELP = (
    "run the work units as tasks of the Ray cluster at ADDRESS (host:port; `local` starts one here) "
    "instead of local processes: the same output; inputs and --out on a shared filesystem or a bucket"
)


def _worker_arguments(parser) -> None:
    """--workers N or --ray ADDRESS: where a stage's units run."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--workers", type=whole_number(1), default=None, help="worker processes (default: every core)"
    )
    where.add_argument("--ray", metavar="ADDRESS", default=None, help=RAY_HELP)


def _cmd_data_plan(args) -> int:
    import json

    from shipyard.data.sizing import Cluster, Corpus, parse_amount, plan_data, rates_from_bench, render

    per_doc, per_token = args.bytes_per_document, args.bytes_per_token
    if args.bytes:
        total = parse_amount(args.bytes, "--bytes", "a size")
    elif args.documents:
        total = parse_amount(args.documents, "--documents", "a count") * per_doc
    else:
        total = parse_amount(args.tokens, "--tokens", "a count") * per_token
    corpus = Corpus(int(total), per_doc, per_token, args.duplicate_fraction)
    cluster = Cluster(
        args.nodes,
        args.cpus_per_node,
        int(parse_amount(args.memory_per_node, "--memory-per-node", "a size")),
        parse_amount(args.bandwidth_per_node, "--bandwidth-per-node", "a rate"),
    )
    result = plan_data(corpus, cluster, rates_from_bench(args.rates) if args.rates else None)
    sys.stdout.write(render(result) + "\n")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["fits"] else 6


def register(sub) -> None:
    """Add this group's subcommands to the `shipyard` parser's subparsers."""
    data_sub = command_group(sub, "data", "prepare data")
    by = data_sub.add_parser("bytes", help="write the stdlib corpus as byte-level tokens (.npy)")
    by.add_argument("--out", type=Path, required=True, help="output .npy path")
    by.add_argument("--split", choices=("train", "validation"), default="train")
    by.add_argument("--max-bytes", type=whole_number(1), default=None, help="stop after this many bytes")
    by.set_defaults(func=_cmd_data_bytes)

    sl = data_sub.add_parser(
        "stdlib", help="write the stdlib corpus as jsonl documents with a train/validation split"
    )
    sl.add_argument("--out", type=Path, required=True, help="output directory")
    sl.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    sl.set_defaults(func=_cmd_data_stdlib)

    _register_stages(data_sub)
    _register_classifier(data_sub)

    pr = data_sub.add_parser("prepare", help="run the whole data chain from one YAML config")
    pr.add_argument("config", type=Path, help="prepare config (see docs/data.md)")
    pr.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one setting")
    pr.add_argument("--overwrite", action="store_true", help="redo stages whose config or inputs changed")
    pr.add_argument("--ray", metavar="ADDRESS", default=None, help=RAY_HELP + " (the config's `ray`)")
    pr.set_defaults(func=_cmd_data_prepare)

    _register_plan(data_sub)

    ve = data_sub.add_parser("verify", help="check token shards against their manifest (sizes and sha256)")
    ve.add_argument("shards", type=location, help="token shard directory (or its URL)")
    ve.set_defaults(func=_cmd_data_verify)


def _register_stages(data_sub) -> None:
    """One subcommand per data stage (extract, filter, dedup, decontaminate, tokenizer-train, tokenize)."""
    stages = {
        "extract": "HTML to main-content text (resiliparse)",
        "filter": "heuristic quality filters (Gopher/C4 rules; prose and code profiles)",
        "dedup": "exact and fuzzy (MinHash + LSH) deduplication",
        "decontaminate": "drop documents sharing a 13-gram with evaluation sets",
        "tokenizer-train": "train a byte-level BPE tokenizer",
        "tokenize": "encode documents into token shards with a manifest",
    }
    for name, help_text in stages.items():
        st = data_sub.add_parser(name, help=help_text)
        st.add_argument("inputs", nargs="+", help=INPUTS_HELP)
        _stage_arguments(st)
        if name != "tokenizer-train":
            _worker_arguments(st)
        if name == "decontaminate":
            st.add_argument(
                "--eval", type=location, action="append", default=[], help="evaluation set (repeatable)"
            )
        if name == "tokenize":
            st.add_argument(
                "--tokenizer",
                type=location,
                required=True,
                help="tokenizer.json or a directory holding one (or their URL)",
            )
        func = {"tokenizer-train": _cmd_data_tokenizer_train, "tokenize": _cmd_data_tokenize}.get(
            name, _cmd_data_stage
        )
        st.set_defaults(func=func)


def _register_plan(data_sub) -> None:
    """`data plan`: a corpus size, the nodes it runs on, and the rates to assume."""
    pl = data_sub.add_parser(
        "plan",
        help="estimate each stage's units, shuffled bytes, memory, requests and wall time for a corpus "
        "size on N nodes (also `shipyard plan data`)",
    )
    size = pl.add_mutually_exclusive_group(required=True)
    size.add_argument("--bytes", help="corpus size in text bytes (e.g. 10TB)")
    size.add_argument("--documents", help="corpus size in documents (e.g. 2.5B)")
    size.add_argument("--tokens", help="corpus size in tokens (e.g. 15T)")
    pl.add_argument("--nodes", type=whole_number(1), required=True, help="worker nodes")
    pl.add_argument("--cpus-per-node", type=whole_number(1), default=64, help="cores per node (default 64)")
    pl.add_argument("--memory-per-node", default="256GiB", help="memory per node (default 256GiB)")
    pl.add_argument(
        "--bandwidth-per-node", default="1.25GB", help="storage bytes/s per node (default 1.25GB: 10 Gb/s)"
    )
    pl.add_argument("--bytes-per-document", type=positive_number(), default=4500.0, help="default 4500")
    pl.add_argument("--bytes-per-token", type=positive_number(), default=4.2, help="default 4.2")
    pl.add_argument(
        "--duplicate-fraction", type=fraction(), default=0.3, help="documents with a near-duplicate (0.3)"
    )
    pl.add_argument(
        "--rates", type=Path, help="a bench/data_throughput.py JSON of your machine (per-core MB/s)"
    )
    pl.add_argument("--json", type=Path, help="also write the plan as JSON here")
    pl.set_defaults(func=_cmd_data_plan)
