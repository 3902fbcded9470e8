"""Generated configs and command lines: every one is either accepted or refused with one line.

Hypothesis builds dotted overrides (real keys and misspelt ones, values of every YAML type, edge
numbers), whole YAML files (a preset's mapping with parts replaced, or text that is not a mapping)
and argv for every command from its own argparse table. A case passes when it gives a valid config
(which must round-trip through its YAML) or a ConfigError / a non-zero exit with a single line on
stderr; anything else (a traceback, a pydantic or YAML exception escaping, a two-line error) fails.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import typing

import pytest
import yaml

from shipyard.cli.main import build_parser, main
from shipyard.config import Config, ConfigError, apply_overrides, build_config, load_config, to_yaml

# Heavy compiles and end-to-end runs: the `make test-slow` tier (docs/testing.md: tiers).
pytestmark = pytest.mark.slow

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies
given, settings, HealthCheck = hypothesis.given, hypothesis.settings, hypothesis.HealthCheck


def _keys(model: type, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, sections included (`train.optimizer` and `train.optimizer.lr`)."""
    out = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        out.append(key)
        for arg in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(arg, type) and hasattr(arg, "model_fields"):
                out.extend(_keys(arg, key + "."))
    return out


KEYS = _keys(Config)

# values as YAML text: the types a user can write, with the edges the schema's ranges sit on
NUMBERS = st.one_of(
    st.integers(-3, 3),
    st.integers(-(2**70), 2**70),
    st.sampled_from(["0.0", "-0.0", "1e-30", "1e30", ".nan", ".inf", "-.inf", "0x10", "1_000"]),
    st.floats(allow_nan=False, allow_infinity=False, width=32).map(repr),
)
WORDS = st.sampled_from(
    ["null", "true", "false", "''", "tiny", "bfloat16", "float32", "int8", "nf4", "dpo", "orpo", "cosine"]
    + ["data", "fsdp", "tensor", "expert", "pipeline", "[q, v]", "[]", "{}", "[1, 2]", "{rank: 4}", "~"]
)
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)
VALUE = st.one_of(NUMBERS.map(str), WORDS, TEXT)


def _misspelt(key: str, draw) -> str:
    parts = key.split(".")
    i = draw(st.integers(0, len(parts) - 1))
    parts[i] = draw(st.sampled_from([parts[i] + "s", parts[i][:-1] or "x", parts[i].upper(), "nope"]))
    return ".".join(parts)


@st.composite
def overrides(draw) -> list[str]:
    out = []
    for _ in range(draw(st.integers(1, 4))):
        key = draw(st.sampled_from(KEYS))
        kind = draw(st.integers(0, 9))
        if kind == 0:
            key = _misspelt(key, draw)
        elif kind == 1:
            key += ".deeper"
        elif kind == 2:
            out.append(draw(st.sampled_from([key, "=" + key, key + ".=1", "..=1"])))
            continue
        out.append(f"{key}={draw(VALUE)}")
    return out


def _refused_in_one_line(error: ConfigError) -> None:
    text = str(error)
    assert text and "\n" not in text and "Traceback" not in text, text


PRESETS = {name: yaml.safe_load(to_yaml(load_config(name))) for name in ("tiny", "moe-tiny")}


def _accepts_or_refuses(source: str, overrides: list[str]) -> None:
    """load_config(source, overrides), with a preset's mapping read once (what load_config does with
    it: apply the overrides, validate) so the cases are spent on the validation."""
    try:
        if source in PRESETS:
            cfg = build_config(apply_overrides(PRESETS[source], overrides))
        else:
            cfg = load_config(source, overrides)
    except ConfigError as e:
        _refused_in_one_line(e)
        return
    # a config that validates writes a YAML that reads back to the same config
    again = Config.model_validate(yaml.safe_load(to_yaml(cfg)))
    assert again == cfg, overrides


FAST = settings(
    max_examples=5000, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None
)


@pytest.mark.parametrize("preset", ["tiny", "moe-tiny"])
@FAST
@given(ov=overrides())
def test_generated_overrides_give_a_config_or_one_line(preset, ov):
    _accepts_or_refuses(preset, ov)


@st.composite
def yaml_files(draw) -> str:
    """A YAML document: the tiny preset's mapping with sections replaced, deleted or added, or a
    document that is not a config at all."""
    if draw(st.integers(0, 4)) == 0:
        return draw(
            st.sampled_from(
                ["", "- a\n- b\n", "just text\n", "model: [\n", "model: {a: 1\n", "\t bad: indent\n"]
            )
            | TEXT
        )
    data = copy.deepcopy(PRESETS["tiny"])
    for _ in range(draw(st.integers(1, 3))):
        section = draw(st.sampled_from(sorted(data)))
        action = draw(st.integers(0, 3))
        if action == 0:
            del data[section]
        elif action == 1:
            data[section] = yaml.safe_load(draw(WORDS))
        elif action == 2 and isinstance(data[section], dict) and data[section]:
            key = draw(st.sampled_from(sorted(data[section])))
            data[section][key] = yaml.safe_load(draw(st.one_of(NUMBERS.map(str), WORDS)))
        else:
            data[draw(st.sampled_from(["base", "modle", "train"]))] = draw(st.sampled_from(["tiny", 3, None]))
    return yaml.safe_dump(data)


@settings(
    max_examples=400, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None
)
@given(text=yaml_files())
def test_generated_yaml_files_give_a_config_or_one_line(tmp_path, text):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    _accepts_or_refuses(str(path), [])


# --------------------------------------------------------------------------------------- command lines

# Commands that would run real work when their flags parse (they take no input that can be missing):
# their flags are still generated, with a missing input path so nothing heavy starts.
NO_INPUT = {("data", "stdlib"), ("data", "bytes"), ("quickstart",), ("data", "plan")}


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> dict:
    out = {}
    for action in parser._actions:  # noqa: SLF001 (argparse has no public walk of its tables)
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for name, sub in action.choices.items():
                out.update(_commands(sub, (*path, name)))
            return out
    return {path: parser}


COMMANDS = _commands(build_parser())


@st.composite
def command_lines(draw) -> list[str]:
    path = draw(st.sampled_from(sorted(COMMANDS)))
    parser = COMMANDS[path]
    argv = list(path)
    for action in parser._actions:  # noqa: SLF001
        if action.option_strings:
            if "--help" in action.option_strings or not draw(st.booleans()):
                continue
            flag = draw(st.sampled_from(action.option_strings))
            if action.nargs == 0:
                argv.append(flag)
            elif action.choices and draw(st.booleans()):
                argv += [flag, str(draw(st.sampled_from(list(action.choices))))]
            else:
                argv += [
                    flag,
                    draw(st.one_of(NUMBERS.map(str), WORDS, TEXT.filter(lambda t: not t.startswith("-")))),
                ]
        elif action.nargs not in ("*", "?") or draw(st.booleans()):
            argv.append("/nonexistent/shipyard-fuzz/input")  # a positional: a missing path
    if draw(st.integers(0, 5)) == 0:
        argv.append(draw(st.sampled_from(["--no-such-flag", "train.steps=1", "x.y=", "-q"])))
    return argv


def _safe(argv: list[str]) -> bool:
    """Leave out the commands with no input that can be missing: their valid flags would do real work."""
    return tuple(argv[:2]) not in NO_INPUT and tuple(argv[:1]) not in NO_INPUT


@pytest.fixture(autouse=True, scope="module")
def _in_a_scratch_directory(tmp_path_factory):
    """Generated relative paths (an `--out 0`) land in a scratch directory, not the checkout."""
    import os

    before = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("fuzz-cwd"))
    yield
    os.chdir(before)


@settings(
    max_examples=400, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None
)
@given(argv=command_lines())
def test_generated_command_lines_exit_with_one_line(argv):
    hypothesis.assume(_safe(argv))
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(argv)
    assert code != 0, (argv, out.getvalue())
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in lines[0], (argv, lines)
