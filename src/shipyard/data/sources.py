"""Where a stage's input files live: local paths or object-storage URLs, listed and opened alike.

A URL input is an object (`s3://bucket/a.jsonl.zst`) or a prefix of them
(`s3://bucket/raw`), walked like a local directory. A prefix that another stage
published carries a `_SUCCESS` marker (see `shipyard.data.stage`) and a tag
object written before anything else; a tagged prefix without the marker is a
publication that was cut off, and is refused rather than read half.

Remote files are read through `RemoteFile`: buffered ranged GETs of a fixed
block size, each retried with backoff and checked for length
(`storage.RangeReader`), so a connection cut mid-file costs a retry of one
block, never a silently short file, and seeking (parquet footers, jsonl line
ranges) costs no more than the bytes it reads.
"""

from __future__ import annotations

import io
from pathlib import Path

from shipyard import storage
from shipyard.errors import DataError

STAGE_TAG = "_SHIPYARD_STAGE"
"""Written first into a stage output prefix, before any other object; its marker is written last."""
BLOCK_BYTES = 8 << 20
"""The most one ranged GET asks for; big enough that per-request latency is small next to the transfer."""
READ_RETRY = storage.DEFAULT_RETRY
"""How hard each ranged GET is retried (a module setting, so tests can shorten it)."""

Location = str | Path
"""A local file (Path) or a remote object (its URL, a str)."""


def as_location(item: str | Path) -> Location:
    """A URL stays a URL (str); anything else becomes a local Path (an unknown scheme is refused)."""
    storage.check_scheme(item, "input")
    return str(item) if storage.is_url(item) else storage.local(item)


def name_of(loc: Location) -> str:
    """The file name (last path component) of a location."""
    return loc.name if isinstance(loc, Path) else str(loc).rstrip("/").rsplit("/", 1)[-1]


def shown(loc: Location) -> str:
    """How a location is printed and recorded (ids, sources, stats): URLs without credentials."""
    return storage.redact(loc) if isinstance(loc, str) else str(loc)


_LISTED_SIZES: dict[str, int] = {}
"""Object sizes from this process's listings, so planning costs no HEAD per object."""


def size_of(loc: Location) -> int:
    if isinstance(loc, Path):
        return loc.stat().st_size
    return _LISTED_SIZES[loc] if loc in _LISTED_SIZES else storage.size(loc)


def open_binary(loc: Location):
    """A readable, seekable binary file object for a local file or a remote object."""
    if isinstance(loc, Path):
        return open(loc, "rb")  # noqa: SIM115
    return io.BufferedReader(RemoteFile(loc), buffer_size=BLOCK_BYTES)


class RemoteFile(io.RawIOBase):
    """A remote object as a raw, seekable file: every read is one retried, length-checked ranged GET."""

    def __init__(self, url: str):
        super().__init__()
        self._reader = storage.RangeReader(url, READ_RETRY)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._reader.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer) -> int:
        # a short read is fine for a raw file: BufferedReader asks again until it has what it needs
        end = min(self._pos + len(buffer), self._pos + BLOCK_BYTES, self._reader.size)
        if end <= self._pos:
            return 0
        data = self._reader.read(self._pos, end)
        buffer[: len(data)] = data
        self._pos = end
        return len(data)


def _check_published(url: str, names: list[str]) -> None:
    """Refuse a stage output prefix whose publication never finished (tag there, marker not)."""
    if STAGE_TAG in names and storage.MARKER not in names:
        raise DataError(
            f"input {storage.redact(url)} is not a complete stage output (no {storage.MARKER}): "
            "it was interrupted; rerun the stage"
        )


def list_url(url: str, suffixes: tuple[str, ...]) -> list[str]:
    """The document files of one URL input: the object itself, or those under the prefix (sorted)."""
    fs, path = storage.filesystem(url)
    what = f"input {storage.redact(url)}"
    root = path.rstrip("/")
    found = storage.retrying(lambda: fs.find(root, detail=True), f"listing {storage.redact(url)}")
    names = sorted(p[len(root) + 1 :] for p in found if p.startswith(root + "/"))
    if not names:
        if root in found or storage.exists(url):  # a single object, not a prefix
            _LISTED_SIZES.pop(url, None)  # sized afresh when planned (it may have changed since a listing)
            if not name_of(url).endswith(suffixes):
                raise DataError(f"{what}: unsupported file type (expected one of {', '.join(suffixes)})")
            return [url]
        raise DataError(f"{what}: no such object or prefix")
    _check_published(url, names)
    base = str(url).rstrip("/")
    # _SUCCESS, the tag and stats.json never end in a document suffix, so they are never read as documents
    docs = [n for n in names if n.endswith(suffixes) and not name_of(n).startswith("_")]
    for n in docs:
        size = found[f"{root}/{n}"].get("size")
        if isinstance(size, int):
            _LISTED_SIZES[f"{base}/{n}"] = size
    return [f"{base}/{n}" for n in docs]
