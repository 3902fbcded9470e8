"""What every command group shares: a parser whose bad flag is one line and exit 2."""

from __future__ import annotations

import argparse
from pathlib import Path

from shipyard.errors import ConfigError


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr with exit code 2, like every other input error."""

    def error(self, message: str):
        raise ConfigError(f"{self.prog}: {message} (see `{self.prog} --help`)")


def command_group(sub, name: str, help: str):
    """`shipyard NAME ...`: a command with subcommands of its own (config, data, export, import);
    returns the subparsers to add them to (the parsed `args.<name>_command` names the one given)."""
    group = sub.add_parser(name, help=help)
    return group.add_subparsers(dest=f"{name}_command", required=True, parser_class=Parser)


CONFIG_HELP = (
    "preset name, YAML file, or a model directory to start from (run, `import hf` output, HF directory)"
)
MODEL_DIR_HELP = (
    "a run (its newest checkpoint unless --step), an `import hf` output or a Hugging Face directory"
)


def add_model_dir(p: argparse.ArgumentParser, help: str = MODEL_DIR_HELP) -> None:
    """The model directory argument every command that reads a model takes, with --step and --tokenizer."""
    # a run URL (s3://...) stays a string: Path would fold its // into one
    p.add_argument("run_dir", type=lambda v: v if "://" in v else Path(v), metavar="MODEL_DIR", help=help)
    p.add_argument("--step", type=int, default=None, help="checkpoint step of a run (default: the newest)")
    p.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="a tokenizer directory (or tokenizer.json) instead of the model's own; models trained on .npy ids have none",
    )


def load_config_arg(source: str, overrides, what: str):
    """The config a command is given: a preset name, a YAML file, or a model directory (a run, an
    `import hf` output, a Hugging Face directory): its model, trained from its weights."""
    from shipyard.config import apply_overrides, build_config, load_config

    path = Path(source)
    if not path.is_dir():
        return load_config(source, list(overrides))
    from shipyard.run.model_dir import open_model_dir

    model_dir = open_model_dir(path, what)
    base = model_dir.config.model_dump(mode="json")
    base["train"]["init_from"] = str(path.absolute())
    if model_dir.kind == "run":  # starting from a run's weights is a new run, not its fine-tuning setup
        base["train"]["finetune"] = None
    return build_config(apply_overrides(base, list(overrides)))


def quantize_mode(text: str) -> str:
    """An argparse `type`: one of `model.quantize.QUANTIZE_MODES`. Looked up only when the flag is given:
    building the parser must not import the model code (an exported artifact runs without it)."""
    from shipyard.model.quantize import QUANTIZE_MODES

    if text not in QUANTIZE_MODES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(QUANTIZE_MODES)}, got {text!r}")
    return text


def add_quantize_flags(p, kv_cache: bool = True) -> None:
    """--quantize (int8 weights, `model.quant`; the modes are `model.quantize.QUANTIZE_MODES`) and, for
    commands that decode, --kv-dtype."""
    p.add_argument(
        "--quantize",
        type=quantize_mode,
        metavar="MODE",
        default=None,
        help="int8 weights for attention, MLP and output head (default: as stored): int8 with one scale per "
        "output channel; int8-g128 with one per 128 consecutive inputs of a channel (group-wise: an outlier "
        "input row costs its own group's precision only)",
    )
    if kv_cache:
        p.add_argument(
            "--kv-dtype",
            choices=["float32", "bfloat16"],
            default=None,
            help="dtype of the KV cache (default: the embedding's, float32 for the presets)",
        )


def _checked(parse, check, what: str):
    """An argparse `type`: `parse` the text, then `check` the value (a ValueError's message becomes the
    one-line refusal `Parser.error` turns into exit 2)."""

    def arg(text: str):
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        try:
            return check(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return arg


def whole_number(minimum: int = 1):
    """An argparse `type`: a whole number of at least `minimum` (a count, a size, a number of workers)."""

    def check(value: int) -> int:
        if value < minimum:
            raise ValueError(f"must be at least {minimum}, got {value}")
        return value

    return _checked(int, check, "a whole number")


def positive_number():
    """An argparse `type`: a number above 0 (a size in GB, a token budget)."""

    def check(value: float) -> float:
        if not value > 0:  # also refuses nan
            raise ValueError(f"must be above 0, got {value}")
        return value

    return _checked(float, check, "a number")


def fraction():
    """An argparse `type`: a number from 0 to 1."""

    def check(value: float) -> float:
        if not 0 <= value <= 1:
            raise ValueError(f"must be from 0 to 1, got {value}")
        return value

    return _checked(float, check, "a number")


def _sampling_rule(name: str):
    """`inference.sampling`'s check `name`, imported when a flag is given: that module imports JAX,
    which `shipyard --help` and the commands that never sample should not wait for."""

    def check(value):
        from shipyard.inference import sampling

        return getattr(sampling, name)(value)

    return check


def add_sampling_flags(
    p: argparse.ArgumentParser, default_max_new: int, defaults: tuple[str, str, str]
) -> None:
    """--max-new-tokens, --temperature, --top-k, --top-p and --seed, checked by the ranges the OpenAI
    API also holds requests to (`inference.sampling`); `defaults` describes each sampling flag's fallback
    when neither it nor the model's generation_config.json gives one."""
    temperature, top_k, top_p = defaults
    model = "default: the model's generation_config.json, else "
    p.add_argument(
        "--max-new-tokens",
        type=whole_number(1),
        default=default_max_new,
        help=f"tokens to generate at most per reply (default {default_max_new}; a stop or eos ends it sooner)",
    )
    p.add_argument(
        "--temperature",
        type=_checked(float, _sampling_rule("check_temperature"), "a number"),
        default=None,
        help=f"0 (greedy) to 2; {model}{temperature}",
    )
    p.add_argument(
        "--top-k",
        type=_checked(int, _sampling_rule("check_top_k"), "a whole number"),
        default=None,
        help=f"sample among the k most likely tokens (0: all of them); {model}{top_k}",
    )
    p.add_argument(
        "--top-p",
        type=_checked(float, _sampling_rule("check_top_p"), "a number"),
        default=None,
        help=f"sample among the most likely tokens holding this mass, in (0, 1]; {model}{top_p}",
    )
    p.add_argument("--seed", type=int, default=0)


def add_template_flag(p: argparse.ArgumentParser, help: str) -> None:
    """--template: which chat template renders conversations."""
    p.add_argument(
        "--template", choices=["auto", "hf", "shipyard", "chatml", "llama3"], default=None, help=help
    )
