"""Structure report over src/shipyard: the longest functions and every import that goes up the
layer table (tests/test_imports.py enforces the same table), plus imports of another module's
private names.

    python tools/code_structure.py [--top N]
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from import_rules import imports_of, layer_of, modules, upward_edges  # noqa: E402


def function_lengths(src: Path) -> list[tuple[int, str]]:
    out = []
    for path in sorted(src.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
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
    args = ap.parse_args()
    src = ROOT / "src" / "shipyard"
    print(f"# longest functions (top {args.top})")
    for n, where in function_lengths(src)[: args.top]:
        print(f"{n:5d}  {where}")
    edges = upward_edges(src)
    print(f"\n# upward imports: {len(edges)}")
    for e in edges:
        print("  " + e)
    priv = private_imports(src)
    print(f"\n# imports of another module's private name: {len(priv)}")
    for p in priv:
        print("  " + p)
    print(f"\n# modules by layer: {sum(1 for m in modules(src) if layer_of(m) is not None)} placed")


if __name__ == "__main__":
    main()
