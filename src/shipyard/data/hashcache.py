"""sha256 of files, remembered per user so that an unchanged file is hashed once.

Verifying token shards and checkpoints before every read would re-read
terabytes on every restart; instead the digest of each file is remembered
together with the file's stat (size, mtime_ns, ctime_ns, inode). A file whose
stat still matches is taken to hold the bytes it held when it was hashed; any
rewrite changes mtime or ctime (and `os.utime` setting the mtime back changes
the ctime), so it is hashed again. Timestamps are coarse (a clock tick of
milliseconds, seconds on some filesystems), so a file changed less than
RACY_NS before it was hashed is not remembered: a second write in the same
tick could otherwise leave its stat unchanged (git's "racy" rule). What this
cannot see is a change below the filesystem (bit rot on the disk): `shipyard
data verify` hashes afresh. `shipyard browse` re-checks a root before each page
through the same cache (browse/graph.py: `file_hashes`).

Where the cache lives: `$XDG_CACHE_HOME/shipyard/sha256/` (default
`~/.cache/shipyard/sha256/`), one small JSON file per hashed directory, named
by the sha256 of the directory's absolute path. Not next to the data, because
a shard directory may be read-only or shared between users (a verdict one
user writes into it would be trusted by all), and because pipeline input
hashes and artifact digests hash every file of a directory, so a cache file
there would change them. Writes are atomic (temporary file + rename); a cache
that cannot be written or read is ignored (everything is hashed instead).

Objects in a bucket (`url_sha256s`) are hashed by streaming them (ranged GETs
of 8 MiB, each retried; nothing goes to disk) and remembered the same way,
keyed by the URL (credentials redacted; for S3 with the endpoint, since the
same bucket name on another server is another object) and stamped with what
the store's `info` says: the size and the ETag (GCS: the generation; failing
those, the modification time). A rewritten object gets a new ETag, so it is
hashed again; an object whose info carries neither is hashed every time.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from shipyard.user_cache import user_cache

RACY_NS = 2_000_000_000
"""A file modified this recently (ns) before it is hashed is not remembered (see sha256_files)."""


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cache_root() -> Path:
    """$XDG_CACHE_HOME/shipyard/sha256 (`user_cache`)."""
    return user_cache("sha256")


def _cache_file(directory: str | Path) -> Path:
    return cache_root() / (hashlib.sha256(str(directory).encode()).hexdigest()[:32] + ".json")


def _stamp(path: Path) -> list[int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _read(directory: str | Path) -> dict:
    try:
        data = json.loads(_cache_file(directory).read_text())
    except (OSError, ValueError):
        return {}
    files = data.get("files") if isinstance(data, dict) and data.get("dir") == str(directory) else None
    return files if isinstance(files, dict) else {}


def _write(directory: str | Path, files: dict) -> None:
    target = _cache_file(directory)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"dir": str(directory), "files": files}, f)
        os.replace(tmp, target)
    except OSError:
        pass  # a read-only or full cache directory only costs re-hashing next time


def sha256_files(directory: str | Path, names: Iterable[str], *, fresh: bool = False) -> dict[str, str]:
    """{name: sha256} of the files `directory/name`, taken from the cache for files whose stat is
    unchanged since they were hashed (all hashed when `fresh`); the cache is updated with files
    that had settled (unchanged for RACY_NS) when hashed. A missing file is left out."""
    directory = Path(directory).absolute()
    known = _read(directory)
    cached = {} if fresh else known
    out: dict[str, str] = {}
    changed = False
    for name in names:
        stamp = _stamp(directory / name)
        if stamp is None:
            continue
        entry = cached.get(name)
        if isinstance(entry, list) and len(entry) == 5 and entry[:4] == stamp:
            out[name] = entry[4]
            continue
        started = time.time_ns()
        out[name] = file_sha256(directory / name)
        # Not remembered: a file written while it was hashed, or changed within RACY_NS of the hashing
        # (timestamps are coarse, so a rewrite in the same tick could leave the stat as it was).
        settled = max(stamp[1], stamp[2]) < started - RACY_NS
        if settled and _stamp(directory / name) == stamp:
            known[name] = [*stamp, out[name]]
            changed = True
    if changed:
        # drop entries of files that are gone, so the cache of a directory never outgrows it
        _write(directory, {n: e for n, e in known.items() if (directory / n).exists()})
    return out


REMOTE_CHUNK = 8 << 20
"""Bytes per ranged GET when an object is hashed by streaming."""


def url_sha256(url: str) -> str:
    """The sha256 of an object's bytes, streamed in REMOTE_CHUNK ranged GETs (never to disk)."""
    from shipyard.storage import RangeReader

    reader = RangeReader(url)
    h = hashlib.sha256()
    for start in range(0, reader.size, REMOTE_CHUNK):
        h.update(reader.read(start, min(reader.size, start + REMOTE_CHUNK)))
    return h.hexdigest()


def _remote_stamp(info: dict) -> list | None:
    """[size, version] from a store's info: ETag, GCS generation, else a modification time; None when
    it names no version (the object is then hashed every time)."""
    for key in ("ETag", "etag", "generation", "LastModified", "mtime", "updated", "created"):
        if info.get(key) is not None:
            return [int(info.get("size") or 0), f"{key}={info[key]}"]
    return None


def _remote_key(url: str) -> str:
    from urllib.parse import urlsplit

    from shipyard.storage import redact

    endpoint = os.environ.get("AWS_ENDPOINT_URL", "") if urlsplit(url).scheme == "s3" else ""
    return f"{redact(endpoint)}|{redact(url)}" if endpoint else redact(url)


def url_sha256s(prefix: str, names: Iterable[str], *, fresh: bool = False) -> dict[str, str]:
    """{name: sha256} of the objects `prefix/name` (hashed by streaming: see url_sha256), taken from
    the cache for objects whose size and ETag (or generation) are unchanged since they were hashed;
    all hashed when `fresh`. A missing object is left out."""
    from shipyard.storage import filesystem, join, retrying

    key = _remote_key(prefix)
    known = _read(key)
    cached = {} if fresh else known
    out: dict[str, str] = {}
    changed = False
    for name in names:
        url = str(join(prefix, name))
        fs, path = filesystem(url)
        try:
            stamp = _remote_stamp(retrying(lambda fs=fs, path=path: fs.info(path), f"checking {key}/{name}"))
        except Exception as e:  # a missing object is left out, as a missing file is
            if isinstance(e.__cause__, FileNotFoundError):
                continue
            raise
        entry = cached.get(name)
        if stamp is not None and isinstance(entry, list) and len(entry) == 3 and entry[:2] == stamp:
            out[name] = entry[2]
            continue
        out[name] = url_sha256(url)
        if stamp is not None:  # an object's ETag names its bytes: no racy window as with mtimes
            known[name] = [*stamp, out[name]]
            changed = True
    if changed:
        _write(key, known)
    return out
