"""Shuffles between a stage's tasks, through the storage layer (a shared filesystem or a bucket).

A map task writes one file of fixed-size numpy records grouped by partition, with the partition
offsets at its head (`write`); reduce task `p` reads its slice of every map task's file with two
ranged reads each (`gather`), so no process holds more than one partition and the driver holds
only the file names, which it derives from the task numbers. This is how Spark and DataTrove move
data between stages: a file per map task, not one per (map, reduce) pair, so a stage of U map tasks
and P partitions writes U objects, not U * P.

Within a partition, records keep their map task's order and the map tasks are read in order, so a
reducer sees the same records in the same order wherever and however often its inputs were made.
A map task whose node died is rerun by the scheduler and rewrites the same bytes; no reducer starts
before every map task of its round has finished.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import numpy as np

from shipyard import storage

OFFSET = np.dtype("<u8")


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64s: partition numbers that do not follow the input's
    structure (a document index is (unit << 32) | k; a band value is a MinHash minimum)."""
    x = np.asarray(x, np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def put(path: str, data: bytes) -> str:
    """One whole file or object at `path` (a local path: written beside and renamed, so a reader
    never sees part of it); its sha256."""
    digest = hashlib.sha256(data).hexdigest()
    if storage.is_url(path):
        storage.write_bytes(path, data)
        return digest
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, target)
    return digest


def get(path: str, start: int | None = None, end: int | None = None) -> bytes:
    """Bytes [start, end) of a file or object (all of it by default)."""
    if storage.is_url(path):
        return storage.read_bytes(path, start, end)
    with open(path, "rb") as f:
        if start is None:
            return f.read()
        f.seek(start)
        return f.read(end - start)


def write(path: str, records: np.ndarray, partition: np.ndarray, partitions: int) -> str:
    """Records (a structured array) into `partitions` slices: record k goes to `partition[k]`; the
    file's sha256."""
    order = np.argsort(partition, kind="stable")  # stable: a partition keeps the records' order
    counts = np.bincount(partition, minlength=partitions)
    offsets = np.concatenate(([0], np.cumsum(counts))).astype(OFFSET)
    return put(path, offsets.tobytes() + records[order].tobytes())


def read_partition(path: str, p: int, partitions: int, dtype: np.dtype) -> np.ndarray:
    """Partition `p` of one map task's file."""
    lo, hi = (int(v) for v in np.frombuffer(get(path, 8 * p, 8 * (p + 2)), OFFSET))
    if hi == lo:
        return np.zeros(0, dtype)
    base = OFFSET.itemsize * (partitions + 1)
    data = get(path, base + lo * dtype.itemsize, base + hi * dtype.itemsize)
    return np.frombuffer(data, dtype).copy()


def gather(paths: list[str], p: int, partitions: int, dtype: np.dtype) -> np.ndarray:
    """Partition `p` of every map task's file, in map-task order."""
    parts = [read_partition(path, p, partitions, dtype) for path in paths]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def put_array(path: str, array: np.ndarray) -> str:
    """A plain array as an .npy file (numpy's own format, no pickle)."""
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return put(path, buf.getvalue())


def get_array(path: str) -> np.ndarray:
    return np.load(io.BytesIO(get(path)), allow_pickle=False)
