"""shipyard export and import: Hugging Face and PEFT directories, StableHLO artifacts."""

from __future__ import annotations

from pathlib import Path

from shipyard.cli.args import add_model_dir, command_group, positive_number
from shipyard.output import refuse_existing


def _cmd_export_hf(args) -> int:
    from shipyard.interop.hf import write_hf_dir
    from shipyard.run.model_dir import open_model_dir

    model_dir = open_model_dir(args.run_dir, "export hf", args.tokenizer)
    refuse_existing(args.out, "export hf")  # before the params are read: refusing should be instant
    # Params stay sharded on the local devices; tensors reach the host one at a time.
    weights = model_dir.load(args.step, to_host=False, what="export hf")
    tok_dir = model_dir.tokenizer()
    shard_bytes = int(args.max_shard_gb * (1 << 30))
    gen = model_dir.generation_file()
    files = write_hf_dir(weights.params, weights.config.model, args.out, tok_dir, shard_bytes, gen)
    tok = f", tokenizer from {tok_dir}" if tok_dir else " (no tokenizer found next to the run's data)"
    what = "the imported model" if weights.step is None else f"checkpoint {weights.step}"
    print(f"exported {what} of {args.run_dir} to {args.out}: {', '.join(files)}{tok}")
    return 0


def _cmd_export_peft(args) -> int:
    from shipyard.errors import ConfigError
    from shipyard.interop.peft import write_peft_dir
    from shipyard.run.model_dir import open_model_dir

    if args.base is not None and args.write_base is not None:
        raise ConfigError("export peft: give --base (a base exported before) or --write-base, not both")
    model_dir = open_model_dir(args.run_dir, "export peft")
    refuse_existing(args.out, "export peft")
    cfg, step, adapters = model_dir.load_adapters(args.step)
    if args.write_base is not None:
        refuse_existing(args.write_base, "export peft --write-base")
        _write_frozen_base(model_dir, args.write_base)
    base = args.base if args.write_base is None else str(args.write_base)
    info = write_peft_dir(cfg, adapters, args.out, base)
    quantized = cfg.train.finetune.quantize_base
    on = (
        f"{base!r} (the run's frozen base{', dequantized from ' + quantized if quantized else ''})"
        if args.write_base is not None
        else "<the base exported with `shipyard export hf`>"
    )
    print(
        f"exported the LoRA adapters of checkpoint {step} of {args.run_dir} to {args.out} "
        f"({info['tensors']} tensors on {', '.join(info['targets'])}); load with peft.PeftModel.from_pretrained("
        f"{on}, {str(args.out)!r})"
    )
    return 0


def _write_frozen_base(model_dir, out: Path) -> None:
    """The run's frozen base as a Hugging Face directory, exactly as the run trained on it: a QLoRA
    run's base quantized (as train did) and dequantized, so PEFT's adapters on it compute the run's
    logits (the unquantized init_from would not)."""
    import jax

    from shipyard.interop.hf import write_hf_dir
    from shipyard.model.partition import Partition
    from shipyard.model.transformer import param_specs
    from shipyard.run.model_dir import base_weights

    cfg = model_dir.config
    partition = Partition(cfg.model, cfg.train.finetune)
    base = base_weights(cfg, param_specs(cfg.model), None)
    params = jax.jit(partition.base_for_export)(partition.frozen(base))
    write_hf_dir(params, cfg.model, out, model_dir.tokenizer())


def _cmd_export_stablehlo(args) -> int:
    from shipyard.inference.export import export_stablehlo
    from shipyard.run.model_dir import open_model_dir

    model_dir = open_model_dir(args.run_dir, "export stablehlo", args.tokenizer)
    platforms = tuple(p.strip() for p in args.platforms.split(",") if p.strip())
    manifest = export_stablehlo(
        model_dir, args.out, batch=args.batch, max_len=args.max_len, step=args.step, platforms=platforms
    )
    step = manifest["source"]["step"]
    what = "the imported model" if step is None else f"checkpoint {step}"
    print(
        f"exported {what} of {args.run_dir} to {args.out}: prefill + decode for {manifest['batch']} rows "
        f"and {manifest['max_len']} cache slots, for {', '.join(manifest['platforms'])} "
        f"(JAX {manifest['jax_version']}); run it with `shipyard generate {args.out} --prompt ...`"
    )
    return 0


def _cmd_import_hf(args) -> int:
    from shipyard.interop.hf import import_hf

    info = import_hf(args.hf_dir, args.out)
    print(
        f"imported {args.hf_dir}: params in {info['params']}; train from it with `shipyard train {info['config']} data.train_tokens=...`"
    )
    return 0


def register(sub) -> None:
    """Add this group's subcommands to the `shipyard` parser's subparsers."""
    ex_sub = command_group(sub, "export", "export a model (a run's checkpoint, an import) to another format")
    exh = ex_sub.add_parser(
        "hf", help="Hugging Face Llama directory (config.json, model.safetensors, tokenizer)"
    )
    add_model_dir(exh)
    exh.add_argument("out", type=Path, help="output directory (must not exist)")
    exh.add_argument(
        "--max-shard-gb", type=positive_number(), default=5.0, help="split safetensors above this size"
    )
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
    exp.add_argument(
        "--write-base",
        type=Path,
        default=None,
        help="also write the run's frozen base as a Hugging Face directory (must not exist) and record it; "
        "for a QLoRA run, the dequantized base it trained on (the base the adapters reproduce the run on)",
    )
    exp.set_defaults(func=_cmd_export_peft)
    exs = ex_sub.add_parser(
        "stablehlo",
        help="prefill + decode programs (jax.export) with the weights and tokenizer: runs without the model code",
    )
    add_model_dir(exs)
    exs.add_argument("out", type=Path, help="output directory (must not exist)")
    exs.add_argument("--batch", type=int, default=1, help="rows per call, fixed in the programs (default 1)")
    exs.add_argument(
        "--max-len",
        type=int,
        default=None,
        help="cache slots: prompt + new tokens (default: the model's context)",
    )
    exs.add_argument(
        "--platforms", default="cpu,cuda", help="comma-separated jax.export platforms (default cpu,cuda)"
    )
    exs.set_defaults(func=_cmd_export_stablehlo)

    im_sub = command_group(sub, "import", "import a checkpoint from another format")
    imh = im_sub.add_parser(
        "hf", help="Hugging Face Llama/Mistral safetensors directory -> params + config.yaml"
    )
    imh.add_argument("hf_dir", type=Path, help="directory with config.json and *.safetensors")
    imh.add_argument("out", type=Path, help="output directory (must not exist)")
    imh.set_defaults(func=_cmd_import_hf)
