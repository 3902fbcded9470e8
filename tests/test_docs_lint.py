"""tools/check_docs.py: the docs name only commands, flags, make targets, files, code and config keys
that exist. Each kind of drift is planted in a temporary copy of a doc and must be reported; the real
docs must pass (docs/architecture.md aside while it is rewritten; `make lint` checks it too)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKER = ROOT / "tools" / "check_docs.py"


def run_checker(*files: Path) -> tuple[int, list[str]]:
    r = subprocess.run(
        [sys.executable, str(CHECKER), "--repo", str(ROOT), *map(str, files)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return r.returncode, [line for line in r.stdout.splitlines() if line.strip()]


def planted(src: str, old: str, new: str) -> str:
    text = (ROOT / src).read_text()
    assert old in text, f"{src} no longer holds {old!r}: update this test"
    return text.replace(old, new, 1)


def line_of(text: str, needle: str) -> int:
    return text[: text.index(needle)].count("\n") + 1


ARCH = """# Architecture (planted drift)

`attention.layer_windows` is real and `attention.layer_window` is not.
`parallel/mesh.py: DEFAULT_RULES` is real; `parallel/mesh.py: NO_SUCH_TABLE` is not.
`train/step.py: make_train_step(cfg)` lacks a required argument;
`train/step.py: make_train_step(cfg, optimizer, partition=None)` fits.
`model/transformer.py` exists, `model/no_such_module.py` does not.
`model.sliding_window` is a config key, `model.sliding_windw` is not, and `moe.bias_update_rate` is one.
`peft.PeftModel.from_pretrained` and `jax.distributed` belong to other libraries.
`tests/test_train.py: test_bad_token_file` backs a claim; `tests/test_train.py: test_bad_token_files` backs none.
"""


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("docs")
    docs = {
        # a wrong flag and a wrong config key in an override, in a copy of docs/plan.md
        "plan.md": planted(
            "docs/plan.md", "--device h200 --compile-layers 1", "--device h200 --compiled-layers 2"
        ).replace("shipyard plan marin-8b model.remat=full", "shipyard plan marin-8b model.rematt=full", 1),
        # a subcommand that does not exist and a make target that does not exist, in a copy of the README
        "README.md": planted(
            "README.md", "shipyard data verify shards/", "shipyard data verfy shards/"
        ).replace("make test         #", "make test-fast    #", 1),
        "architecture.md": ARCH,
    }
    for name, text in docs.items():
        (d / name).write_text(text)
    rc, out = run_checker(*(d / n for n in docs))
    return d, docs, rc, out


def reported(out: list[str], name: str, line: int) -> list[str]:
    return [o for o in out if re.match(rf".*{re.escape(name)}:{line}: ", o)]


def test_wrong_flag_is_reported(planted_run):
    d, docs, rc, out = planted_run
    assert rc == 1
    hits = reported(out, "plan.md", line_of(docs["plan.md"], "--compiled-layers"))
    assert any("--compiled-layers" in h and "--compile-layers" in h for h in hits), out


def test_wrong_config_key_in_override_is_reported(planted_run):
    d, docs, rc, out = planted_run
    hits = reported(out, "plan.md", line_of(docs["plan.md"], "model.rematt"))
    assert any("model.rematt" in h for h in hits), out


def test_unknown_subcommand_is_reported(planted_run):
    d, docs, rc, out = planted_run
    hits = reported(out, "README.md", line_of(docs["README.md"], "data verfy"))
    assert any("no subcommand `verfy`" in h and "verify" in h for h in hits), out


def test_unknown_make_target_is_reported(planted_run):
    d, docs, rc, out = planted_run
    hits = reported(out, "README.md", line_of(docs["README.md"], "make test-fast"))
    assert any("make test-fast" in h and "Makefile" in h for h in hits), out


def test_code_references_are_checked(planted_run):
    d, docs, rc, out = planted_run
    arch = [o for o in out if "architecture.md:" in o]
    expect = {
        "attention.layer_window`": "defines no `layer_window`",
        "NO_SUCH_TABLE": "defines no `NO_SUCH_TABLE`",
        "make_train_step(cfg)`": "also requires optimizer",
        "no_such_module.py": "no such file",
        "model.sliding_windw": "has no field `sliding_windw`",
        "test_bad_token_files`": "defines no `test_bad_token_files` (did you mean `test_bad_token_file`?)",
    }
    for name, why in expect.items():
        assert any(name in o and why in o for o in arch), (name, arch)
    # and nothing else: the real names, the config keys and other libraries' names pass
    assert len(arch) == len(expect), arch


def test_planted_docs_report_only_the_planted_drift(planted_run):
    d, docs, rc, out = planted_run
    assert len([o for o in out if "plan.md:" in o]) == 2, out
    assert len([o for o in out if "README.md:" in o]) == 2, out


def test_repository_docs_pass():
    files = [
        ROOT / "README.md",
        *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "architecture.md"),
    ]
    rc, out = run_checker(*files)
    assert rc == 0, "\n".join(out)


def _checker_module():
    spec = importlib.util.spec_from_file_location("check_docs", CHECKER)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["check_docs"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_docstrings_are_checked_too(tmp_path):
    """A stale flag and a stale code name in a module's docstrings are reported with the source line;
    the real modules' docstrings pass (the checker without FILES reads them all: `make lint`)."""
    mod = _checker_module()
    text = planted("src/shipyard/plan.py", "`--compile-layers N` compiles", "`--compiled-layers N` compiles")
    text = text.replace(
        '    """The train program the compiled plan analyses: `train.program.build_program`',
        '    """The train program the compiled plan analyses: `train.program.build_programme`',
        1,
    )
    assert "build_programme" in text, "plan.py's docstring no longer names train.program.build_program"
    copy = tmp_path / "plan.py"
    copy.write_text(text)
    checker = mod.Checker(ROOT)
    found = [str(p) for p in checker.check_docstrings(copy, "plan.py")]
    assert len(found) == 2, found
    assert f"plan.py:{line_of(text, '--compiled-layers')}: `--compiled-layers`" in found[0], found
    assert "build_programme" in found[1] and f"plan.py:{line_of(text, 'build_programme')}:" in found[1], found
    clean = checker.check_docstrings(ROOT / "src" / "shipyard" / "plan.py", "plan.py")
    assert clean == [], clean


@pytest.mark.slow
def test_every_flag_of_every_command_is_in_cli_md(tmp_path):
    """docs/cli.md names every flag of every command (the real CLI's --help, walked); a flag written
    nowhere there is reported by command and flag."""
    mod = _checker_module()
    cli_md = ROOT / "docs" / "cli.md"
    checker = mod.Checker(ROOT)
    checker.check_file(cli_md, "docs/cli.md")
    assert mod.undocumented_flags(checker, cli_md, "docs/cli.md") == []
    text = cli_md.read_text()
    assert text.count("--fixed-shape") >= 2 and "--watch-every" in text
    copy = tmp_path / "cli.md"
    copy.write_text(text.replace(" [--fixed-shape]", "").replace("`--fixed-shape` decodes", "it decodes"))
    checker = mod.Checker(ROOT)
    checker.check_file(copy, "docs/cli.md")
    found = [str(p) for p in mod.undocumented_flags(checker, copy, "docs/cli.md")]
    assert found == [
        "docs/cli.md:1: `shipyard serve --fixed-shape`: a flag of the command that docs/cli.md does not name"
    ]


def test_help_parsing_handles_wrapped_usage_and_choices():
    spec = importlib.util.spec_from_file_location("check_docs", CHECKER)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["check_docs"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    text = """usage: shipyard plan [-h] --mesh MESH [--device {h100,cpu}]
                     [--compile-layers COMPILE_LAYERS]
                     config [overrides ...]

positional arguments:
  config                preset name or YAML file
  overrides             dotted overrides

options:
  -h, --help            show this help message and exit
  --device {h100,cpu}
  --compile-layers COMPILE_LAYERS
                        compile only this many layers; see also --not-a-flag
"""
    h = mod.parse_help(text)
    assert h.flags == {"--help", "--mesh", "--device", "--compile-layers"}
    assert h.subcommands == [] and h.overrides
    sub = mod.parse_help(
        "usage: shipyard data [-h] {bytes,verify} ...\n\npositional arguments:\n  {bytes,verify}\n"
        "    bytes    write bytes\n\noptions:\n  -h, --help  show help\n"
    )
    assert sub.subcommands == ["bytes", "verify"]


def test_a_claim_row_says_slow_exactly_when_its_test_is_in_the_second_tier(tmp_path):
    """docs/testing.md's `(slow)` after a test is checked against the test's marks: dropped from a
    slow test and written after a quick one, both are reported; the real table passes."""
    mod = _checker_module()
    slow = "`tests/test_pipeline.py: test_quickstart_pipeline_beats_unigram`"
    quick = "`tests/test_pipeline.py: test_a_killed_step_leaves_no_marker_and_is_redone`"
    text = planted("docs/testing.md", f"{slow} (slow)", slow).replace(f"{quick} |", f"{quick} (slow) |", 1)
    assert f"{quick} (slow)" in text, "docs/testing.md's row for the killed step changed: update this test"
    copy = tmp_path / "testing.md"
    copy.write_text(text)
    found = [str(p) for p in mod.tier_problems(ROOT, copy, "testing.md")]
    assert len(found) == 2, found
    assert f"testing.md:{line_of(text, slow)}:" in found[0] and "write (slow)" in found[0], found
    assert f"testing.md:{line_of(text, quick)}:" in found[1] and "yet the row says" in found[1], found
    assert mod.tier_problems(ROOT, ROOT / "docs" / "testing.md", "docs/testing.md") == []
