"""Token shards on disk: 1-D .npy files of token ids plus manifest.json (DESIGN.md, "Token shards").

A shard is written by appending token arrays after a .npy header whose shape
is fixed up when the shard is closed (numpy reserves room in the header for
exactly this), so no shard is ever held in memory whole. Documents never
straddle shards and each ends with the EOS id. The manifest records, per
shard, its token and document counts and sha256. `open_shards` (what
training, held-out evaluation and the pipeline read through) checks every
shard's byte size against the manifest always and its sha256 unless asked
not to (`data.verify: false`), remembering digests per user so restarts do
not re-hash (data/hashcache.py); `verify_shards` re-hashes everything. A
flipped byte is caught before it reaches training.

A shard set may also live in a bucket (`s3://`, `gs://`, `memory://` URLs):
the manifest is read whole, each shard becomes a `RemoteArray`
(data/remote_array.py) that reads the byte ranges the loader asks for and
never copies the shard to local disk, checked against the manifest as a local
shard is (its .npy header, and its size against header + token count).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from shipyard import storage
from shipyard.data.hashcache import file_sha256, sha256_files, url_sha256s
from shipyard.data.remote_array import BlockCache, RemoteArray
from shipyard.data.sources import STAGE_TAG
from shipyard.errors import DataError

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32 (halves the disk and page cache for vocabularies up to 65536)."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def shard_header(dtype: np.dtype, n: int) -> bytes:
    """The .npy header of a 1-D shard of `n` tokens (numpy pads it: its length does not depend on n)."""
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": dtype.str, "fortran_order": False, "shape": (n,)})
    return buf.getvalue()


class ShardWriter:
    """Appends documents' tokens to shard-NNNNN.npy files of about `shard_tokens` tokens each."""

    def __init__(self, out_dir: Path, dtype: np.dtype, shard_tokens: int):
        self.out_dir, self.dtype, self.shard_tokens = Path(out_dir), np.dtype(dtype), shard_tokens
        self.shards: list[dict] = []
        self._file = None
        self._hash = None
        self._tokens = self._docs = 0

    def _open(self) -> None:
        name = f"shard-{len(self.shards):05d}.npy"
        self._file = open(self.out_dir / name, "wb")  # noqa: SIM115
        self._header_len = len(shard_header(self.dtype, 0))
        self._file.write(shard_header(self.dtype, 0))
        self._name, self._tokens, self._docs = name, 0, 0

    @property
    def room(self) -> int:
        """Tokens the open shard takes before it is closed."""
        return self.shard_tokens - (self._tokens if self._file is not None else 0)

    def write(self, tokens: np.ndarray, documents: int) -> None:
        """Append the tokens of `documents` whole documents (each already ending in EOS)."""
        if self._file is None:
            self._open()
        self._file.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self._tokens += int(tokens.size)
        self._docs += documents
        if self._tokens >= self.shard_tokens:
            self._close_shard()

    def _close_shard(self) -> None:
        header = shard_header(self.dtype, self._tokens)
        if len(header) != self._header_len:  # numpy pads the header so this cannot happen; check anyway
            raise RuntimeError("npy header grew while writing a shard")
        self._file.seek(0)
        self._file.write(header)
        self._file.close()
        self._file = None
        self.shards.append(
            {
                "file": self._name,
                "tokens": self._tokens,
                "documents": self._docs,
                "sha256": file_sha256(self.out_dir / self._name),
            }
        )

    def close(self) -> list[dict]:
        if self._file is not None:
            self._close_shard()
        return self.shards


def read_manifest(shard_dir: str | Path) -> dict:
    """manifest.json of a shard directory (a local path or a bucket URL), its required fields and
    shard table checked."""
    if storage.is_url(shard_dir):
        where = storage.redact(storage.join(shard_dir, MANIFEST))
        if not storage.exists(str(storage.join(shard_dir, MANIFEST))):
            raise DataError(
                f"token shards {storage.redact(shard_dir)}: no {MANIFEST} (expected the output of "
                "`shipyard data tokenize`)"
            )
        _check_published(str(shard_dir))
        raw = storage.read_bytes(str(storage.join(shard_dir, MANIFEST)))
    else:
        path = storage.local(shard_dir) / MANIFEST
        if not path.is_file():
            raise DataError(
                f"token shards {shard_dir}: no {MANIFEST} (expected the output of `shipyard data tokenize`)"
            )
        where, raw = path, path.read_bytes()
    try:
        manifest = json.loads(raw.decode())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"token shards {where}: not valid JSON ({e})") from e
    return _check_manifest(manifest, where)


def _check_published(url: str) -> None:
    """Refuse shards a stage was still publishing (its tag is written first, its marker last): a
    tokenize killed mid-upload leaves a manifest whose shards may be missing or from an older run."""
    if storage.exists(str(storage.join(url, STAGE_TAG))) and not storage.is_published(url):
        raise DataError(
            f"token shards {storage.redact(url)}: not a complete stage output (no {storage.MARKER}): "
            "its publication was interrupted; rerun `shipyard data tokenize`"
        )


def _check_manifest(manifest, path) -> dict:
    if not isinstance(manifest, dict):
        raise DataError(f"token shards {path}: expected a JSON object, got {type(manifest).__name__}")
    missing = [k for k in ("vocab_size", "dtype", "eos_id", "shards") if k not in manifest]
    if missing:
        raise DataError(f"token shards {path}: manifest lacks {', '.join(missing)}")
    shards = manifest["shards"]
    entry_ok = lambda e: (  # noqa: E731
        isinstance(e, dict)
        and isinstance(e.get("file"), str)
        and isinstance(e.get("tokens"), int)
        and isinstance(e.get("sha256"), str)
    )
    if not isinstance(shards, list) or not all(entry_ok(e) for e in shards):
        raise DataError(
            f"token shards {path}: shards must be a list of {{file, tokens, sha256}} entries (as "
            "`shipyard data tokenize` writes)"
        )
    if manifest["dtype"] not in ("uint16", "uint32"):
        raise DataError(f"token shards {path}: dtype {manifest['dtype']!r}; expected uint16 or uint32")
    return manifest


def _open_shard(shard_dir: Path, dtype: str, shard: dict) -> np.ndarray:
    """One shard memory-mapped after checking it against its manifest entry: present, a 1-D .npy
    of the manifest's dtype and token count, and exactly as many bytes as its header and that count
    make (a truncated or extended file is refused before anything is hashed)."""
    name, path = shard["file"], shard_dir / shard["file"]
    if not path.is_file():
        raise DataError(f"token shards {shard_dir}: {name} is missing (the manifest lists it)")
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, _, got = read_header(f)
            offset = f.tell()
    except (OSError, ValueError) as e:
        raise DataError(f"token shards {shard_dir}: {name} is not a readable .npy file ({e})") from e
    _check_layout(shard_dir, shard, dtype, shape, got, offset, path.stat().st_size)
    return np.load(path, mmap_mode="r", allow_pickle=False)


def _check_layout(where, shard: dict, dtype: str, shape, got: np.dtype, offset: int, size: int) -> None:
    """A shard's header against its manifest entry, and its byte size against header + tokens."""
    name = shard["file"]
    if len(shape) != 1 or shape[0] != shard["tokens"] or got != np.dtype(dtype):
        raise DataError(
            f"token shards {where}: {name} holds {got} {shape}, manifest says {dtype} ({shard['tokens']},)"
        )
    expected = offset + shard["tokens"] * got.itemsize
    if size != expected:
        raise DataError(
            f"token shards {where}: {name} is {size} bytes, expected {expected} for its "
            f"{shard['tokens']} tokens (truncated or appended to)"
        )


def _open_remote_shard(shard_dir: str, dtype: str, shard: dict, cache: BlockCache) -> RemoteArray:
    """One shard in a bucket as a RemoteArray (its size and .npy header read, nothing else), checked
    against its manifest entry as `_open_shard` checks a local one."""
    where, name = storage.redact(shard_dir), shard["file"]
    url = str(storage.join(shard_dir, name))
    try:
        array = RemoteArray(url, cache)
    except storage.StorageError as e:
        if isinstance(e.__cause__, FileNotFoundError):
            raise DataError(f"token shards {where}: {name} is missing (the manifest lists it)") from e
        raise
    except ValueError as e:
        raise DataError(f"token shards {where}: {name} is not a readable .npy file ({e})") from e
    _check_layout(where, shard, dtype, array.shape, array.dtype, array.offset, array.object_size)
    return array


def _check_hashes(shard_dir: str | Path, shards: list[dict], fresh: bool) -> None:
    names = [s["file"] for s in shards]
    if storage.is_url(shard_dir):
        digests, where = url_sha256s(str(shard_dir), names, fresh=fresh), storage.redact(shard_dir)
    else:
        digests, where = sha256_files(shard_dir, names, fresh=fresh), shard_dir
    for shard in shards:
        digest = digests.get(shard["file"])
        if digest != shard["sha256"]:
            raise DataError(
                f"token shards {where}: {shard['file']} is corrupt (sha256 {digest[:12]}..., "
                f"manifest says {shard['sha256'][:12]}...); re-create the shards with `shipyard data tokenize`"
            )


def _open_all(shard_dir: str | Path, manifest: dict) -> list:
    if storage.is_url(shard_dir):
        cache = BlockCache()  # one bounded cache for the whole set, however many shards it has
        return [_open_remote_shard(str(shard_dir), manifest["dtype"], s, cache) for s in manifest["shards"]]
    return [_open_shard(storage.local(shard_dir), manifest["dtype"], s) for s in manifest["shards"]]


def open_shards(shard_dir: str | Path, verify: bool = True) -> tuple[dict, list]:
    """The manifest and each shard memory-mapped (a RemoteArray for a bucket URL), checked against the
    manifest first: sizes always, and with `verify` each shard's sha256 (remembered in the per-user
    hash cache, so an unchanged shard is hashed once: see data/hashcache.py). A DataError names the
    first bad shard.

    What a bucket costs: opening reads the manifest, one HEAD and one ranged GET (the header) per shard.
    Verifying streams every shard's bytes once through sha256 (ranged GETs of 8 MiB, nothing on disk:
    the whole set crosses the network once, at the store's streaming rate); later opens of unchanged
    shards cost one more HEAD each (size and ETag match the cache)."""
    if not storage.is_url(shard_dir):
        shard_dir = storage.local(shard_dir)
    manifest = read_manifest(shard_dir)
    arrays = _open_all(shard_dir, manifest)
    if verify:
        _check_hashes(shard_dir, manifest["shards"], fresh=False)
    return manifest, arrays


def verify_shards(shard_dir: str | Path) -> dict:
    """Check every shard's size and sha256 against the manifest, hashing every shard afresh (the
    cache is refreshed, not trusted: this is the check for corruption the file's stat cannot show);
    raise naming the first bad shard. For a bucket URL this streams every shard once (see
    open_shards for the cost)."""
    if not storage.is_url(shard_dir):
        shard_dir = storage.local(shard_dir)
    manifest = read_manifest(shard_dir)
    _open_all(shard_dir, manifest)
    _check_hashes(shard_dir, manifest["shards"], fresh=True)
    return manifest
