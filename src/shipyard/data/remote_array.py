"""A 1-D .npy array in object storage, read by byte ranges: never the whole object to local disk.

`RemoteArray` answers what the loader asks of a memory-mapped shard (`len`,
`size`, `dtype`, `a[lo:hi]`, `np.asarray(a)`) with ranged GETs through
`storage.RangeReader`. The .npy header is read once when it is opened.

Reads are served two ways. A read that lands far from the previous one (the
training order: Grain shuffles sequences over the whole set) is one ranged GET
of exactly its bytes, and nothing is cached: a block fetched for one random
2 KB row would be 99.8% waste. A read that continues where the previous one
stopped (within CONTINUE_SLACK), or falls in a cached block (held-out evaluation, any
scan), fetches whole aligned blocks of `block_bytes` (1 MiB) into a small LRU
`BlockCache` shared by the arrays of one shard set (`max_blocks` of them,
8 MiB by default, whatever the number of shards), so consecutive rows cost
one request per block instead of one each. bench/bucket_loader.py measures both.

Each array counts its `requests` and `fetched_bytes` (what the tests and the
bench check byte ranges with). After a fork the array opens a fresh client in
the child (an s3fs client made in the parent refuses to work there: its event
loop thread does not exist in the child).
"""

from __future__ import annotations

import io
import os
import struct
import threading
from collections import OrderedDict

import numpy as np

from shipyard.storage import DEFAULT_RETRY, RangeReader, Retry

BLOCK_BYTES = 1 << 20
"""Bytes in one cached block (aligned to multiples of this within the object)."""
CACHE_BLOCKS = 8
"""Blocks a BlockCache holds (shared by all arrays of one shard set)."""
CONTINUE_SLACK = 4096
"""A read starting within this many bytes of where the previous one ended continues a scan (rows
overlap by one token; a strided scan skips a little); one further away is a random read."""
SCAN_BYTES = 16 << 20
"""Bytes per ranged GET when a whole array is read (`np.asarray`)."""


class BlockCache:
    """An LRU of (url, block number) -> bytes, bounded by a number of blocks; thread-safe."""

    def __init__(self, max_blocks: int = CACHE_BLOCKS, block_bytes: int = BLOCK_BYTES):
        self.max_blocks, self.block_bytes = max_blocks, block_bytes
        self._blocks: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def _check_fork(self) -> None:
        if self._pid != os.getpid():  # a lock held by a parent's thread at fork time stays held here
            self._lock, self._pid = threading.Lock(), os.getpid()

    def get(self, url: str, block: int) -> bytes | None:
        self._check_fork()
        with self._lock:
            data = self._blocks.get((url, block))
            if data is not None:
                self._blocks.move_to_end((url, block))
            return data

    def put(self, url: str, block: int, data: bytes) -> None:
        self._check_fork()
        with self._lock:
            self._blocks[(url, block)] = data
            self._blocks.move_to_end((url, block))
            while len(self._blocks) > self.max_blocks:
                self._blocks.popitem(last=False)


def parse_npy_header(read) -> tuple[tuple[int, ...], np.dtype, bool, int]:
    """(shape, dtype, fortran_order, data offset) of a .npy whose bytes [a, b) `read(a, b)` returns;
    ValueError when it is not a .npy. Reads the first 4 KiB (a header numpy writes for a 1-D array is
    128 bytes: one request), then the rest of a longer header."""
    head = read(0, 4096)
    if len(head) < 10 or head[:6] != b"\x93NUMPY":
        raise ValueError("no .npy magic string at the start")
    major = head[6]
    if major == 1:
        length, prefix = struct.unpack("<H", head[8:10])[0], 10
    elif major in (2, 3):
        length, prefix = struct.unpack("<I", head[8:12])[0], 12
    else:
        raise ValueError(f"unsupported .npy format version {major}")
    full = head if prefix + length <= len(head) else head + read(len(head), prefix + length)
    f = io.BytesIO(full[: prefix + length])
    version = np.lib.format.read_magic(f)
    reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran, dtype = reader(f)
    if dtype.hasobject:
        raise ValueError("object arrays are not token arrays")
    return tuple(shape), dtype, bool(fortran), prefix + length


class RemoteArray:
    """The 1-D array of a .npy object at `url`, read by byte ranges (see the module docstring).

    Opening it costs one HEAD (its size) and one or two ranged GETs (the header). `object_size`,
    `offset`, `shape` and `dtype` are what the header and the store say; callers check them."""

    def __init__(
        self,
        url: str,
        cache: BlockCache | None = None,
        retry: Retry = DEFAULT_RETRY,
        reader: RangeReader | None = None,
    ):
        self.url, self.retry = url, retry
        self.cache = cache if cache is not None else BlockCache()
        self._reader = reader if reader is not None else RangeReader(url, retry)
        self._pid = os.getpid()
        self._count_lock = threading.Lock()
        self.object_size = self._reader.size
        self.requests = self.fetched_bytes = 0
        self._last_end = -1
        self.shape, self.dtype, self.fortran_order, self.offset = parse_npy_header(self._get)

    # --- the store ---------------------------------------------------------------------------
    def _get(self, start: int, end: int) -> bytes:
        """Bytes [start, end) of the object, clipped to it: one ranged GET."""
        end = min(end, self.object_size)
        if end <= start:
            return b""
        if self._pid != os.getpid():  # forked: the parent's client (and a held lock) are unusable here
            self._reader, self._count_lock = RangeReader(self.url, self.retry), threading.Lock()
            self._pid = os.getpid()
        data = self._reader.read(start, end)
        with self._count_lock:  # rows are fetched from several threads at once (data/loader.py)
            self.requests += 1
            self.fetched_bytes += len(data)
        return data

    def _bytes(self, start: int, end: int) -> bytes:
        """Bytes [start, end): exact for a random read, through cached blocks for a continuing one."""
        bb = self.cache.block_bytes
        first, last = start // bb, (end - 1) // bb
        continuing = abs(start - self._last_end) <= CONTINUE_SLACK and self.cache.max_blocks > 0
        self._last_end = end
        cached = self.cache.get(self.url, first)
        if not continuing and cached is None:  # (a cache of 0 blocks: every read exact, for the bench)
            return self._get(start, end)
        blocks = []
        b = first
        while b <= last:
            got = cached if b == first else self.cache.get(self.url, b)
            if got is None:  # the run of missing blocks from b, fetched with one GET
                stop = b
                while stop + 1 <= last and self.cache.get(self.url, stop + 1) is None:
                    stop += 1
                data = self._get(b * bb, (stop + 1) * bb)
                for k in range(b, stop + 1):
                    part = data[(k - b) * bb : (k - b + 1) * bb]
                    self.cache.put(self.url, k, part)
                    blocks.append(part)
                b = stop + 1
            else:
                blocks.append(got)
                b += 1
        joined = b"".join(blocks)
        return joined[start - first * bb : end - first * bb]

    # --- the array interface the loader uses ----------------------------------------------------
    @property
    def size(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key) -> np.ndarray:
        """Elements key (a slice with step 1, or an int) as a numpy array read from the store."""
        n = len(self)
        if isinstance(key, slice):
            lo, hi, step = key.indices(n)
            if step != 1:
                raise IndexError("RemoteArray slices take step 1")
        else:
            lo = int(key) + (n if int(key) < 0 else 0)
            if not 0 <= lo < n:
                raise IndexError(f"index {key} is out of bounds for length {n}")
            return self[lo : lo + 1][0]
        if hi <= lo:
            return np.empty(0, self.dtype)
        item = self.dtype.itemsize
        data = self._bytes(self.offset + lo * item, self.offset + hi * item)
        return np.frombuffer(data, self.dtype)  # read-only, like a slice of a mode-"r" memmap

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """The whole array in memory, read in SCAN_BYTES ranged GETs (not cached, not on disk)."""
        out = np.empty(self.size, self.dtype)
        view = out.view(np.uint8)
        total = view.size
        for pos in range(0, total, SCAN_BYTES):
            end = min(total, pos + SCAN_BYTES)
            view[pos:end] = np.frombuffer(self._get(self.offset + pos, self.offset + end), np.uint8)
        return out if dtype is None else out.astype(dtype)

    def chunks(self, elements: int):
        """The array in consecutive pieces of `elements` (the last shorter), each one ranged GET."""
        for lo in range(0, len(self), elements):
            hi = min(len(self), lo + elements)
            item = self.dtype.itemsize
            yield np.frombuffer(self._get(self.offset + lo * item, self.offset + hi * item), self.dtype)
