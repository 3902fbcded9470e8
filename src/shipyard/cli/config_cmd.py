"""shipyard config show: the resolved config and its parameter counts."""

from __future__ import annotations

import sys

from shipyard.cli.args import CONFIG_HELP, command_group, load_config_arg


def _human(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def _cmd_config_show(args) -> int:
    from shipyard.config import to_yaml
    from shipyard.model.transformer import num_active_params, num_params
    from shipyard.train.metrics import flops_per_token

    cfg = load_config_arg(args.config, args.overrides, "config show")
    sys.stdout.write(to_yaml(cfg))
    total, active = num_params(cfg.model), num_active_params(cfg.model)
    sys.stdout.write(f"# parameters: {total} ({_human(total)})\n")
    sys.stdout.write(f"# active parameters per token: {active} ({_human(active)})\n")
    if cfg.train.finetune is not None:
        from shipyard.model.params import count_params
        from shipyard.model.partition import Partition

        trained = count_params(Partition(cfg.model, cfg.train.finetune).trainable_specs())
        sys.stdout.write(
            f"# trainable parameters (train.finetune): {trained} ({_human(trained)}, {trained / total:.2%})\n"
        )
    flops = flops_per_token(cfg.model, cfg.data.seq_len)
    sys.stdout.write(f"# training FLOPs per token at seq_len {cfg.data.seq_len}: {flops:.4g}\n")
    return 0


def register(sub) -> None:
    """Add this group's subcommands to the `shipyard` parser's subparsers."""
    cfg_sub = command_group(sub, "config", "inspect configs")
    show = cfg_sub.add_parser(
        "show", help="print the resolved config as YAML, ending with the parameter count"
    )
    show.add_argument("config", help=CONFIG_HELP)
    show.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.optimizer.lr=3e-4")
    show.set_defaults(func=_cmd_config_show)
