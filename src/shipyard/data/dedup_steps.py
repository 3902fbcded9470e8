"""The shuffles of `data dedup` (dedup.py): exact duplicates by their key, LSH bands by their value,
candidate pairs verified where their two documents' signatures live, duplicate clusters by a
distributed connected-components pass (components.py).

Every step is a set of tasks (per work unit, per group of consecutive units, or per partition)
that read and write files under the stage's scratch prefix (`Scratch`, inside the output being
built, so a shared filesystem or a bucket the stage already writes to); the driver passes task
numbers and folds counts. The map side of every shuffle is a group of units, not a unit: with G
groups and P partitions a shuffle is G x P ranged reads, where per-unit maps would make U x P (at
63 TB, 940k units: a hundred times more). A document
is named by its index `(unit << 32) | k` (its k-th document of unit `unit`), which orders
documents as the input does, so "the first document of a cluster" is the smallest index.

The result is the same as clustering everything in one process (tests/test_dedup.py checks it
against that reference on corpora with chains of near-duplicates): exact duplicates join the first
document with the same key; among the rest, documents equal on a whole band are candidates, each
compared with its bucket's first member and with its predecessor; candidates whose estimated
Jaccard similarity reaches the threshold are edges; each connected component keeps its first
document.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from shipyard.data import components, shuffle
from shipyard.data.components import NODE, unit_of
from shipyard.data.configs import DedupConfig
from shipyard.data.resume import Journals, no_journal
from shipyard.data.stage import Workers, run_tasks

LOW = np.uint64(0xFFFFFFFF)
EMPTY = np.uint32(0xFFFFFFFF)  # the signature value of a document without words (dedup.minhash)

EXACT = np.dtype([("k0", "<u8"), ("k1", "<u8"), ("idx", "<u8")])
PAIR = np.dtype([("i", "<u8"), ("j", "<u8")])
REMOVED = np.dtype([("idx", "<u8"), ("first", "<u8")])


@dataclass(frozen=True)
class Scratch:
    """Where one dedup run's tasks exchange files, and the shape of its shuffles."""

    stage_dir: str
    """The output being built (`StageDir.parts`): a directory every task can reach, or a bucket
    prefix. The files go under its `_dedup/`, removed before the output is published."""
    units: int
    """Work units of the input (map tasks of the unit-side steps)."""
    partitions: int
    """Reduce tasks of the key-, band- and node-partitioned shuffles."""

    @property
    def root(self) -> str:
        return f"{self.stage_dir}/{SCRATCH}"

    @property
    def groups(self) -> int:
        """Map tasks of the shuffles and the verification hops, each over a contiguous range of units
        (`units_in`)."""
        return min(self.units, self.partitions)

    def group_of(self, idx: np.ndarray) -> np.ndarray:
        """The group of each document index."""
        return unit_of(idx) * self.groups // self.units

    def units_in(self, g: int) -> range:
        """The units of group `g` (those u with u * groups // units == g)."""
        return range(-(-g * self.units // self.groups), -(-(g + 1) * self.units // self.groups))

    def keys(self, u: int) -> str:
        return f"{self.root}/keys/{u:05d}.npy"

    def drops(self, u: int) -> str:
        return f"{self.root}/drops/{u:05d}.npy"

    def ids(self, u: int) -> str:
        return f"{self.root}/ids/{u:05d}.json"

    def sig(self, u: int) -> str:
        return f"{self.root}/sig/{u:05d}.npy"

    def files(self, step: str, count: int) -> list[str]:
        """The map-task files of one shuffle step."""
        return [f"{self.root}/{step}/{t:05d}.bin" for t in range(count)]


SCRATCH = "_dedup"


def index(u: int, n: int) -> np.ndarray:
    return (np.uint64(u) << np.uint64(32)) | np.arange(n, dtype=np.uint64)


# -- exact duplicates: a shuffle by key -------------------------------------------------------------


def write_exact_keys(scratch: Scratch, u: int, keys: list[bytes]) -> str:
    """In the sketch task: unit `u`'s exact keys with their document indices; the file's sha256."""
    records = np.zeros(len(keys), EXACT)
    if keys:
        words = np.frombuffer(b"".join(keys), "<u8").reshape(-1, 2)
        records["k0"], records["k1"] = words[:, 0], words[:, 1]
    records["idx"] = index(u, len(keys))
    return shuffle.put_array(scratch.keys(u), records)


def exact_map_task(item: tuple) -> dict:
    """Map group `g`: its units' keys in one file, partitioned by key (a key is a hash already)."""
    g, scratch = item
    parts = [shuffle.get_array(scratch.keys(u)) for u in scratch.units_in(g)]
    records = np.concatenate(parts) if parts else np.zeros(0, EXACT)
    part = (records["k0"] % np.uint64(scratch.partitions)).astype(np.int64)
    target = scratch.files("exact", scratch.groups)[g]
    return {"files": {target: shuffle.write(target, records, part, scratch.partitions)}}


def exact_task(item: tuple) -> dict:
    """Reduce partition `p`: each key's first document stays; the others are written (with that
    first one) partitioned by their group."""
    p, scratch, max_examples = item
    rec = shuffle.gather(scratch.files("exact", scratch.groups), p, scratch.partitions, EXACT)
    rec = rec[np.lexsort((rec["idx"], rec["k1"], rec["k0"]))]
    starts = np.ones(len(rec), bool)
    starts[1:] = (rec["k0"][1:] != rec["k0"][:-1]) | (rec["k1"][1:] != rec["k1"][:-1])
    first = rec["idx"][np.maximum.accumulate(np.where(starts, np.arange(len(rec)), 0))]
    removed = np.zeros(int((~starts).sum()), REMOVED)
    removed["idx"], removed["first"] = rec["idx"][~starts], first[~starts]
    removed = removed[np.argsort(removed["idx"], kind="stable")]
    target = scratch.files("exact-removed", scratch.partitions)[p]
    digest = shuffle.write(target, removed, scratch.group_of(removed["idx"]), scratch.groups)
    shown = [
        [int(r["idx"]), int(r["first"]), 1.0] for r in removed[:max_examples]
    ]  # lists: as JSON reads them
    return {"duplicates": len(removed), "examples": shown, "files": {target: digest}}


def run_exact(scratch: Scratch, cfg: DedupConfig, workers: Workers, journal: Journals = no_journal) -> dict:
    """Exact duplicates: their count and the first `max_examples // 2` (removed, kept, 1.0) triples.
    `journal(step)`: each step's resume journal (`StageDir.journal`)."""
    shown = cfg.max_examples // 2
    items = [(g, scratch) for g in range(scratch.groups)]
    run_tasks("dedup: exact keys", exact_map_task, items, workers, journal("exact-keys"))
    items = [(p, scratch, shown) for p in range(scratch.partitions)]
    results = run_tasks("dedup: exact duplicates", exact_task, items, workers, journal("exact"))
    examples = sorted(e for r in results for e in r["examples"])[:shown]
    return {"duplicates": sum(r["duplicates"] for r in results), "examples": examples}


def exact_removed(scratch: Scratch, g: int) -> np.ndarray:
    """Indices of group `g`'s exact duplicates."""
    files = scratch.files("exact-removed", scratch.partitions)
    return shuffle.gather(files, g, scratch.groups, REMOVED)["idx"]


# -- fuzzy duplicates: bands, pairs, verification, components ---------------------------------------


def band_task(item: tuple) -> dict:
    """Map group `g`: each alive, non-empty document's bands, partitioned by (band, value)."""
    g, scratch, cfg = item
    removed = exact_removed(scratch, g) if cfg.exact else np.zeros(0, np.uint64)
    dtype = band_dtype(cfg.rows)
    parts = []
    for u in scratch.units_in(g):
        sig = shuffle.get_array(scratch.sig(u))
        alive = sig[:, 0] != EMPTY if len(sig) else np.zeros(0, bool)
        alive[(removed[unit_of(removed) == u] & LOW).astype(np.int64)] = False
        k = np.flatnonzero(alive)
        records = np.zeros(len(k) * cfg.bands, dtype)
        records["band"] = np.repeat(np.arange(cfg.bands, dtype=np.uint32), len(k))
        # band-major: all of band 0's records, then band 1's, ... (as "band" and "idx" are laid out)
        bands = sig[k, : cfg.bands * cfg.rows].reshape(len(k), cfg.bands, cfg.rows)
        records["key"] = bands.transpose(1, 0, 2).reshape(-1, cfg.rows)
        records["idx"] = np.tile(index(u, len(sig))[k], cfg.bands)
        parts.append(records)
    records = np.concatenate(parts) if parts else np.zeros(0, dtype)
    h = shuffle.mix64(records["band"].astype(np.uint64))
    for r in range(cfg.rows):
        h = shuffle.mix64(h ^ records["key"][:, r].astype(np.uint64))
    part = (h % np.uint64(scratch.partitions)).astype(np.int64)
    target = scratch.files("bands", scratch.groups)[g]
    return {"files": {target: shuffle.write(target, records, part, scratch.partitions)}}


def band_dtype(rows: int) -> np.dtype:
    return np.dtype([("band", "<u4"), ("key", "<u4", (rows,)), ("idx", "<u8")])


def bucket_task(item: tuple) -> dict:
    """Reduce partition `q`: in each (band, value) bucket, in input order, every member is paired
    with the bucket's first member and with its predecessor (enough to connect the bucket without
    all m^2 pairs); pairs (i < j) are written partitioned by the group of i."""
    q, scratch, rows = item
    rec = shuffle.gather(scratch.files("bands", scratch.groups), q, scratch.partitions, band_dtype(rows))
    keys = [rec["idx"]] + [rec["key"][:, r] for r in reversed(range(rows))] + [rec["band"]]
    rec = rec[np.lexsort(keys)]
    same = (rec["band"][1:] == rec["band"][:-1]) & np.all(rec["key"][1:] == rec["key"][:-1], axis=1)
    members = rec["idx"]
    starts = np.concatenate(([True], ~same))
    first = members[np.maximum.accumulate(np.where(starts, np.arange(len(members)), 0))]
    inner = ~starts
    pairs = np.zeros(2 * int(inner.sum()), PAIR)
    pairs["i"] = np.concatenate((members[:-1][same], first[inner]))
    pairs["j"] = np.concatenate((members[1:][same], members[inner]))
    target = scratch.files("pairs", scratch.partitions)[q]
    return {"files": {target: shuffle.write(target, pairs, scratch.group_of(pairs["i"]), scratch.groups)}}


def half_dtype(num_perm: int) -> np.dtype:
    return np.dtype([("i", "<u8"), ("j", "<u8"), ("sig", "<u4", (num_perm,))])


def signatures(scratch: Scratch, idx: np.ndarray, num_perm: int) -> np.ndarray:
    """[len(idx), num_perm] signatures of the documents `idx`, read unit file by unit file."""
    out = np.zeros((len(idx), num_perm), np.uint32)
    units = unit_of(idx)
    for u in np.unique(units):
        rows = units == u
        out[rows] = shuffle.get_array(scratch.sig(int(u)))[(idx[rows] & LOW).astype(np.int64)]
    return out


def verify_i_task(item: tuple) -> dict:
    """Group `g`, where the pairs' first documents live: the distinct pairs (every copy of a pair came
    here), sent on with the first document's signature to the group of the second."""
    g, scratch, num_perm = item
    pairs = shuffle.gather(scratch.files("pairs", scratch.partitions), g, scratch.groups, PAIR)
    ij = (
        np.unique(np.stack([pairs["i"], pairs["j"]], axis=1), axis=0)
        if len(pairs)
        else np.zeros((0, 2), np.uint64)
    )
    half = np.zeros(len(ij), half_dtype(num_perm))
    half["i"], half["j"] = ij[:, 0], ij[:, 1]
    half["sig"] = signatures(scratch, half["i"], num_perm)
    target = scratch.files("half", scratch.groups)[g]
    digest = shuffle.write(target, half, scratch.group_of(half["j"]), scratch.groups)
    return {"candidate_pairs": len(ij), "files": {target: digest}}


PARTNER = np.dtype([("j", "<u8"), ("i", "<u8"), ("jaccard", "<f8")])


def verify_j_task(item: tuple) -> dict:
    """Group `g`, where the pairs' second documents live: estimated Jaccard similarity; the similar
    pairs become the graph's edges, and each second document's most recent similar partner (the
    largest i) is kept for the examples."""
    g, scratch, num_perm, threshold = item
    half = shuffle.gather(scratch.files("half", scratch.groups), g, scratch.groups, half_dtype(num_perm))
    half = half[np.lexsort((half["j"], half["i"]))]  # (i, j) order, as one sorted pair list
    jac = (half["sig"] == signatures(scratch, half["j"], num_perm)).mean(axis=1) if len(half) else np.zeros(0)
    similar = jac >= threshold
    i, j = half["i"][similar], half["j"][similar]
    edges = scratch.files("cc0", scratch.groups)[g]
    files = {edges: components.write_edges(edges, i, j, scratch.partitions)}
    # for each j, the last similar pair in (i, j) order: the largest i
    order = np.lexsort((i, j))
    last = np.concatenate((j[order][1:] != j[order][:-1], [True])) if len(order) else np.zeros(0, bool)
    partner = np.zeros(int(last.sum()), PARTNER)
    partner["j"], partner["i"], partner["jaccard"] = j[order][last], i[order][last], jac[similar][order][last]
    target = f"{scratch.root}/partner/{g:05d}.npy"
    files[target] = shuffle.put_array(target, partner)
    return {"similar_pairs": int(similar.sum()), "files": files}


def run_fuzzy(scratch: Scratch, cfg: DedupConfig, workers: Workers, journal: Journals = no_journal) -> dict:
    """Bands, buckets, the two verification hops and the components: the candidate and similar
    pair counts (the non-centre files are where `fuzzy_removed` reads). `journal`: as run_exact."""
    U, P, G = scratch.units, scratch.partitions, scratch.groups
    run_tasks("dedup: bands", band_task, [(g, scratch, cfg) for g in range(G)], workers, journal("bands"))
    items = [(q, scratch, cfg.rows) for q in range(P)]
    run_tasks("dedup: buckets", bucket_task, items, workers, journal("buckets"))
    items = [(g, scratch, cfg.num_perm) for g in range(G)]
    first = run_tasks("dedup: pairs", verify_i_task, items, workers, journal("pairs"))
    items = [(g, scratch, cfg.num_perm, cfg.threshold) for g in range(G)]
    second = run_tasks("dedup: similarity", verify_j_task, items, workers, journal("similarity"))
    removed = components.non_centres(scratch.root, scratch.files("cc0", G), P, (U, G), workers, journal)
    return {
        "candidate_pairs": sum(r["candidate_pairs"] for r in first),
        "similar_pairs": sum(r["similar_pairs"] for r in second),
        "non_centres": removed,
    }


DROP = np.dtype([("idx", "<u8"), ("fuzzy", "u1")])


def drops_task(item: tuple) -> dict:
    """Group `g`: each of its units' dropped documents (exact and fuzzy duplicates) in one file per
    unit, for the unit's write task."""
    g, scratch, exact, non_centres = item
    gone = [exact_removed(scratch, g) if exact else np.zeros(0, np.uint64)]
    if non_centres:
        gone.append(shuffle.gather(non_centres, g, scratch.groups, NODE)["idx"])
    drops = np.zeros(sum(len(x) for x in gone), DROP)
    drops["idx"] = np.concatenate(gone)
    drops["fuzzy"][len(gone[0]) :] = 1
    drops = drops[np.argsort(drops["idx"], kind="stable")]
    owner = unit_of(drops["idx"])
    files = {
        scratch.drops(u): shuffle.put_array(scratch.drops(u), drops[owner == u]) for u in scratch.units_in(g)
    }
    return {"files": files}


def run_drops(
    scratch: Scratch,
    exact: bool,
    non_centres: list[str] | None,
    workers: Workers,
    journal: Journals = no_journal,
) -> None:
    items = [(g, scratch, exact, non_centres) for g in range(scratch.groups)]
    run_tasks("dedup: drop lists", drops_task, items, workers, journal("drops"))


def unit_drops(scratch: Scratch, u: int) -> tuple[np.ndarray, np.ndarray]:
    """(exact, fuzzy) duplicate indices of unit `u`, each sorted."""
    drops = shuffle.get_array(scratch.drops(u))
    return drops["idx"][drops["fuzzy"] == 0], drops["idx"][drops["fuzzy"] == 1]


def fuzzy_examples(scratch: Scratch, u: int, removed: np.ndarray, limit: int) -> list[tuple]:
    """Unit `u`'s first `limit` fuzzy duplicates that have a similar partner, as (removed, partner,
    jaccard) index triples."""
    group = u * scratch.groups // scratch.units  # as group_of
    partner = shuffle.get_array(f"{scratch.root}/partner/{group:05d}.npy")
    at = np.minimum(np.searchsorted(partner["j"], removed), len(partner) - 1)
    found = partner["j"][at] == removed if len(partner) else np.zeros(len(removed), bool)
    rows = partner[at[found][:limit]]
    return [(int(r["j"]), int(r["i"]), float(r["jaccard"])) for r in rows]


def name_examples(scratch: Scratch, examples: list[tuple]) -> list[dict]:
    """stats.json's removed_examples: the index triples with the documents' ids (read from the few
    units they are in)."""
    ids: dict[int, list] = {}

    def id_of(idx: int) -> str:
        u = idx >> 32
        if u not in ids:
            ids[u] = json.loads(shuffle.get(scratch.ids(u)))
        return ids[u][idx & 0xFFFFFFFF]

    return [{"removed": id_of(i), "kept": id_of(j), "jaccard_estimate": round(s, 3)} for i, j, s in examples]
