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
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from shipyard.data.hashcache import file_sha256, sha256_files
from shipyard.errors import DataError

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32 (halves the disk and page cache for vocabularies up to 65536)."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _header(dtype: np.dtype, n: int) -> bytes:
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
        self._header_len = len(_header(self.dtype, 0))
        self._file.write(_header(self.dtype, 0))
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
        header = _header(self.dtype, self._tokens)
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
    """manifest.json of a shard directory, its required fields and shard table checked."""
    path = Path(shard_dir) / MANIFEST
    if not path.is_file():
        raise DataError(
            f"token shards {shard_dir}: no {MANIFEST} (expected the output of `shipyard data tokenize`)"
        )
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"token shards {path}: not valid JSON ({e})") from e
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
    if len(shape) != 1 or shape[0] != shard["tokens"] or got != np.dtype(dtype):
        raise DataError(
            f"token shards {shard_dir}: {name} holds {got} {shape}, manifest says {dtype} ({shard['tokens']},)"
        )
    size, expected = path.stat().st_size, offset + shard["tokens"] * got.itemsize
    if size != expected:
        raise DataError(
            f"token shards {shard_dir}: {name} is {size} bytes, expected {expected} for its "
            f"{shard['tokens']} tokens (truncated or appended to)"
        )
    return np.load(path, mmap_mode="r", allow_pickle=False)


def _check_hashes(shard_dir: Path, shards: list[dict], fresh: bool) -> None:
    digests = sha256_files(shard_dir, [s["file"] for s in shards], fresh=fresh)
    for shard in shards:
        digest = digests[shard["file"]]
        if digest != shard["sha256"]:
            raise DataError(
                f"token shards {shard_dir}: {shard['file']} is corrupt (sha256 {digest[:12]}..., "
                f"manifest says {shard['sha256'][:12]}...); re-create the shards with `shipyard data tokenize`"
            )


def open_shards(shard_dir: str | Path, verify: bool = True) -> tuple[dict, list[np.ndarray]]:
    """The manifest and each shard memory-mapped, checked against the manifest first: sizes always,
    and with `verify` each shard's sha256 (remembered in the per-user hash cache, so an unchanged
    shard is hashed once: see data/hashcache.py). A DataError names the first bad shard."""
    shard_dir = Path(shard_dir)
    manifest = read_manifest(shard_dir)
    arrays = [_open_shard(shard_dir, manifest["dtype"], s) for s in manifest["shards"]]
    if verify:
        _check_hashes(shard_dir, manifest["shards"], fresh=False)
    return manifest, arrays


def verify_shards(shard_dir: str | Path) -> dict:
    """Check every shard's size and sha256 against the manifest, hashing every shard afresh (the
    cache is refreshed, not trusted: this is the check for corruption the file's stat cannot show);
    raise naming the first bad shard."""
    shard_dir = Path(shard_dir)
    manifest = read_manifest(shard_dir)
    for shard in manifest["shards"]:
        _open_shard(shard_dir, manifest["dtype"], shard)
    _check_hashes(shard_dir, manifest["shards"], fresh=True)
    return manifest
