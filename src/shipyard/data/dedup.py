"""Exact and fuzzy (MinHash + LSH) deduplication (the `dedup` stage).

Sketch (one task per work unit): per document, a 128-bit hash of its normalised text
(lowercased, whitespace collapsed) and a MinHash signature of its word
shingles. MinHash uses `num_perm` multiply-shift hash functions
h(x) = (a*x + b) >> 32 over 64-bit shingle hashes (see ngrams.py): a
universal family, so P[min-hashes agree] estimates the Jaccard similarity.
Each task writes its unit's ids, signatures and keys to the stage's scratch
files; nothing per document comes back to the driver.

Clustering is a chain of shuffles over those files (dedup_steps.py): exact
duplicates by key, LSH bands by (band, value), candidate pairs verified where
their signatures live, and the duplicate clusters found by a distributed
connected-components pass (components.py). Each cluster keeps its first
document in input order, so the result is deterministic and independent of the
number of workers, nodes or partitions.

Last, each unit's task re-reads its unit (the reader is deterministic) and
writes its kept documents. The driver holds a few numbers per unit (its document
count) and the examples stats.json shows; every task holds one unit or one
partition.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from shipyard import storage
from shipyard.data import dedup_steps as steps
from shipyard.data import shuffle
from shipyard.data.configs import DedupConfig, ReadConfig
from shipyard.data.dedup_steps import EMPTY, LOW
from shipyard.data.documents import ReadStats, check_bad_fraction, read_unit
from shipyard.data.ngrams import ngram_hashes
from shipyard.data.resume import header
from shipyard.data.stage import (
    DocWriter,
    StageStats,
    Workers,
    config_record,
    open_pool,
    plan,
    publish_part,
    run_units,
    stage_output,
)
from shipyard.errors import DataError
from shipyard.output import write_json


def hash_params(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.Generator(np.random.PCG64(seed))
    a = rng.integers(0, 1 << 63, size=num_perm, dtype=np.uint64) * np.uint64(2) + np.uint64(1)  # odd
    b = rng.integers(0, 1 << 63, size=num_perm, dtype=np.uint64)
    return a, b


def minhash(shingles: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """uint32[num_perm] signature of a set of uint64 shingle hashes."""
    if shingles.size == 0:
        return np.full(a.size, EMPTY, np.uint32)
    sig = np.full(a.size, EMPTY, np.uint64)
    chunk = min(shingles.size, 8192)
    buf = np.empty((a.size, chunk), np.uint64)
    with np.errstate(over="ignore"):
        # [num_perm, chunk] with in-place ops: one temporary, rows contiguous
        # for the min; 4x faster than the naive broadcast on long documents.
        for start in range(0, shingles.size, chunk):
            x = shingles[None, start : start + chunk]
            view = buf[:, : x.shape[1]]
            np.multiply(a[:, None], x, out=view)
            view += b[:, None]
            view >>= np.uint64(32)
            np.minimum(sig, view.min(axis=1), out=sig)
    return sig.astype(np.uint32)


def exact_key(text: str) -> bytes:
    return hashlib.blake2b(" ".join(text.lower().split()).encode("utf-8"), digest_size=16).digest()


def signature(text: str, cfg: DedupConfig, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    # No np.unique first: min ignores repeats, and sorting cost more than the repeats do.
    return minhash(ngram_hashes(text, cfg.shingle_size), a, b)


# Set once per worker process by the pool initializer (a worker serves one stage).
_STATE: dict = {}


def _init(cfg: DedupConfig) -> None:
    _STATE.update(cfg=cfg, ab=hash_params(cfg.num_perm, cfg.seed))


def sketch_unit(item: tuple) -> dict:
    """Worker, pass 1: one unit's ids, signatures and exact keys, written to the stage's scratch
    (`dedup_steps.Scratch`) rather than returned: nothing per document reaches the driver."""
    u, unit, text_field, scratch = item
    cfg, (a, b) = _STATE["cfg"], _STATE["ab"]
    read = ReadStats()
    ids, keys, sigs = [], [], []
    for doc in read_unit(unit, read, text_field):
        ids.append(doc.id)
        if cfg.exact:
            keys.append(exact_key(doc.text))
        if cfg.fuzzy:
            sigs.append(signature(doc.text, cfg, a, b))
    files = {scratch.ids(u): shuffle.put(scratch.ids(u), json.dumps(ids, ensure_ascii=False).encode("utf-8"))}
    if cfg.fuzzy:
        sig = np.stack(sigs) if sigs else np.zeros((0, cfg.num_perm), np.uint32)
        files[scratch.sig(u)] = shuffle.put_array(scratch.sig(u), sig)
    if cfg.exact:
        files[scratch.keys(u)] = steps.write_exact_keys(scratch, u, keys)
    return {"n": len(ids), "read": read, "documents_in": len(ids), "bytes_in": read.bytes, "files": files}


def write_unit(item: tuple) -> dict:
    """Worker, last pass: write the kept documents of unit `u` as part `u`, and name the unit's
    first fuzzy duplicates with the kept document they matched (stats.json's examples)."""
    u, unit, out_dir, text_field, n, scratch, cfg = item
    removed_exact, removed_fuzzy = steps.unit_drops(scratch, u)
    keep = np.ones(n, bool)
    keep[(removed_exact & LOW).astype(np.int64)] = False
    keep[(removed_fuzzy & LOW).astype(np.int64)] = False
    read = ReadStats()
    writer = DocWriter.part(out_dir, u)
    out = {"documents_out": 0, "bytes_out": 0, "fuzzy_duplicates": len(removed_fuzzy)}
    try:
        for i, doc in enumerate(read_unit(unit, read, text_field)):
            if i < n and keep[i]:
                out["bytes_out"] += writer.write(doc)
                out["documents_out"] += 1
    finally:
        writer.close()
    if read.documents != n:  # the input changed between the passes
        raise DataError(f"data dedup: {unit.paths[0]} changed while the stage was running; run it again")
    out["examples"] = steps.fuzzy_examples(scratch, u, removed_fuzzy, cfg.max_examples) if cfg.fuzzy else []
    out.update(publish_part(writer.path, writer.written, out_dir))
    return out


def partitions_for(units: int, total_bytes: int) -> int:
    """Shuffle partitions: about one per 256 MB of input up to 512 (a small corpus's shuffles are a
    few tasks, not one per unit: each task costs its scheduling and two reads per map file), and
    more past 3 TB so that a reduce task's share of the band records (about a sixth of the input's
    bytes with the default 16 bands) stays near 1 GB. The output does not depend on the number (a
    test checks)."""
    small = min(units, -(-total_bytes // PARTITION_SMALL_BYTES), 512)
    return max(1, small, -(-total_bytes // PARTITION_INPUT_BYTES))


PARTITION_SMALL_BYTES = 256 << 20
PARTITION_INPUT_BYTES = 6 << 30


def run_dedup(
    inputs: list[str],
    out: Path,
    cfg: DedupConfig,
    read: ReadConfig,
    workers: Workers,
    overwrite: bool = False,
    partitions: int | None = None,
) -> dict:
    """Deduplicate `inputs` into `out` (module docstring). `partitions`: the shuffles' partition
    count (default `partitions_for`; any value gives the same output)."""
    inputs = [str(p) for p in inputs]
    units = plan(inputs)
    stats = StageStats("dedup", inputs, config_record(read, dedup=cfg), workers)
    partitions = partitions or partitions_for(len(units), sum(u.size for u in units))
    # the shuffle steps are journaled too: their files are only the same for the same partitions
    run = header(
        "dedup", [storage.redact(i) for i in inputs], {**stats.config, "partitions": partitions}, units
    )
    with (
        stage_output(out, overwrite, "dedup", workers, run) as dest,
        open_pool(workers, _init, (cfg,)) as pool,
    ):
        scratch = steps.Scratch(
            str(dest.parts).rstrip("/"),
            len(units),
            partitions,
        )
        counts = []
        items = ((u, unit, read.text_field, scratch) for u, unit in enumerate(units))
        for r in run_units(
            "dedup: sketch", units, sketch_unit, items, pool, _init, (cfg,), dest.journal("sketch")
        ):
            stats.add(r)
            counts.append(r["n"])
        check_bad_fraction(stats.read, read.max_bad_fraction, "data dedup")
        exact = (
            steps.run_exact(scratch, cfg, pool, dest.journal)
            if cfg.exact
            else {"duplicates": 0, "examples": []}
        )
        fuzzy = (
            steps.run_fuzzy(scratch, cfg, pool, dest.journal)
            if cfg.fuzzy
            else {"candidate_pairs": 0, "similar_pairs": 0, "non_centres": None}
        )
        steps.run_drops(scratch, cfg.exact, fuzzy["non_centres"], pool, dest.journal)
        items = (
            (u, unit, dest.parts, read.text_field, counts[u], scratch, cfg) for u, unit in enumerate(units)
        )
        parts, fuzzy_examples, fuzzy_duplicates = [], [], 0
        for r in run_units("dedup: write", units, write_unit, items, pool, journal=dest.journal("write")):
            stats.documents_out += r["documents_out"]
            stats.bytes_out += r["bytes_out"]
            fuzzy_duplicates += r["fuzzy_duplicates"]
            fuzzy_examples.extend(r["examples"][: cfg.max_examples])
            dest.add(r)
            if r["part"]:
                parts.append(r["part"])
        examples = exact["examples"] + fuzzy_examples[: cfg.max_examples - len(exact["examples"])]
        removed_examples = steps.name_examples(scratch, examples)
        # kept when the run is cut off: a resumed run's finished sketches still stand on them
        storage.remove(scratch.root)
        stats.dropped.update({"exact_duplicate": exact["duplicates"], "fuzzy_duplicate": fuzzy_duplicates})
        stats.extra.update(
            candidate_pairs=fuzzy["candidate_pairs"],
            similar_pairs=fuzzy["similar_pairs"],
            removed_examples=removed_examples,
        )
        result = stats.as_dict(dest.nodes)
        result["parts"] = parts
        write_json(dest.local / "stats.json", result)
    return result
