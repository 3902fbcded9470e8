"""Exact and fuzzy (MinHash + LSH) deduplication (the `dedup` stage).

Pass 1 (process pool): per document, a 128-bit hash of its normalised text
(lowercased, whitespace collapsed) and a MinHash signature of its word
shingles. MinHash uses `num_perm` multiply-shift hash functions
h(x) = (a*x + b) >> 32 over 64-bit shingle hashes (see ngrams.py): a
universal family, so P[min-hashes agree] estimates the Jaccard similarity.

Clustering (main process, numpy): exact duplicates join the first document
with the same key. For fuzzy duplicates the signature is cut into `bands`
bands of `rows` values; documents equal on a whole band are candidates. Within
each band bucket a document is compared with the bucket's first member and
with its predecessor (enough to connect the bucket without all O(m^2) pairs);
a candidate pair whose estimated Jaccard is at least `threshold` is an edge.
Connected components are clusters; each keeps its first document in input
order, so the result is deterministic and independent of worker count.

Pass 2 re-reads the inputs (the reader is deterministic) and writes the kept
documents. Memory is one signature per document (num_perm * 4 bytes), never
the texts.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from shipyard.data.configs import DedupConfig, ReadConfig
from shipyard.data.documents import Document, check_bad_fraction
from shipyard.data.ngrams import ngram_hashes
from shipyard.data.stage import (
    DocWriter,
    StageStats,
    batches,
    config_record,
    pool_map,
    progress,
    read_inputs,
    stage_output,
    write_json,
)

EMPTY = np.uint32(0xFFFFFFFF)  # the signature value of a document without words


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


def sketch_batch(docs: list[Document]) -> tuple[list[bytes], np.ndarray]:
    cfg, (a, b) = _STATE["cfg"], _STATE["ab"]
    keys = [exact_key(d.text) if cfg.exact else b"" for d in docs]
    if not cfg.fuzzy:
        return keys, np.zeros((len(docs), 0), np.uint32)
    return keys, np.stack([signature(d.text, cfg, a, b) for d in docs])


class _UnionFind:
    """Components whose root is always the smallest member (the document kept)."""

    def __init__(self, n: int):
        self.parent = np.arange(n)

    def find(self, i: int) -> int:
        root = i
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[i] != root:  # path compression
            self.parent[i], i = root, self.parent[i]
        return root

    def union(self, i: int, j: int) -> None:
        ri, rj = self.find(i), self.find(j)
        if ri != rj:
            lo, hi = min(ri, rj), max(ri, rj)
            self.parent[hi] = lo


def candidate_pairs(sigs: np.ndarray, alive: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """[k, 2] (i < j) pairs of alive documents that agree on at least one whole band."""
    idx = np.flatnonzero(alive & (sigs[:, 0] != EMPTY))
    pairs = []
    for band in range(bands):
        block = np.ascontiguousarray(sigs[idx, band * rows : (band + 1) * rows])
        keys = block.view(np.dtype((np.void, block.dtype.itemsize * rows))).ravel()
        order = np.argsort(keys, kind="stable")  # stable: equal keys stay in input order
        sk = keys[order]
        same = sk[1:] == sk[:-1]
        if not same.any():
            continue
        members = idx[order]
        # predecessor pairs
        pairs.append(np.stack([members[:-1][same], members[1:][same]], axis=1))
        # first-of-bucket pairs
        starts = np.concatenate(([True], ~same))
        first = members[np.maximum.accumulate(np.where(starts, np.arange(len(sk)), 0))]
        in_bucket = ~starts
        pairs.append(np.stack([first[in_bucket], members[in_bucket]], axis=1))
    if not pairs:
        return np.zeros((0, 2), np.int64)
    allp = np.concatenate(pairs)
    allp = np.sort(allp, axis=1)
    allp = allp[allp[:, 0] != allp[:, 1]]
    return np.unique(allp, axis=0)


def cluster(keys: list[bytes], sigs: np.ndarray, cfg: DedupConfig) -> tuple[np.ndarray, dict, list]:
    """(kept mask, counts, example (removed, kept, jaccard) index triples)."""
    n = len(keys)
    kept = np.ones(n, bool)
    examples: list[tuple[int, int, float]] = []
    counts = {"exact_duplicates": 0, "fuzzy_duplicates": 0, "candidate_pairs": 0, "similar_pairs": 0}
    if cfg.exact:
        first: dict[bytes, int] = {}
        for i, k in enumerate(keys):
            j = first.setdefault(k, i)
            if j != i:
                kept[i] = False
                counts["exact_duplicates"] += 1
                if len(examples) < cfg.max_examples // 2:
                    examples.append((i, j, 1.0))
    if cfg.fuzzy and n:
        pairs = candidate_pairs(sigs, kept, cfg.bands, cfg.rows)
        counts["candidate_pairs"] = len(pairs)
        jac = (sigs[pairs[:, 0]] == sigs[pairs[:, 1]]).mean(axis=1) if len(pairs) else np.zeros(0)
        similar = pairs[jac >= cfg.threshold]
        counts["similar_pairs"] = len(similar)
        uf = _UnionFind(n)
        for i, j in similar:
            uf.union(int(i), int(j))
        edge_of = {int(j): (int(i), float(s)) for (i, j), s in zip(similar, jac[jac >= cfg.threshold])}
        for i in np.flatnonzero(kept):
            root = uf.find(int(i))
            if root != i:
                kept[i] = False
                counts["fuzzy_duplicates"] += 1
                if len(examples) < cfg.max_examples and int(i) in edge_of:
                    partner, s = edge_of[int(i)]
                    examples.append((int(i), partner, s))
    return kept, counts, examples


def run_dedup(
    inputs: list[str], out: Path, cfg: DedupConfig, read: ReadConfig, workers: int, overwrite: bool = False
) -> dict:
    inputs = [str(p) for p in inputs]
    config = config_record(read, dedup=cfg)
    stats = StageStats("dedup", inputs, config, workers)
    with stage_output(out, overwrite, "dedup") as tmp:
        # pass 1: keys and signatures
        read_stats, docs = read_inputs(inputs, read.text_field)
        ids: list[str] = []
        keys: list[bytes] = []
        sig_parts: list[np.ndarray] = []
        pending: list[list[Document]] = []

        def feed():
            for batch in batches(docs):
                pending.append(batch)
                yield batch

        with progress("dedup: sketch", inputs) as bar:
            for batch_keys, batch_sigs in pool_map(sketch_batch, feed(), workers, _init, (cfg,)):
                batch = pending.pop(0)
                ids.extend(d.id for d in batch)
                keys.extend(batch_keys)
                sig_parts.append(batch_sigs)
                stats.documents_in += len(batch)
                stats.bytes_in += sum(len(d.text.encode("utf-8")) for d in batch)
                bar.update(len(batch))
        check_bad_fraction(read_stats, read.max_bad_fraction, "data dedup")
        sigs = np.concatenate(sig_parts) if sig_parts else np.zeros((0, cfg.num_perm), np.uint32)
        kept, counts, examples = cluster(keys, sigs, cfg)
        stats.dropped.update(
            {"exact_duplicate": counts["exact_duplicates"], "fuzzy_duplicate": counts["fuzzy_duplicates"]}
        )
        stats.extra.update(
            candidate_pairs=counts["candidate_pairs"],
            similar_pairs=counts["similar_pairs"],
            removed_examples=[
                {"removed": ids[i], "kept": ids[j], "jaccard_estimate": round(s, 3)} for i, j, s in examples
            ],
        )
        # pass 2: write what is kept
        _, docs = read_inputs(inputs, read.text_field)
        writer = DocWriter(tmp)
        try:
            with progress("dedup: write", inputs) as bar:
                for i, doc in enumerate(docs):
                    if kept[i]:
                        stats.bytes_out += writer.write(doc)
                        stats.documents_out += 1
                    bar.update(1)
        finally:
            writer.close()
        result = stats.as_dict(read_stats)
        result["parts"] = writer.parts
        write_json(tmp / "stats.json", result)
    return result
