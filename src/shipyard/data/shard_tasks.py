"""Token shards assembled by tasks from the units' encoded tokens, so no token passes through the
driver (the `tokenize` stage, tokenize.py).

Each encode task writes its unit's tokens (raw, the shards' dtype) and documents' lengths to the
stage's scratch files (`_tokens/`, inside the output being built). The driver then lays the shards
out (`layout`): it reads the lengths one unit at a time and cuts them exactly where
`shards.ShardWriter` would (whole documents to a shard; a shard closes right after the document
that fills it), so the shards are the same bytes as a single writer's. Each shard is one task
(`write_shard`): ranged reads of the token ranges it covers, an .npy header, its sha256. The
driver holds one unit's lengths and the layout (a few numbers per shard and unit), never tokens.
"""

from __future__ import annotations

import hashlib
import itertools
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shipyard import storage
from shipyard.data import shuffle
from shipyard.data.shards import shard_header

SCRATCH = "_tokens"


@dataclass(frozen=True)
class TokenScratch:
    """Where the encode tasks leave their units' tokens for the shard tasks."""

    stage_dir: str
    """The output being built (`StageDir.parts`): a directory every task can reach, or a bucket prefix."""
    dtype: str
    """The shards' token dtype (numpy's str, e.g. '<u2')."""

    def tokens(self, u: int) -> str:
        return f"{self.stage_dir}/{SCRATCH}/{u:05d}.bin"

    def lengths(self, u: int) -> str:
        return f"{self.stage_dir}/{SCRATCH}/{u:05d}.lengths.npy"


def save_unit(scratch: TokenScratch, u: int, tokens: np.ndarray, lengths: np.ndarray) -> dict[str, str]:
    """In the encode task: unit `u`'s tokens and lengths; {path: sha256} of the two files."""
    return {
        scratch.tokens(u): shuffle.put(scratch.tokens(u), np.ascontiguousarray(tokens).tobytes()),
        scratch.lengths(u): shuffle.put_array(scratch.lengths(u), lengths.astype(np.int64)),
    }


def cut(lengths: np.ndarray, filled: int, shard_tokens: int) -> list[int]:
    """Document counts of consecutive pieces of one unit: a piece ends where the open shard (with
    `filled` tokens so far) reaches `shard_tokens`; the last piece may leave a shard open."""
    counts, count, room = [], 0, shard_tokens - filled
    for n in lengths:
        count += 1
        room -= int(n)
        if room <= 0:
            counts.append(count)
            count, room = 0, shard_tokens
    if count:
        counts.append(count)
    return counts


def layout(scratch: TokenScratch, units: int, shard_tokens: int) -> list[list[tuple[int, int, int, int]]]:
    """For each shard, its pieces (unit, first token, end token, documents), in order."""
    shards: list[list[tuple[int, int, int, int]]] = []
    filled, open_shard = 0, False
    for u in range(units):
        lengths = shuffle.get_array(scratch.lengths(u))
        ends = np.cumsum(lengths)
        start = 0
        for count in cut(lengths, filled, shard_tokens):
            lo = int(ends[start - 1]) if start else 0
            hi = int(ends[start + count - 1])
            if not open_shard:
                shards.append([])
                open_shard, filled = True, 0
            shards[-1].append((u, lo, hi, count))
            filled += hi - lo
            if filled >= shard_tokens:
                open_shard, filled = False, 0
            start += count
    return shards


def write_shard(item: tuple) -> dict:
    """A task: shard `k` from its pieces; its manifest entry, and for a bucket `dest` the upload's
    digest (the shard is put whole by one PUT)."""
    k, pieces, scratch, dest = item
    dtype = np.dtype(scratch.dtype)
    tokens = sum(hi - lo for _, lo, hi, _ in pieces)
    name = f"shard-{k:05d}.npy"
    local_dir = Path(tempfile.mkdtemp(prefix="shipyard-shard-")) if storage.is_url(dest) else Path(dest)
    target = local_dir / name
    partial = target.with_name(f".{name}.tmp")
    h = hashlib.sha256()
    try:
        with open(partial, "wb") as f:
            blocks = (
                shuffle.get(scratch.tokens(u), lo * dtype.itemsize, hi * dtype.itemsize)
                for u, lo, hi, _ in pieces
            )
            for block in itertools.chain([shard_header(dtype, tokens)], blocks):  # one piece in memory
                f.write(block)
                h.update(block)
        partial.replace(target)
        entry = {
            "file": name,
            "tokens": tokens,
            "documents": sum(p[3] for p in pieces),
            "sha256": h.hexdigest(),
        }
        files = {name: h.hexdigest()}  # for the resume journal
        if not storage.is_url(dest):
            return {"entry": entry, "files": files}
        storage.write_bytes(str(storage.join(dest, name)), target.read_bytes())
        uploaded = {name: {"bytes": target.stat().st_size, "sha256": h.hexdigest()}}
        return {"entry": entry, "uploaded": uploaded, "files": files}
    finally:
        if storage.is_url(dest):
            shutil.rmtree(local_dir, ignore_errors=True)
