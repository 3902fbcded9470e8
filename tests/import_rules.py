"""The import-direction rule: which part of shipyard may import which.

Each module belongs to one layer; a module may import its own layer and the layers below, never a
layer above. The same table is in docs/architecture.md ("Import layers"); tests/test_imports.py
checks both the rule and that the two tables agree. Read by tools/code_structure.py too.
"""

from __future__ import annotations

import ast
from pathlib import Path

# Bottom first. A module is placed by its longest matching prefix.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("shipyard", "shipyard.errors", "shipyard.config", "shipyard.output", "shipyard.cpu_tuning")),
    ("parallel", ("shipyard.parallel",)),
    ("model", ("shipyard.model",)),
    ("data", ("shipyard.data",)),
    ("interop", ("shipyard.interop",)),
    ("train", ("shipyard.train", "shipyard.runs")),
    ("inference", ("shipyard.inference",)),
    ("eval", ("shipyard.eval",)),
    ("plan", ("shipyard.plan", "shipyard.report")),
    ("pipeline", ("shipyard.pipeline",)),
    ("cli", ("shipyard.cli", "shipyard.lm_eval_adapter")),
]


def layer_of(module: str) -> int | None:
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            # the bare package name places only shipyard/__init__.py, not everything under it
            inside = module.startswith(p + ".") and p != "shipyard"
            if (module == p or inside) and len(p) > best_len:
                best, best_len = i, len(p)
    return best


def modules(src: Path) -> dict[str, Path]:
    """Module name -> file for every .py under src (the shipyard package directory)."""
    out = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(path: Path, module: str) -> list[tuple[str, list[str], int]]:
    """(imported module, imported names, line) for every import in the file, function-local ones too."""
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.extend((a.name, [], node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if is_pkg else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            names = [a.name for a in node.names]
            out.append((base, names, node.lineno))
            # `from shipyard.model import layers` imports the module shipyard.model.layers
            out.extend((f"{base}.{n}", [], node.lineno) for n in names)
    return out


def upward_edges(src: Path) -> list[str]:
    mods = modules(src)
    edges = []
    for mod, path in mods.items():
        own = layer_of(mod)
        for target, _, line in imports_of(path, mod):
            if not (target == "shipyard" or target.startswith("shipyard.")) or target not in mods:
                continue
            other = layer_of(target)
            if own is not None and other is not None and other > own:
                edges.append(
                    f"{path.relative_to(src.parent)}:{line} {mod} ({LAYERS[own][0]}) imports "
                    f"{target} ({LAYERS[other][0]})"
                )
    return edges
