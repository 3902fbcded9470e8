"""shipyard plan: memory, FLOPs, time and fit of a config on a mesh, before you rent it."""

from __future__ import annotations

import sys
from pathlib import Path

from shipyard.cli.args import CONFIG_HELP, load_config_arg, positive_number
from shipyard.errors import ConfigError


def _cmd_plan(args) -> int:
    import json
    import shlex
    from dataclasses import replace

    from shipyard.plan import DEVICES, compare_table, config_mesh, parse_bytes, parse_mesh, plan, render

    cfg = load_config_arg(args.config, args.overrides, "plan")
    rl = _rl_config(args.rl) if args.rl is not None else None
    target = _target(args)
    if args.search:
        return _search(args, cfg, target)
    if rl is not None:
        from shipyard.plan import rl_mesh

        sizes = rl_mesh(rl, parse_mesh(args.mesh) if args.mesh else None)
    elif target is not None and not args.mesh:
        from shipyard.parallel.mesh import resolve_mesh_shape

        sizes = resolve_mesh_shape(cfg.mesh, target.devices)
    else:
        sizes = parse_mesh(args.mesh) if args.mesh else config_mesh(cfg.mesh)
    if target is not None:
        from shipyard.plan import target_device

        device = target_device(target)
    else:
        device = DEVICES[args.device or "h100"]
    if args.device_memory:
        device = replace(device, memory_bytes=parse_bytes(args.device_memory))
    if not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu: {args.mfu} is not a fraction; expected 0 < mfu <= 1, e.g. 0.4")
    if args.compile_layers is not None and args.compile_layers < 1:
        raise ConfigError(f"--compile-layers: {args.compile_layers}; expected a positive number of layers")
    result = plan(
        cfg, sizes, device, args.tokens, args.mfu, args.compile_layers, not args.analytic_only, rl, target
    )
    sys.stdout.write(render(result) + "\n")
    if args.compare:
        others = []
        for spec in args.compare:
            mesh, *overrides = shlex.split(spec)
            other = load_config_arg(args.config, [*args.overrides, *overrides], "plan --compare")
            other_sizes = parse_mesh(mesh)
            other_rl = None
            if rl is not None:  # the compared mesh is the RL trainer's
                from shipyard.plan import rl_mesh

                other_rl = rl.model_copy(update={"mesh": None})
                other_sizes = rl_mesh(other_rl, other_sizes)
            p = plan(
                other,
                other_sizes,
                device,
                args.tokens,
                args.mfu,
                args.compile_layers,
                not args.analytic_only,
                other_rl,
                target,
            )
            others.append((spec, p))
        sys.stdout.write("\ncompared:\n" + compare_table([("this plan", result), *others]) + "\n")
        result = {**result, "compare": {spec: p for spec, p in others}}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["fits"] else 6


def _search(args, cfg, target) -> int:
    """--search: the layouts of `cfg` on the target, ranked by its compiler (plan_search.py)."""
    import json

    from shipyard import plan_search

    if target is None:
        raise ConfigError("--search ranks layouts by a target's compiler: give --target, e.g. h200x1536")
    if args.mesh or args.rl or args.compare:
        raise ConfigError("--search chooses the mesh itself: drop --mesh, --rl and --compare")
    result = plan_search.search(cfg, target, args.compile_layers, shortlist=args.search_compile)
    sys.stdout.write(plan_search.render(result, target) + "\n")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0 if result["best"] is not None and result["best"]["fits"] else 6


def _target(args):
    """--target parsed (None without one); --device and --device-memory describe the analytic
    plan's device and do not go with a target, whose chip the target names."""
    if args.target is None:
        return None
    from shipyard.parallel.targets import parse_target

    if args.device or args.device_memory:
        raise ConfigError(
            "--target names the chip; --device and --device-memory are for plans without one: drop them"
        )
    return parse_target(args.target)


def _rl_config(text: str):
    """--rl 'key=value ...' -> the RLConfig of `shipyard rl` (ConfigError in one line naming the key)."""
    import shlex

    from shipyard.config import build_rl_config

    try:
        return build_rl_config(shlex.split(text))
    except ConfigError as e:
        raise ConfigError(f"--rl: {e}") from e
    except ValueError as e:  # shlex: an unclosed quote
        raise ConfigError(f"--rl: {text!r}: {e}; expected 'key=value key=value ...'") from e


def register(sub) -> None:
    """Add this group's subcommands to the `shipyard` parser's subparsers."""
    pl = sub.add_parser(
        "plan",
        help="memory, FLOPs, time and fit of a config on a mesh (analytic + compiled), before you rent it",
    )
    pl.add_argument("config", help=CONFIG_HELP)
    pl.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.remat=full")
    pl.add_argument(
        "--mesh",
        help="axis sizes, e.g. pipeline=4,fsdp=32,expert=8 (default: the config's mesh; -1 is not allowed)",
    )
    pl.add_argument(
        "--device",
        choices=["h100", "h200", "a100", "tpu-v5p", "cpu"],
        help="the analytic plan's device (default h100); the compiled step is XLA:CPU's view",
    )
    pl.add_argument(
        "--target",
        help="compile the step with the target's own compiler, without the hardware: "
        "tpu-v4|v5e|v5p|v6e:<chip grid> (e.g. tpu-v5p:4x4x4) or h100|h200|b200x<N> (e.g. h100x64); "
        "prints its memory, collectives and a roofline step time (docs/targets.md)",
    )
    pl.add_argument("--device-memory", help="memory per device (e.g. 80GiB); default: the device's")
    pl.add_argument(
        "--tokens", type=positive_number(), help="token budget for time and device-hours (e.g. 15e12)"
    )
    pl.add_argument(
        "--mfu", type=float, default=0.4, help="model FLOPs utilisation assumed for time (default 0.4)"
    )
    pl.add_argument("--analytic-only", action="store_true", help="skip compiling the step")
    pl.add_argument(
        "--compile-layers",
        type=int,
        help="compile only this many layers (twice, at two depths) and extrapolate; for very large models",
    )
    pl.add_argument(
        "--compare",
        action="append",
        metavar="'MESH [KEY=VALUE ...]'",
        help="also plan this mesh (with these overrides) and print the layouts side by side, "
        "e.g. 'fsdp=32,expert=8 train.pipeline=null train.microbatches=16'",
    )
    pl.add_argument(
        "--rl",
        metavar="'KEY=VALUE ...'",
        help="plan `shipyard rl` with these settings (its keys, e.g. 'prompts_per_step=8 group_size=8 "
        "max_batch=64 beta=0.04'): the trainer's step on prompts_per_step x group_size rows of "
        "data.seq_len tokens, where data.seq_len is the rollout's prompt + reply length, plus the "
        "rollout engine's KV cache and weights copy and the KL reference on the mesh's first device; "
        "the mesh is the rl settings' mesh=, else --mesh, else one device",
    )
    pl.add_argument(
        "--search",
        action="store_true",
        help="with --target: rank meshes, remat and microbatching by the target compiler's roofline, "
        "print the top 5 and the best one's recipe overrides (docs/targets.md)",
    )
    pl.add_argument(
        "--search-compile",
        type=int,
        default=4,
        help="--search: how many of the best-estimated fitting layouts to compile (default 4)",
    )
    pl.add_argument("--json", type=Path, help="also write the plan as JSON here")
    pl.set_defaults(func=_cmd_plan)
