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
    (
        "base",
        (
            "shipyard",
            "shipyard.errors",
            "shipyard.config",
            "shipyard.output",
            "shipyard.cpu_tuning",
            "shipyard.storage",
        ),
    ),
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


def _dynamic_import(node: ast.Call) -> str | None:
    """The module named by `importlib.import_module("x.y")` / `__import__(f"x.{name}")`: for an
    f-string, the package its constant prefix names."""
    f = node.func
    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        prefix = str(arg.values[0].value)
        return prefix.rsplit(".", 1)[0] if "." in prefix else None
    return None


def imports_of(path: Path, module: str) -> list[tuple[str, list[str], int]]:
    """(imported module, imported names, line) for every import in the file, function-local ones too,
    and `importlib.import_module` / `__import__` calls with a literal (or f-string prefix) name."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and (target := _dynamic_import(node)):
            out.append((target, [], node.lineno))
        elif isinstance(node, ast.Import):
            out.extend((a.name, [], node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, path, module)
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


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(src: Path) -> list[str]:
    """Every use of another shipyard module's `_private` name: `from shipyard.x import _y`, and
    `alias._y` where alias is a shipyard module bound by an import in the file (`import shipyard.x
    as alias`, `from shipyard import x`, or the full dotted name after `import shipyard.x`)."""
    mods = modules(src)
    out = []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text())
        where = path.relative_to(src.parent)
        aliases: dict[str, str] = {}  # local name (or dotted chain) -> shipyard module
        for target, names, line in imports_of(path, mod):
            if target in mods and target != mod:
                for n in names:
                    if _is_private(n) and f"{target}.{n}" not in mods:
                        out.append(f"{where}:{line} {mod} imports {target}.{n}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in mods:
                        aliases[a.asname or a.name] = a.name
                        if not a.asname:  # `import shipyard.x.y` also makes shipyard.x.y reachable
                            parts = a.name.split(".")
                            for i in range(1, len(parts) + 1):
                                if ".".join(parts[:i]) in mods:
                                    aliases[".".join(parts[:i])] = ".".join(parts[:i])
            elif isinstance(node, ast.ImportFrom):
                base = _from_base(node, path, mod)
                for a in node.names:
                    full = f"{base}.{a.name}"
                    if full in mods:
                        aliases[a.asname or a.name] = full
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr):
                chain = _dotted(node.value)
                target = aliases.get(chain) if chain else None
                if target and target != mod:
                    out.append(f"{where}:{node.lineno} {mod} uses {target}.{node.attr}")
    return sorted(set(out))


def _from_base(node: ast.ImportFrom, path: Path, module: str) -> str:
    base = node.module or ""
    if node.level:
        pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        pkg = pkg[: len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([base] if base else []))
    return base


def _dotted(node: ast.expr) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])
