"""Token shards on disk: 1-D .npy files of token ids plus manifest.json (DESIGN.md, "Token shards").

A shard is written by appending token arrays after a .npy header whose shape
is fixed up when the shard is closed (numpy reserves room in the header for
exactly this), so no shard is ever held in memory whole. Documents never
straddle shards and each ends with the EOS id. The manifest records, per
shard, its token and document counts and sha256; `verify_shards` re-hashes
them, so a flipped byte is caught before it reaches training.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

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


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(shard_dir: str | Path) -> dict:
    path = Path(shard_dir) / MANIFEST
    if not path.is_file():
        raise DataError(
            f"token shards {shard_dir}: no {MANIFEST} (expected the output of `shipyard data tokenize`)"
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"token shards {path}: not valid JSON ({e.msg}, line {e.lineno})") from e
    missing = [k for k in ("vocab_size", "dtype", "eos_id", "shards") if k not in manifest]
    if missing:
        raise DataError(f"token shards {path}: manifest lacks {', '.join(missing)}")
    return manifest


def verify_shards(shard_dir: str | Path) -> dict:
    """Check every shard's size and sha256 against the manifest; raise naming the first bad shard."""
    shard_dir = Path(shard_dir)
    manifest = read_manifest(shard_dir)
    for shard in manifest["shards"]:
        path = shard_dir / shard["file"]
        if not path.is_file():
            raise DataError(f"token shards {shard_dir}: {shard['file']} is missing")
        digest = file_sha256(path)
        if digest != shard["sha256"]:
            raise DataError(
                f"token shards {shard_dir}: {shard['file']} is corrupt (sha256 {digest[:12]}..., "
                f"manifest says {shard['sha256'][:12]}...)"
            )
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
        if arr.ndim != 1 or arr.size != shard["tokens"] or arr.dtype != np.dtype(manifest["dtype"]):
            raise DataError(
                f"token shards {shard_dir}: {shard['file']} holds {arr.dtype} {arr.shape}, "
                f"manifest says {manifest['dtype']} ({shard['tokens']},)"
            )
    return manifest


def open_shards(shard_dir: str | Path) -> tuple[dict, list[np.ndarray]]:
    """The manifest and each shard memory-mapped (sizes checked, hashes not: see verify_shards)."""
    shard_dir = Path(shard_dir)
    manifest = read_manifest(shard_dir)
    arrays = []
    for shard in manifest["shards"]:
        try:
            arr = np.load(shard_dir / shard["file"], mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise DataError(f"token shards {shard_dir}: {shard['file']} is unreadable ({e})") from e
        if arr.ndim != 1 or arr.size != shard["tokens"]:
            raise DataError(
                f"token shards {shard_dir}: {shard['file']} has {arr.size} tokens, manifest says {shard['tokens']}"
            )
        arrays.append(arr)
    return manifest, arrays
