"""The import-direction rule: which part of shipyard may import which.

Each module belongs to one layer; a module may import its own layer and the layers below, never a
layer above. The same table is in docs/architecture.md ("Import layers"); tests/test_imports.py
checks both the rule and that the two tables agree. Read by tools/code_structure.py too.
"""

from __future__ import annotations

import ast
from pathlib import Path

# Bottom first. A module is placed by its longest matching prefix. A prefix names a package (a
# directory: everything under it) or a module directly under shipyard/; a top-level module must sit in
# the layer its imports say (the highest layer it imports from, base when none): `misplaced`.
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
            "shipyard.user_cache",
        ),
    ),
    ("parallel", ("shipyard.parallel",)),
    ("model", ("shipyard.model",)),
    ("data", ("shipyard.data",)),
    ("interop", ("shipyard.interop",)),
    ("run", ("shipyard.run",)),
    ("train", ("shipyard.train", "shipyard.plan", "shipyard.plan_target", "shipyard.plan_search")),
    ("inference", ("shipyard.inference",)),
    ("eval", ("shipyard.eval", "shipyard.lm_eval_adapter")),
    ("rl", ("shipyard.rl",)),
    ("experiment", ("shipyard.experiment",)),
    ("browse", ("shipyard.browse",)),
    ("cli", ("shipyard.cli",)),
]


def layer_of(module: str, layers: list[tuple[str, tuple[str, ...]]] = LAYERS) -> int | None:
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(layers):
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


def upward_edges(src: Path, layers: list[tuple[str, tuple[str, ...]]] = LAYERS) -> list[str]:
    mods = modules(src)
    edges = []
    for mod, path in mods.items():
        own = layer_of(mod, layers)
        for target, _, line in imports_of(path, mod):
            if not (target == "shipyard" or target.startswith("shipyard.")) or target not in mods:
                continue
            other = layer_of(target, layers)
            if own is not None and other is not None and other > own:
                edges.append(
                    f"{path.relative_to(src.parent)}:{line} {mod} ({layers[own][0]}) imports "
                    f"{target} ({layers[other][0]})"
                )
    return edges


def import_graph(src: Path) -> dict[str, dict[str, int]]:
    """module -> {shipyard module it imports: first line}, function-local imports included."""
    mods = modules(src)
    graph: dict[str, dict[str, int]] = {m: {} for m in mods}
    for mod, path in mods.items():
        for target, _, line in imports_of(path, mod):
            if target in mods and target != mod:
                graph[mod].setdefault(target, line)
    return graph


def import_cycles(src: Path) -> list[str]:
    """Every group of modules that import each other round in a circle (a strongly connected
    component of the import graph with more than one module), each said as one cycle through it with
    the file:line of every edge, e.g. `a.py:3 a -> b; b.py:9 b -> a`."""
    graph = import_graph(src)
    mods = modules(src)
    out = []
    for group in _components(graph):
        if len(group) < 2:
            continue
        members = set(group)
        # one cycle through the group's first module: a shortest path back to it inside the group
        first = min(group)
        paths = {first: [first]}
        frontier = [first]
        cycle = None
        while frontier and cycle is None:
            nxt = []
            for m in frontier:
                for t in sorted(graph[m]):
                    if t == first:
                        cycle = paths[m] + [first]
                        break
                    if t in members and t not in paths:
                        paths[t] = paths[m] + [t]
                        nxt.append(t)
                if cycle is not None:
                    break
            frontier = nxt
        hops = [
            f"{mods[a].relative_to(src.parent)}:{graph[a][b]} {a} -> {b}" for a, b in zip(cycle, cycle[1:])
        ]
        out.append(f"{len(group)} modules ({', '.join(sorted(group))}): " + "; ".join(hops))
    return out


def _components(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components (Tarjan's algorithm, iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    group.append(m)
                    if m == node:
                        break
                out.append(group)
    return out


def misplaced(src: Path, layers: list[tuple[str, tuple[str, ...]]] = LAYERS) -> list[str]:
    """Placements the imports do not support: a prefix in `layers` that names a module inside a
    package (a package's modules go where the package goes), and a module directly under shipyard/
    listed in another layer than the highest one it imports from (base when it imports nothing
    placed). So a module cannot be filed in a layer its imports do not put it in."""
    mods = modules(src)
    graph = import_graph(src)
    packages = {m for m, p in mods.items() if p.name == "__init__.py"}
    out = []
    for name, prefixes in layers:
        for p in prefixes:
            parent = p.rsplit(".", 1)[0]
            if p in mods and p not in packages and parent != "shipyard" and parent in packages:
                out.append(f"{p} is listed under {name}, apart from its package {parent}")
    for mod, path in mods.items():
        if mod in packages or mod.count(".") != 1:
            continue
        own = layer_of(mod, layers)
        placed = [(layer_of(t, layers), t) for t in graph[mod]]
        top, why = max(((lay, t) for lay, t in placed if lay is not None), default=(0, None))
        if own is not None and own != top:
            because = (
                f"its highest import is {why} ({layers[top][0]})" if why else "it imports nothing placed"
            )
            out.append(
                f"{path.relative_to(src.parent)} is listed under {layers[own][0]}, but {because}: "
                f"it belongs in {layers[top][0]}"
            )
    return out


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
