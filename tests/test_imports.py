"""The import-direction rule over src/shipyard (table and helpers: tests/import_rules.py).

- No module imports a layer above its own (function-local imports and literal
  `importlib.import_module` / `__import__` names count).
- No import cycle between modules, function-local imports included (a group of modules that import
  each other round in a circle is one unit in disguise, whatever layers they sit in).
- A module sits where its imports say: a module directly under shipyard/ is listed in the highest
  layer it imports from, and a package's modules are never listed apart from their package.
- No module uses another module's `_private` name (`from shipyard.x import _y`, or `x._y` where `x` is a
  shipyard module the file imported).
- Every module under src/shipyard is placed in a layer.
- docs/architecture.md's layer table agrees with import_rules.LAYERS.

The table in docs/architecture.md, which this test reads: under a heading whose text starts with
"Import layers" (any level, e.g. `## Import layers`), the first markdown table, with (at least) the
columns `layer` and `modules` (header names, any case, any order; other columns are ignored), one row
per layer, bottom layer first, in the order of LAYERS; the `modules` cell lists that layer's module
prefixes as backticked dotted names, in any order, e.g.

    ## Import layers

    | layer | modules |
    |---|---|
    | base | `shipyard`, `shipyard.errors`, `shipyard.config`, `shipyard.output`, `shipyard.cpu_tuning` |
    | parallel | `shipyard.parallel` |
    | ... | ... |
    | cli | `shipyard.cli`, `shipyard.lm_eval_adapter` |

(the layer names may be backticked too). While the heading is absent the table check is skipped.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from import_rules import LAYERS, import_cycles, layer_of, misplaced, modules, private_uses, upward_edges

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "shipyard"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def unplaced(src: Path) -> list[str]:
    return sorted(m for m in modules(src) if layer_of(m) is None)


def doc_layers(text: str) -> list[tuple[str, set[str]]] | None:
    """The "Import layers" table as (layer, module prefixes) rows, or None without the heading."""
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if re.match(r"^#+\s+Import layers", l, re.I)), None)
    if start is None:
        return None
    rows = []
    header = None
    for line in lines[start + 1 :]:
        s = line.strip()
        if s.startswith("#"):
            break
        if not s.startswith("|"):
            if header is not None and rows:
                break
            continue
        cells = [c.strip() for c in s.strip("|").split("|")]
        if header is None:
            header = [c.strip("`").lower() for c in cells]
            continue
        if all(re.fullmatch(r":?-+:?", c) for c in cells):
            continue
        if "layer" not in header or "modules" not in header:
            raise AssertionError(f"the Import layers table needs columns `layer` and `modules`, has {header}")
        row = dict(zip(header, cells, strict=False))
        rows.append((row["layer"].strip("`* "), set(re.findall(r"`([\w.]+)`", row.get("modules", "")))))
    return rows


def table_mismatches(rows: list[tuple[str, set[str]]]) -> list[str]:
    want = [(name, set(prefixes)) for name, prefixes in LAYERS]
    out = []
    if [n for n, _ in rows] != [n for n, _ in want]:
        out.append(f"layers (bottom first): doc {[n for n, _ in rows]}, LAYERS {[n for n, _ in want]}")
    for (name, got), (wname, exp) in zip(rows, want, strict=False):
        if name == wname and got != exp:
            out.append(
                f"layer {name}: only in the doc {sorted(got - exp)}, only in LAYERS {sorted(exp - got)}"
            )
    return out


# ----------------------------------------------------------------------------------- the real tree


def test_no_upward_imports():
    edges = upward_edges(SRC)
    assert not edges, "imports that go up the layer table (tests/import_rules.py):\n" + "\n".join(edges)


def test_no_import_cycles():
    cycles = import_cycles(SRC)
    assert not cycles, "modules that import each other in a circle:\n" + "\n".join(cycles)


def test_every_module_sits_where_its_imports_say():
    bad = misplaced(SRC)
    assert not bad, "placements the imports do not support (tests/import_rules.py LAYERS):\n" + "\n".join(bad)


def test_no_private_names_of_other_modules():
    uses = private_uses(SRC)
    assert not uses, "uses of another module's private name:\n" + "\n".join(uses)


def test_every_module_is_placed_in_a_layer():
    missing = unplaced(SRC)
    assert not missing, "modules in no layer of tests/import_rules.py LAYERS: " + ", ".join(missing)


def test_architecture_doc_table_agrees_with_layers():
    rows = doc_layers(ARCHITECTURE.read_text()) if ARCHITECTURE.exists() else None
    if rows is None:
        pytest.skip('docs/architecture.md has no "Import layers" heading yet (format: tests/test_imports.py)')
    assert rows, 'no table under the "Import layers" heading of docs/architecture.md'
    bad = table_mismatches(rows)
    assert not bad, "docs/architecture.md vs tests/import_rules.py LAYERS:\n" + "\n".join(bad)


# ------------------------------------------------------------- each check fails on a planted fake tree


def fake_tree(tmp_path: Path, files: dict[str, str]) -> Path:
    src = tmp_path / "shipyard"
    for rel, text in {"__init__.py": "", **files}.items():
        p = src / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        for parent in p.relative_to(src).parents:
            init = src / parent / "__init__.py"
            if not init.exists():
                init.write_text("")
        p.write_text(text)
    return src


# One planted tree for both rules: upward imports (model -> train, data -> train relative, base -> cli,
# parallel -> eval through importlib) and uses of private names (from-import, attribute of a module
# imported three ways); public names, dunders, downward imports and a module's own privates are fine.
PLANTED = {
    "model/layers.py": "def _helper(): ...\ndef public(): ...\n_TABLE = {}\n\n\ndef f():\n"
    "    from shipyard.train import step\n    return step\n",
    "data/loader.py": "from ..train.step import make\n",
    "config.py": "import shipyard.cli.main\n",
    "parallel/mesh.py": "import importlib\nm = importlib.import_module('shipyard.eval.loglik')\n",
    "train/step.py": "from shipyard.model.layers import _helper, public\nfrom shipyard.model import layers\n"
    "from shipyard.config import Config\n\ndef make(): ...\n",
    "cli/main.py": "from shipyard.train import step\n",
    "eval/loglik.py": "",
    "train/trainer.py": "from shipyard.model import layers\n\ndef f():\n    return layers._TABLE\n",
    "train/loss.py": "import shipyard.model.layers as L\nx = L._helper\n",
    "train/optim.py": "import shipyard.model.layers\ny = shipyard.model.layers._helper\n",
    "train/metrics.py": "from . import step\nz = step.__name__\n\ndef _own(): ...\nw = _own\n",
}


def test_upward_imports_are_caught(tmp_path):
    src = fake_tree(tmp_path, PLANTED)
    edges = upward_edges(src)
    text = "\n".join(edges)
    assert (
        "shipyard/model/layers.py:7 shipyard.model.layers (model) imports shipyard.train.step (train)" in text
    )
    assert "shipyard/data/loader.py:1 shipyard.data.loader (data) imports shipyard.train.step (train)" in text
    assert "shipyard/config.py:1 shipyard.config (base) imports shipyard.cli.main (cli)" in text
    assert "shipyard/parallel/mesh.py:2" in text and "shipyard.eval.loglik (eval)" in text
    # downward and same-layer imports are fine
    assert not any(e.startswith(("shipyard/train/", "shipyard/cli/")) for e in edges), edges


def test_private_names_are_caught(tmp_path):
    src = fake_tree(tmp_path, PLANTED)
    uses = private_uses(src)
    text = "\n".join(uses)
    assert "shipyard/train/step.py:1 shipyard.train.step imports shipyard.model.layers._helper" in text
    assert "shipyard/train/trainer.py:4 shipyard.train.trainer uses shipyard.model.layers._TABLE" in text
    assert "shipyard/train/loss.py:2 shipyard.train.loss uses shipyard.model.layers._helper" in text
    assert "shipyard/train/optim.py:2 shipyard.train.optim uses shipyard.model.layers._helper" in text
    assert len(uses) == 4, uses  # `public`, dunders and a module's own private names are fine


def test_unplaced_modules_are_caught(tmp_path):
    src = fake_tree(tmp_path, {"newthing.py": "", "model/layers.py": "", "tools/x.py": ""})
    assert unplaced(src) == ["shipyard.newthing", "shipyard.tools", "shipyard.tools.x"]


def test_import_cycles_are_caught(tmp_path):
    # a two-module circle closed by a function-local import (as model/quant.py once closed one through
    # transformer.param_specs), a three-module one through a relative import, and a chain that is no circle
    src = fake_tree(
        tmp_path,
        {
            "model/quant.py": "def f():\n    from shipyard.model.transformer import param_specs\n",
            "model/transformer.py": "from shipyard.model import quant\n",
            "data/a.py": "from . import b\n",
            "data/b.py": "import shipyard.data.c\n",
            "data/c.py": "\n\nfrom shipyard.data.a import x\n",
            "train/x.py": "from shipyard.train import y\n",
            "train/y.py": "from shipyard.model import quant\n",
        },
    )
    cycles = import_cycles(src)
    assert len(cycles) == 2, cycles
    text = "\n".join(cycles)
    assert "shipyard/model/quant.py:2 shipyard.model.quant -> shipyard.model.transformer" in text
    assert "shipyard/model/transformer.py:1 shipyard.model.transformer -> shipyard.model.quant" in text
    assert "3 modules (shipyard.data.a, shipyard.data.b, shipyard.data.c)" in text
    assert "shipyard/data/c.py:3 shipyard.data.c -> shipyard.data.a" in text
    assert "train" not in text


def test_placements_the_imports_do_not_support_are_caught(tmp_path):
    # the old trick: a top-level module that reads like a lower layer filed under train (so train's
    # imports of it looked downward), and a package's module listed apart from its package
    src = fake_tree(
        tmp_path,
        {
            "runs.py": "from shipyard.config import Config\n",
            "config.py": "",
            "plan.py": "def f():\n    from shipyard.train import program\n",
            "train/program.py": "",
            "train/checkpoint.py": "",
            "model/layers.py": "",
        },
    )
    layers = [
        ("base", ("shipyard", "shipyard.config")),
        ("model", ("shipyard.model", "shipyard.train.checkpoint")),
        ("train", ("shipyard.train", "shipyard.runs", "shipyard.plan")),
    ]
    bad = misplaced(src, layers)
    assert len(bad) == 2, bad
    assert "shipyard.train.checkpoint is listed under model, apart from its package shipyard.train" in bad
    assert (
        "shipyard/runs.py is listed under train, but its highest import is shipyard.config (base): "
        "it belongs in base"
    ) in bad
    # where the imports do put it (plan imports train), the placement stands
    assert misplaced(src, [layers[0], ("model", ("shipyard.model",)), layers[2]]) == [bad[1]]


def test_doc_table_is_parsed_and_compared():
    good = "\n".join(
        ["# Architecture", "", "## Import layers", "", "| layer | modules | notes |", "|---|---|---|"]
        + [f"| `{n}` | {', '.join(f'`{p}`' for p in reversed(ps))} | x |" for n, ps in LAYERS]
        + ["", "## Next", "| layer | modules |"]
    )
    rows = doc_layers(good)
    assert rows is not None and len(rows) == len(LAYERS)
    assert table_mismatches(rows) == []
    swapped = good.replace("| `model` |", "| `tmp` |").replace("| `parallel` |", "| `model` |")
    swapped = swapped.replace("| `tmp` |", "| `parallel` |")
    assert any("bottom first" in m for m in table_mismatches(doc_layers(swapped)))
    moved = good.replace("`shipyard.plan`, ", "").replace(", `shipyard.plan`", "")
    bad = table_mismatches(doc_layers(moved))
    assert bad == ["layer train: only in the doc [], only in LAYERS ['shipyard.plan']"], bad
    assert doc_layers("# Architecture\n\nno table here\n") is None
