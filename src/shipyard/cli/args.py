"""What every command group shares: a parser whose bad flag is one line and exit 2."""

from __future__ import annotations

import argparse
from pathlib import Path

from shipyard.errors import ConfigError


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr with exit code 2, like every other input error."""

    def error(self, message: str):
        raise ConfigError(f"{self.prog}: {message} (see `{self.prog} --help`)")


MODEL_DIR_HELP = (
    "a run (its newest checkpoint unless --step), an `import hf` output or a Hugging Face directory"
)


def add_model_dir(p: argparse.ArgumentParser, help: str = MODEL_DIR_HELP) -> None:
    """The model directory argument every command that reads a model takes, with --step and --tokenizer."""
    p.add_argument("run_dir", type=Path, metavar="MODEL_DIR", help=help)
    p.add_argument("--step", type=int, default=None, help="checkpoint step of a run (default: the newest)")
    p.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="a tokenizer directory (or tokenizer.json) instead of the model's own; models trained on .npy ids have none",
    )
