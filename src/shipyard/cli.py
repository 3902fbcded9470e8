"""The `shipyard` command: parse, dispatch, turn errors into one line and an exit code."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from shipyard.errors import ConfigError, ShipyardError


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr with exit code 2, like every other input error."""

    def error(self, message: str):
        raise ConfigError(f"{self.prog}: {message} (see `{self.prog} --help`)")


def _human(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def _cmd_config_show(args) -> int:
    from shipyard.config import load_config, to_yaml
    from shipyard.model.transformer import num_active_params, num_params
    from shipyard.train.metrics import flops_per_token

    cfg = load_config(args.config, args.overrides)
    sys.stdout.write(to_yaml(cfg))
    total, active = num_params(cfg.model), num_active_params(cfg.model)
    sys.stdout.write(f"# parameters: {total} ({_human(total)})\n")
    sys.stdout.write(f"# active parameters per token: {active} ({_human(active)})\n")
    if cfg.train.finetune is not None:
        from shipyard.model.params import count_params
        from shipyard.train.finetune import Partition

        trained = count_params(Partition(cfg.model, cfg.train.finetune).trainable_specs())
        sys.stdout.write(
            f"# trainable parameters (train.finetune): {trained} ({_human(trained)}, {trained / total:.2%})\n"
        )
    flops = flops_per_token(cfg.model, cfg.data.seq_len)
    sys.stdout.write(f"# training FLOPs per token at seq_len {cfg.data.seq_len}: {flops:.4g}\n")
    return 0


def _cmd_plan(args) -> int:
    import json
    from dataclasses import replace

    from shipyard.config import load_config
    from shipyard.plan import DEVICES, parse_bytes, parse_mesh, plan, render

    cfg = load_config(args.config, args.overrides)
    sizes = parse_mesh(args.mesh)
    device = DEVICES[args.device]
    if args.device_memory:
        device = replace(device, memory_bytes=parse_bytes(args.device_memory))
    if not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu: {args.mfu} is not a fraction; expected 0 < mfu <= 1, e.g. 0.4")
    if args.compile_layers is not None and args.compile_layers < 1:
        raise ConfigError(f"--compile-layers: {args.compile_layers}; expected a positive number of layers")
    result = plan(cfg, sizes, device, args.tokens, args.mfu, args.compile_layers, not args.analytic_only)
    sys.stdout.write(render(result) + "\n")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["fits"] else 6


def _cmd_run(args) -> int:
    from shipyard.pipeline.executor import run_pipeline

    run_pipeline(args.pipeline, tuple(args.force), args.dry_run, args.root, ray_address=args.ray)
    return 0


def _cmd_quickstart(args) -> int:
    import json
    from importlib import resources

    from shipyard.pipeline.executor import run_pipeline

    pipeline = resources.files("shipyard").joinpath("pipelines", "quickstart.yaml")
    planned = {p.step.name: p for p in run_pipeline(str(pipeline), dry_run=args.dry_run, root=args.root)}
    if args.dry_run:
        return 0
    ev = json.loads((planned["eval"].out / "eval.json").read_text())
    held, base = ev["domains"]["heldout"], ev.get("unigram_baseline", {})
    sample = json.loads((planned["sample"].out / "sample.json").read_text())
    print("\nquickstart: every step's output, provenance.json and _SUCCESS are under", args.root)
    for name in ("tokens-train", "train", "eval", "export", "report"):
        print(f"  {name:<13} {planned[name].out}")
    print(
        f"held-out: {held['bits_per_byte']:.3f} bits/byte (loss {held['loss']:.3f} nats/token); "
        f"unigram baseline {base.get('bits_per_byte', float('nan')):.3f} bits/byte "
        f"({1 - ev.get('bits_per_byte_vs_unigram', 1):.0%} below)"
    )
    print(f"sample: {sample['prompt']!r} -> {sample['completion']!r}")
    return 0


def _cmd_reproduce(args) -> int:
    from shipyard.pipeline.executor import reproduce

    results = reproduce(args.output_dir, args.root)
    same = sum(r["identical"] for r in results)
    print(f"reproduce: {same} of {len(results)} steps identical")
    return 0 if same == len(results) else 7


def _cmd_train(args) -> int:
    from shipyard.config import load_config

    cfg = load_config(args.config, args.overrides)
    from shipyard.train.trainer import train

    profile = None
    if args.profile_steps is not None:
        a, sep, b = args.profile_steps.partition(":")
        if not (sep and a.isdigit() and b.isdigit() and int(a) <= int(b) < cfg.train.steps):
            raise ConfigError(
                f"--profile-steps: {args.profile_steps!r}; expected A:B with 0 <= A <= B < train.steps={cfg.train.steps}"
            )
        profile = (int(a), int(b))
    train(
        cfg,
        run_dir=args.run_dir,
        overwrite=args.overwrite,
        resume=args.resume,
        debug_nans=args.debug_nans,
        profile_steps=profile,
    )
    return 0


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
    """(stage config, read config, workers) from --config / --set / flags."""
    from shipyard.data.configs import ReadConfig, build_schema, load_stage_config
    from shipyard.data.stage import default_workers

    cfg = load_stage_config(schema, args.config, args.set, f"data {args.data_command}")
    read = build_schema(
        ReadConfig,
        {"text_field": args.text_field, "max_bad_fraction": args.max_bad_fraction},
        f"data {args.data_command}",
    )
    return cfg, read, getattr(args, "workers", None) or default_workers()


def _report_stage(args, stats: dict) -> int:
    from shipyard.data.prepare import describe

    print(f"{args.data_command}: {describe(stats)}")
    print(f"wrote {args.out} (stats in {args.out / 'stats.json'})")
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


def _cmd_data_prepare(args) -> int:
    from shipyard.data.configs import load_prepare_config
    from shipyard.data.prepare import run_prepare

    cfg = load_prepare_config(args.config, args.set)
    summary = run_prepare(cfg, overwrite=args.overwrite)
    print(f"train shards: {summary['train_shards']}")
    if "validation_shards" in summary:
        print(f"validation shards: {summary['validation_shards']}")
    print(f"tokenizer: {summary['tokenizer']}")
    print(f"summary: {Path(cfg.out) / 'prepare.json'} ({summary['seconds']:.1f} s)")
    return 0


def _cmd_data_verify(args) -> int:
    from shipyard.data.shards import verify_shards

    manifest = verify_shards(args.shards)
    print(
        f"ok: {len(manifest['shards'])} shard(s), {manifest['tokens']:,} tokens, "
        f"{manifest['documents']:,} documents match {args.shards / 'manifest.json'}"
    )
    return 0


def _cmd_launch(args) -> int:
    from shipyard.config import load_config
    from shipyard.parallel.launch import launch_local, launch_ray

    load_config(args.config, args.overrides)  # a bad config fails here, once, not in every process
    train_args = [args.config, *args.overrides]
    if args.run_dir is not None:
        train_args += ["--run-dir", str(args.run_dir)]
    train_args += [flag for flag, on in (("--resume", args.resume), ("--overwrite", args.overwrite)) if on]
    if args.ray:
        return launch_ray(args.ray, args.processes, train_args, args.devices_per_process)
    if args.processes is None:
        raise ConfigError("launch: give --processes N (local) or --ray ADDRESS")
    return launch_local(args.processes, train_args, args.devices_per_process)


def _cmd_export_hf(args) -> int:
    from shipyard.interop.hf import export_hf

    info = export_hf(args.run_dir, args.out, args.step, int(args.max_shard_gb * (1 << 30)))
    tok = (
        f", tokenizer from {info['tokenizer']}"
        if info["tokenizer"]
        else " (no tokenizer found next to the run's data)"
    )
    print(
        f"exported checkpoint {info['step']} of {args.run_dir} to {args.out}: {', '.join(info['files'])}{tok}"
    )
    return 0


def _cmd_export_peft(args) -> int:
    from shipyard.interop.peft import export_peft

    info = export_peft(args.run_dir, args.out, args.step, args.base)
    print(
        f"exported the LoRA adapters of checkpoint {info['step']} of {args.run_dir} to {args.out} "
        f"({info['tensors']} tensors on {', '.join(info['targets'])}); load with peft.PeftModel.from_pretrained("
        f"<the base exported with `shipyard export hf`>, {str(args.out)!r})"
    )
    return 0


def _cmd_chat(args) -> int:
    from shipyard.chat import load_chat_model, run_chat

    model = load_chat_model(args.run_dir, args.step, args.template)
    return run_chat(
        model,
        system=args.system,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )


def _cmd_import_hf(args) -> int:
    from shipyard.interop.hf import import_hf

    info = import_hf(args.hf_dir, args.out)
    print(
        f"imported {args.hf_dir}: params in {info['params']}; train from it with `shipyard train {info['config']} data.train_tokens=...`"
    )
    return 0


def _cmd_generate(args) -> int:
    from shipyard.data.tokenizer import load_tokenizer, special_token_ids
    from shipyard.errors import DataError
    from shipyard.generate import Generator
    from shipyard.interop.hf import _tokenizer_of, load_run_params

    cfg, step, params = load_run_params(args.run_dir, args.step)
    tok_dir = _tokenizer_of(cfg, args.run_dir)
    if tok_dir is None:
        raise DataError(
            f"generate: no tokenizer.json next to the training data of {args.run_dir}; train on token shards"
        )
    tok = load_tokenizer(tok_dir)
    eos = special_token_ids(tok_dir, tok)["eos_token"]
    prompts = [tok.encode(p, add_special_tokens=False).ids or [eos] for p in args.prompt]

    def stop(tokens: list[int]) -> bool:
        return bool(args.stop) and any(s in tok.decode(tokens, skip_special_tokens=False) for s in args.stop)

    outs = Generator(params, cfg.model)(
        prompts,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_ids=(eos,),
        stop=stop,
    )
    for prompt, out in zip(args.prompt, outs):
        text = tok.decode([t for t in out if t != eos], skip_special_tokens=False)
        for s in args.stop:
            if s in text:
                text = text[: text.index(s)]
        print(f"--- {prompt!r}\n{prompt}{text}")
    return 0


def _cmd_eval(args) -> int:
    import json

    from shipyard.evaluate import run_eval

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
    report = run_eval(args.run_dir, domains, tasks, args.max_sequences, args.step)
    out = args.out or args.run_dir / "eval.json"
    from shipyard.train.rundir import write_atomic

    write_atomic(Path(out), json.dumps(report, indent=2) + "\n")
    for name, m in report["domains"].items():
        bpb = f", {m['bits_per_byte']:.4f} bits/byte" if m["bits_per_byte"] else ""
        print(f"{name}: loss {m['loss']:.4f}, perplexity {m['perplexity']:.2f}{bpb} ({m['tokens']:,} tokens)")
    for name, m in report["tasks"].items():
        print(
            f"{name}: "
            + ", ".join(
                f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                for k, v in m.items()
                if not isinstance(v, (list, dict))  # examples stay in the JSON report
            )
        )
    print(f"wrote {out}")
    return 0


def _cmd_report(args) -> int:
    from shipyard.report import write_report

    out = write_report(args.run_dir)
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="shipyard", description="Train, evaluate and export language models in JAX.")
    p.add_argument("--debug", action="store_true", help="show full tracebacks on error")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    cfg = sub.add_parser("config", help="inspect configs")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True, parser_class=_Parser)
    show = cfg_sub.add_parser(
        "show", help="print the resolved config as YAML, ending with the parameter count"
    )
    show.add_argument("config", help="preset name or YAML file")
    show.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.optimizer.lr=3e-4")
    show.set_defaults(func=_cmd_config_show)

    tr = sub.add_parser("train", help="train a model")
    tr.add_argument("config", help="preset name or YAML file")
    tr.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100")
    tr.add_argument(
        "--run-dir", type=Path, default=None, help="run directory (default: run.out_dir/run.name)"
    )
    tr.add_argument("--overwrite", action="store_true", help="replace an existing run in the run directory")
    tr.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in the run directory from its newest usable checkpoint (start it if there is none)",
    )
    tr.add_argument(
        "--profile-steps",
        metavar="A:B",
        help="record a JAX profiler trace of steps A..B (inclusive) into <run>/profile",
    )
    tr.add_argument(
        "--debug-nans",
        action="store_true",
        help="turn on JAX NaN and Inf checking (slow): the first operation producing one raises, with its traceback",
    )
    tr.set_defaults(func=_cmd_train)

    la = sub.add_parser("launch", help="run `train` as one JAX cluster of several processes (local or Ray)")
    la.add_argument("config", help="preset name or YAML file")
    la.add_argument("overrides", nargs="*", help="dotted overrides, passed to every process")
    la.add_argument("--processes", type=int, default=None, help="number of processes (local: required)")
    la.add_argument(
        "--ray", default=None, metavar="ADDRESS", help="Ray cluster address (e.g. auto or host:6379)"
    )
    la.add_argument(
        "--devices-per-process", type=int, default=None, help="CPU testing: host devices each process exposes"
    )
    la.add_argument("--run-dir", type=Path, default=None, help="run directory (shared by all processes)")
    la.add_argument("--resume", action="store_true", help="continue from the newest usable checkpoint")
    la.add_argument("--overwrite", action="store_true", help="replace an existing run")
    la.set_defaults(func=_cmd_launch)

    data = sub.add_parser("data", help="prepare data")
    data_sub = data.add_subparsers(dest="data_command", required=True, parser_class=_Parser)
    by = data_sub.add_parser("bytes", help="write the stdlib corpus as byte-level tokens (.npy)")
    by.add_argument("--out", type=Path, required=True, help="output .npy path")
    by.add_argument("--split", choices=("train", "validation"), default="train")
    by.add_argument("--max-bytes", type=int, default=None, help="stop after this many bytes")
    by.set_defaults(func=_cmd_data_bytes)

    sl = data_sub.add_parser(
        "stdlib", help="write the stdlib corpus as jsonl documents with a train/validation split"
    )
    sl.add_argument("--out", type=Path, required=True, help="output directory")
    sl.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    sl.set_defaults(func=_cmd_data_stdlib)

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
        st.add_argument(
            "inputs", nargs="+", help="document files or directories (jsonl[.gz|.zst], parquet, txt, html)"
        )
        st.add_argument("--out", type=Path, required=True, help="output directory (written atomically)")
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
            "--max-bad-fraction", type=float, default=0.01, help="fail when more records than this are bad"
        )
        st.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
        if name != "tokenizer-train":
            st.add_argument(
                "--workers", type=int, default=None, help="worker processes (default: every core)"
            )
        if name == "decontaminate":
            st.add_argument(
                "--eval", type=Path, action="append", default=[], help="evaluation set (repeatable)"
            )
        if name == "tokenize":
            st.add_argument(
                "--tokenizer", type=Path, required=True, help="tokenizer.json or a directory holding one"
            )
        func = {"tokenizer-train": _cmd_data_tokenizer_train, "tokenize": _cmd_data_tokenize}.get(
            name, _cmd_data_stage
        )
        st.set_defaults(func=func)

    pr = data_sub.add_parser("prepare", help="run the whole data chain from one YAML config")
    pr.add_argument("config", type=Path, help="prepare config (see docs/data.md)")
    pr.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one setting")
    pr.add_argument("--overwrite", action="store_true", help="redo stages whose config or inputs changed")
    pr.set_defaults(func=_cmd_data_prepare)

    ve = data_sub.add_parser("verify", help="check token shards against their manifest (sizes and sha256)")
    ve.add_argument("shards", type=Path, help="token shard directory")
    ve.set_defaults(func=_cmd_data_verify)

    ex = sub.add_parser("export", help="export a run's checkpoint to another format")
    ex_sub = ex.add_subparsers(dest="export_command", required=True, parser_class=_Parser)
    exh = ex_sub.add_parser(
        "hf", help="Hugging Face Llama directory (config.json, model.safetensors, tokenizer)"
    )
    exh.add_argument("run_dir", type=Path, help="run directory holding checkpoints/")
    exh.add_argument("out", type=Path, help="output directory (must not exist)")
    exh.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    exh.add_argument("--max-shard-gb", type=float, default=5.0, help="split safetensors above this size")
    exh.set_defaults(func=_cmd_export_hf)
    exp = ex_sub.add_parser(
        "peft", help="a LoRA run's adapters as a PEFT directory (adapter_config.json + safetensors)"
    )
    exp.add_argument("run_dir", type=Path, help="a run trained with train.finetune.lora")
    exp.add_argument("out", type=Path, help="output directory (must not exist)")
    exp.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    exp.add_argument(
        "--base",
        default=None,
        help="recorded as base_model_name_or_path (the exported base model's directory)",
    )
    exp.set_defaults(func=_cmd_export_peft)

    im = sub.add_parser("import", help="import a checkpoint from another format")
    im_sub = im.add_subparsers(dest="import_command", required=True, parser_class=_Parser)
    imh = im_sub.add_parser(
        "hf", help="Hugging Face Llama/Mistral safetensors directory -> params + config.yaml"
    )
    imh.add_argument("hf_dir", type=Path, help="directory with config.json and *.safetensors")
    imh.add_argument("out", type=Path, help="output directory (must not exist)")
    imh.set_defaults(func=_cmd_import_hf)

    ge = sub.add_parser("generate", help="complete prompts with a trained run (KV cache, batched)")
    ge.add_argument("run_dir", type=Path, help="run directory (its newest checkpoint unless --step)")
    ge.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    ge.add_argument("--max-new-tokens", type=int, default=64)
    ge.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ge.add_argument("--top-k", type=int, default=None)
    ge.add_argument("--top-p", type=float, default=None)
    ge.add_argument("--seed", type=int, default=0)
    ge.add_argument("--stop", action="append", default=[], help="stop when this text appears (repeatable)")
    ge.add_argument("--step", type=int, default=None, help="checkpoint step")
    ge.set_defaults(func=_cmd_generate)

    ch = sub.add_parser("chat", help="talk to a chat-tuned run in the terminal (streamed replies)")
    ch.add_argument("run_dir", type=Path, help="run directory (its newest checkpoint unless --step)")
    ch.add_argument("--system", default=None, help="system message for the conversation")
    ch.add_argument("--max-new-tokens", type=int, default=256)
    ch.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    ch.add_argument("--top-k", type=int, default=50)
    ch.add_argument("--top-p", type=float, default=0.95)
    ch.add_argument("--seed", type=int, default=0)
    ch.add_argument(
        "--template",
        choices=["auto", "shipyard", "chatml", "llama3"],
        default=None,
        help="chat template (default: the one the run trained with)",
    )
    ch.add_argument("--step", type=int, default=None, help="checkpoint step")
    ch.set_defaults(func=_cmd_chat)

    ev = sub.add_parser("eval", help="held-out loss / perplexity / bits-per-byte and log-likelihood tasks")
    ev.add_argument("run_dir", type=Path, help="run directory (its newest checkpoint unless --step)")
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
    ev.add_argument("--max-sequences", type=int, default=64, help="sequences scored per token set")
    ev.add_argument("--step", type=int, default=None, help="checkpoint step")
    ev.add_argument("--out", type=Path, default=None, help="JSON report (default RUN_DIR/eval.json)")
    ev.set_defaults(func=_cmd_eval)

    pl = sub.add_parser(
        "plan",
        help="memory, FLOPs, time and fit of a config on a mesh (analytic + compiled), before you rent it",
    )
    pl.add_argument("config", help="preset name or YAML file")
    pl.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.remat=full")
    pl.add_argument("--mesh", required=True, help="axis sizes, e.g. data=2,fsdp=8,tensor=1,expert=4")
    pl.add_argument("--device", default="h100", choices=["h100", "h200", "a100", "tpu-v5p", "cpu"])
    pl.add_argument("--device-memory", help="memory per device (e.g. 80GiB); default: the device's")
    pl.add_argument("--tokens", type=float, help="token budget for time and device-hours (e.g. 15e12)")
    pl.add_argument(
        "--mfu", type=float, default=0.4, help="model FLOPs utilisation assumed for time (default 0.4)"
    )
    pl.add_argument("--analytic-only", action="store_true", help="skip compiling the step")
    pl.add_argument(
        "--compile-layers",
        type=int,
        help="compile only this many layers (twice, at two depths) and extrapolate; for very large models",
    )
    pl.add_argument("--json", type=Path, help="also write the plan as JSON here")
    pl.set_defaults(func=_cmd_plan)

    ru = sub.add_parser("run", help="run a pipeline file: content-addressed steps, done ones skipped")
    ru.add_argument("pipeline", type=Path, help="pipeline YAML (root + steps)")
    ru.add_argument("--dry-run", action="store_true", help="print each step's status and why it would run")
    ru.add_argument(
        "--force", action="append", default=[], metavar="STEP", help="rerun this step (repeatable)"
    )
    ru.add_argument("--root", type=Path, help="output root instead of the file's `root`")
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
        "--root", type=Path, default=Path("runs/quickstart"), help="output root (default runs/quickstart)"
    )
    qs.add_argument("--dry-run", action="store_true", help="print what would run and why")
    qs.set_defaults(func=_cmd_quickstart)

    rp = sub.add_parser(
        "reproduce", help="rerun the recorded steps behind a pipeline output and compare hashes"
    )
    rp.add_argument("output_dir", type=Path, help="a finished step's directory (holds provenance.json)")
    rp.add_argument("--root", type=Path, required=True, help="a fresh directory to rerun into")
    rp.set_defaults(func=_cmd_reproduce)

    rep = sub.add_parser("report", help="plot a run's metrics and write report.md")
    rep.add_argument("run_dir", type=Path)
    rep.set_defaults(func=_cmd_report)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
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


def _entry() -> None:
    from shipyard import cpu_tuning

    cpu_tuning.reexec_with_fast_allocator()
    # XLA reads its flags once, when the backend starts: set them before that.
    cpu_tuning.apply_xla_flags()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())


if __name__ == "__main__":
    _entry()
