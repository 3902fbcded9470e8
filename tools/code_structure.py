"""Structure report over src/shipyard: the longest functions, the widest signatures, every import
cycle between modules, every import that goes up the layer table and every placement the imports do
not support (tests/test_imports.py enforces the same rules), plus imports of another module's
private names.

    python tools/code_structure.py [--top N] [--src PATH]

`--src` reads another checkout's package (an older commit in a `git worktree`) for a before/after
table; its layer columns use today's table.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from import_rules import import_cycles, imports_of, layer_of, misplaced, modules, upward_edges  # noqa: E402


def function_lengths(src: Path) -> list[tuple[int, str]]:
    out = []
    for path in sorted(src.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                out.append((n, f"{path.relative_to(src.parent)}:{node.lineno} {node.name}"))
    return sorted(out, reverse=True)


def parameter_counts(src: Path) -> list[tuple[int, str]]:
    """(parameters, where) of every function, self/cls not counted, widest first."""
    out = []
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
                n += (a.vararg is not None) + (a.kwarg is not None)
                if a.args and a.args[0].arg in ("self", "cls"):
                    n -= 1
                out.append((n, f"{path.relative_to(src.parent)}:{node.lineno} {node.name}"))
    return sorted(out, reverse=True)


def private_imports(src: Path) -> list[str]:
    out = []
    for mod, path in modules(src).items():
        for target, names, line in imports_of(path, mod):
            for name in names:
                if name.startswith("_") and not name.startswith("__") and target != mod:
                    out.append(f"{path.relative_to(src.parent)}:{line} imports {target}.{name}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--src", type=Path, default=ROOT / "src" / "shipyard", help="the package to read")
    args = ap.parse_args()
    src = args.src.resolve()
    print(f"# longest functions (top {args.top})")
    for n, where in function_lengths(src)[: args.top]:
        print(f"{n:5d}  {where}")
    print(f"\n# widest signatures (top {args.top})")
    for n, where in parameter_counts(src)[: args.top]:
        print(f"{n:5d}  {where}")
    cycles = import_cycles(src)
    print(f"\n# import cycles: {len(cycles)}")
    for c in cycles:
        print("  " + c)
    edges = upward_edges(src)
    print(f"\n# upward imports: {len(edges)}")
    for e in edges:
        print("  " + e)
    bad = misplaced(src)
    print(f"\n# placements the imports do not support: {len(bad)}")
    for b in bad:
        print("  " + b)
    priv = private_imports(src)
    print(f"\n# imports of another module's private name: {len(priv)}")
    for p in priv:
        print("  " + p)
    print(f"\n# modules by layer: {sum(1 for m in modules(src) if layer_of(m) is not None)} placed")


if __name__ == "__main__":
    main()
