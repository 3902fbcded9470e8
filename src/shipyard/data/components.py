"""Connected components of a graph too big for one process: alternating large-star and small-star
rounds (Kiveris et al., "Connected Components in MapReduce and Beyond", 2014) over edge files
partitioned by node (shuffle.py).

Each round is one task per partition. A task reads the directed edges (a, b) whose `a` falls in its
partition, groups them by `a`, and writes new undirected edges (both directions, each to its first
node's partition) for the next round:

- large-star: every neighbour `b > a` is linked to m(a), the smallest of `a` and its neighbours;
- small-star: every neighbour `b < a`, and `a` itself, is linked to the smallest of those.

Neither changes which nodes are connected, and alternating them turns every component into a star
centred on its smallest node in O(log^2 n) rounds (in practice a handful). A large-star round whose
input already is such a star (every node with a smaller neighbour has no other) writes the same
edges back, so it is the last one: its tasks also write the nodes that are not their component's
smallest (each had exactly one, smaller, neighbour), partitioned by group of units for the next step.
No process holds more than one partition's edges; the driver holds a flag per task.
"""

from __future__ import annotations

import numpy as np

from shipyard.data import shuffle
from shipyard.data.resume import Journals, no_journal
from shipyard.data.stage import Workers, run_tasks
from shipyard.errors import DataError

EDGE = np.dtype([("a", "<u8"), ("b", "<u8")])
NODE = np.dtype([("idx", "<u8")])
MAX_ROUNDS = 64
"""Rounds before giving up (a star forms in O(log^2 n) rounds: 64 is far beyond any real graph)."""


def node_partition(nodes: np.ndarray, partitions: int) -> np.ndarray:
    return (shuffle.mix64(nodes) % np.uint64(partitions)).astype(np.int64)


def unit_of(idx: np.ndarray) -> np.ndarray:
    """The work unit a document index (unit << 32 | k) belongs to."""
    return (np.asarray(idx, np.uint64) >> np.uint64(32)).astype(np.int64)


def write_edges(path: str, x: np.ndarray, y: np.ndarray, partitions: int) -> str:
    """Undirected edges {x, y} as directed records both ways, each in its first node's partition;
    the file's sha256."""
    records = np.empty(2 * len(x), EDGE)
    records["a"] = np.concatenate((x, y))
    records["b"] = np.concatenate((y, x))
    return shuffle.write(path, records, node_partition(records["a"], partitions), partitions)


def grouped(edges: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(a, b, first b of a's group) of the distinct edges, sorted by (a, b)."""
    pairs = np.unique(np.stack([edges["a"], edges["b"]], axis=1), axis=0)  # sorted by (a, b)
    a, b = pairs[:, 0], pairs[:, 1]
    starts = np.concatenate(([True], a[1:] != a[:-1])) if len(a) else np.zeros(0, bool)
    first = b[np.maximum.accumulate(np.where(starts, np.arange(len(a)), 0))] if len(a) else b
    return a, b, first


def large_star(a, b, first) -> tuple[np.ndarray, np.ndarray, bool, np.ndarray]:
    """(new edges x, y; whether the input was already stars; the nodes that are not centres)."""
    m = np.minimum(a, first)  # the smallest of a and its neighbours (b is sorted within a's group)
    up = b > a
    smaller = np.unique(a[first < a])  # nodes with a smaller neighbour
    degree = np.unique(a, return_counts=True)
    star = bool(np.all(degree[1][np.isin(degree[0], smaller)] == 1))
    return b[up], m[up], star, smaller


def small_star(a, b, first) -> tuple[np.ndarray, np.ndarray]:
    down = b < a
    m = first[down]  # the smallest neighbour below a (the first of a's sorted group)
    link = b[down] != m
    centre = np.unique(a[down], return_index=True)[1]  # once per node: a itself to its smallest
    return np.concatenate((b[down][link], a[down][centre])), np.concatenate((m[link], m[centre]))


def star_task(item: tuple) -> dict:
    """One partition of one round: ('large' | 'small', p, sources, target, partitions, removed,
    (units, groups))."""
    kind, p, sources, target, partitions, removed, (units, groups) = item
    a, b, first = grouped(shuffle.gather(sources, p, partitions, EDGE))
    if kind == "small":
        x, y = small_star(a, b, first)
        return {"edges": len(x), "files": {target: write_edges(target, x, y, partitions)}}
    x, y, star, smaller = large_star(a, b, first)
    files = {target: write_edges(target, x, y, partitions)}
    nodes = np.zeros(len(smaller), NODE)
    nodes["idx"] = smaller
    files[removed] = shuffle.write(removed, nodes, unit_of(smaller) * groups // units, groups)
    return {"edges": len(x), "star": star, "files": files}


def non_centres(
    work: str,
    sources: list[str],
    partitions: int,
    shape: tuple[int, int],
    workers: Workers,
    journal: Journals = no_journal,
) -> list[str]:
    """Files of every node that is not the smallest of its connected component, for the graph whose
    directed edges (both ways) are in `sources` (partitioned by `node_partition`). `shape`: (units,
    groups); the files are partitioned by group (unit * groups // units). `journal(name)`: the
    resume journal of a round (`StageDir.journal`), so a rerun goes on from the finished rounds."""
    for r in range(MAX_ROUNDS):
        kind = "large" if r % 2 == 0 else "small"
        targets = [f"{work}/cc{r + 1}/{p:05d}.bin" for p in range(partitions)]
        removed = [f"{work}/cc{r + 1}/removed-{p:05d}.bin" for p in range(partitions)]
        items = [(kind, p, sources, targets[p], partitions, removed[p], shape) for p in range(partitions)]
        desc = f"dedup: components, round {r + 1} ({kind} star)"
        results = run_tasks(desc, star_task, items, workers, journal(f"cc{r + 1}"))
        if kind == "large" and all(res["star"] for res in results):
            return removed
        sources = targets
    raise DataError(
        f"data dedup: duplicate clusters did not settle in {MAX_ROUNDS} rounds (a bug: report it)"
    )
