"""shipyard rl: reinforcement learning from verifiable rewards on a model directory."""

from __future__ import annotations

import sys
from pathlib import Path

from shipyard.cli.args import add_model_dir


def _cmd_rl(args) -> int:
    from shipyard.config import build_rl_config
    from shipyard.rl.loop import run_rl

    rl = build_rl_config(list(args.overrides))
    say = lambda m: print(m, file=sys.stderr)  # noqa: E731
    run_rl(str(args.run_dir), args.out, rl, checkpoint=args.step, tokenizer=args.tokenizer, say=say)
    return 0


def register(sub) -> None:
    """Add this group's subcommands to the `shipyard` parser's subparsers."""
    p = sub.add_parser(
        "rl",
        help="reinforcement learning from verifiable rewards (GRPO / Dr. GRPO / DAPO), rollouts from the serving engine",
        description="Train MODEL_DIR with RL into OUT. Settings are key=value (docs/rl.md lists them): "
        "task=add group_size=8 prompts_per_step=8 steps=20 max_tokens=16 temperature=1.0 lr=3e-5 ...",
    )
    add_model_dir(p)
    p.add_argument(
        "out", type=Path, metavar="OUT", help="the new directory for the trained model and its metrics"
    )
    p.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="RL settings (rl.yaml in OUT records them)"
    )
    p.set_defaults(func=_cmd_rl)
