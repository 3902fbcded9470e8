"""The artifact graph of a pipeline root: every finished step as a node, its inputs as edges, each
node's artifacts re-hashed and compared with what its provenance recorded.

A step directory is `<root>/<name>-<hash>` holding provenance.json (experiment/executor.py:
`run_step`). An edge goes from the step an input named with `@step` to the step reading it; the
upstream directory is found by the recorded input path, so a root moved as a whole still links up.
Verification recomputes `experiment.steps.digest` (the function the executor recorded them with:
the same files, the same rules) and compares: a node whose own artifacts changed is `differs`,
every node downstream of it `upstream` (its inputs are not what it was made from); a directory
without `_SUCCESS` is `incomplete`. A root that is a single run directory (no step directories)
is one node of kind `run`.

A running server verifies again before each page (`verify(..., track=True)` over the nodes it
verified before): each node remembers the sha256 of every file in its directory, taken through the
per-user hash cache (data/hashcache.py), so a file whose stat (size, mtime_ns, ctime_ns, inode) is
what it was when last hashed is not read again, and only a node with a changed, added or removed
file is digested again. The recorded digests cover a node's files together (one sha256 over all
of them), so that node's `digest` reads all of its files once more; every other node costs a stat
per file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from shipyard.data.hashcache import sha256_files
from shipyard.errors import DataError

MARKER = "_SUCCESS"
STATUS = {
    "verified": "✓ verified",
    "differs": "✗ differs",
    "upstream": "✗ upstream differs",
    "incomplete": "— incomplete",
    "unverified": "— not yet verified",
}
"""Each node status and how a page shows it."""
DATA_KINDS = ("stdlib", "extract", "filter", "dedup", "decontaminate", "classify", "tokenize")
"""Kinds whose output (or whose drops) a data page shows."""
RUN_KINDS = ("train", "run")
"""Kinds that are run directories (curves, batches, a checkpoint)."""


@dataclass(frozen=True)
class Node:
    """One step directory of the root."""

    key: str
    """The directory's name (`<name>-<hash>`): the node's identity and its pages' file names."""
    name: str
    """The step's name in its pipeline."""
    kind: str
    """The step's kind (filter, dedup, tokenize, train, ...); `run` for a bare run directory."""
    path: Path
    """The step's directory."""
    provenance: dict
    """provenance.json as written (empty for a bare run directory)."""
    parents: tuple[str, ...] = ()
    """Keys of the steps this one read (its `@step` inputs)."""
    status: str = "unverified"
    """One of STATUS."""
    why: str = ""
    """What differs (artifact names, recorded vs now), or which upstream node does."""
    recomputed: dict = field(default_factory=dict)
    """The artifact digests as computed now (empty until verified)."""
    files: dict[str, str] | None = None
    """{name relative to `path`: sha256} of every file in the directory, hashed just before its
    artifacts were digested (`verify(..., track=True)`; None when not tracked)."""

    @property
    def recorded(self) -> dict:
        """The artifact digests its provenance recorded."""
        return self.provenance.get("artifacts", {})

    @property
    def config(self) -> dict:
        return self.provenance.get("step", {}).get("config", {})


def scan(root: Path) -> list[Node]:
    """The nodes of `root` (a pipeline root or a run directory), parents resolved, unverified, in
    dependency order. DataError when `root` is neither."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"browse: {root} is not a directory (expected a pipeline root or a run directory)")
    inside = root.resolve()
    # a symlink that leads out of ROOT is not ROOT's: never read, never shown
    dirs = sorted(
        p
        for p in root.iterdir()
        if p.is_dir() and p.resolve().is_relative_to(inside) and (p / "provenance.json").is_file()
    )
    if not dirs:
        if (root / "config.yaml").is_file() and (root / "metrics.jsonl").is_file():
            return [Node(key=root.name, name=root.name, kind="run", path=root, provenance={})]
        raise DataError(
            f"browse: {root} holds no pipeline steps (directories with provenance.json) and is not a run "
            "directory (config.yaml and metrics.jsonl); give the root of `shipyard run` / `shipyard "
            "quickstart` or a run directory"
        )
    nodes = {}
    for d in dirs:
        try:
            prov = json.loads((d / "provenance.json").read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"browse: {d / 'provenance.json'} is not valid JSON ({e})") from e
        step = prov.get("step", {})
        nodes[d.name] = Node(d.name, step.get("name", d.name), step.get("kind", "?"), d, prov)
    by_path = {n.path.resolve(): k for k, n in nodes.items()}
    linked = {}
    for k, n in nodes.items():
        parents = []
        for role, ref in n.provenance.get("step", {}).get("inputs", {}).items():
            if not str(ref).startswith("@"):
                continue
            recorded = Path(str(n.provenance.get("inputs", {}).get(role, "")))
            sub = str(ref)[1:].partition("/")[2]
            upstream = recorded.parents[len(Path(sub).parts) - 1] if sub else recorded
            # (a root that moved as a whole: the recorded directory's name still is a node's)
            key = by_path.get(upstream.resolve()) or (upstream.name if upstream.name in nodes else None)
            if key is not None and key not in parents:
                parents.append(key)
        linked[k] = replace(n, parents=tuple(parents))
    return _ordered(linked)


def _ordered(nodes: dict[str, Node]) -> list[Node]:
    """Nodes with every parent before its children (ties by name)."""
    out, placed = [], set()
    while len(out) < len(nodes):
        ready = sorted(k for k, n in nodes.items() if k not in placed and set(n.parents) <= placed)
        if not ready:  # a cycle cannot come from the executor; show what is left as it is
            ready = sorted(k for k in nodes if k not in placed)
        for k in ready:
            out.append(nodes[k])
            placed.add(k)
    return out


def verify(nodes: list[Node], track: bool = False) -> list[Node]:
    """The nodes with their artifacts re-hashed (`experiment.steps.digest`) and compared with the
    recorded ones; downstream of a node that differs, `upstream`.

    With `track` each node keeps its files' sha256 (`Node.files`, see `file_hashes`), and a node that
    already carries them (from an earlier tracked verify) and whose files still hash the same keeps
    its own verdict without `digest`: a request over an unchanged root reads no file. The upstream
    marks are always worked out afresh."""
    done: dict[str, Node] = {}
    for n in nodes:
        node = _own_verdict(n, track)
        bad = [p for p in n.parents if p in done and done[p].status in ("differs", "upstream")]
        if bad and node.status == "verified":
            node = replace(node, status="upstream", why="made from " + ", ".join(bad) + ", which differ")
        done[n.key] = node
    return [done[n.key] for n in nodes]


def _own_verdict(n: Node, track: bool) -> Node:
    """`n` judged by its own artifacts: verified, differs, incomplete (`upstream` is verify's)."""
    from shipyard.experiment.steps import digest

    if n.kind == "run":
        return replace(n, status="unverified", why="a run directory records no artifact digests")
    if not (n.path / MARKER).exists():
        why = f"no {MARKER}: the step did not finish"
        return replace(n, status="incomplete", why=why, recomputed={}, files=None)
    # hashed before `digest` reads the files: a file changed in between differs from `files` next time
    files = file_hashes(n.path) if track else None
    if files is not None and files == n.files:  # the bytes it was last judged on
        return replace(n, status="verified", why="") if n.status == "upstream" else n
    try:
        now = digest(n.kind, n.path)
    except Exception as e:  # a damaged artifact may not even load: that is a difference, shown
        now = {"error": f"{type(e).__name__}: {e}"}
    if now != n.recorded:
        names = sorted(k for k in set(now) | set(n.recorded) if now.get(k) != n.recorded.get(k))
        return replace(n, status="differs", why="changed: " + ", ".join(names), recomputed=now, files=files)
    return replace(n, status="verified", why="", recomputed=now, files=files)


def file_hashes(path: Path) -> dict[str, str]:
    """{name relative to `path`: sha256} of every file under `path`, through the per-user hash cache
    (data/hashcache.py: a file whose size, mtime_ns, ctime_ns and inode are what they were when it
    was last hashed is not read; one changed less than RACY_NS before it was hashed is read again)."""
    return sha256_files(path, sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()))


def children(nodes: list[Node]) -> dict[str, list[str]]:
    """key -> keys of the nodes that read it."""
    out: dict[str, list[str]] = {n.key: [] for n in nodes}
    for n in nodes:
        for p in n.parents:
            out.setdefault(p, []).append(n.key)
    return out


def depths(nodes: list[Node]) -> dict[str, int]:
    """key -> the longest chain of parents behind it (the graph's column)."""
    out: dict[str, int] = {}
    for n in nodes:  # dependency order: parents first
        out[n.key] = 1 + max((out[p] for p in n.parents if p in out), default=-1)
    return out
