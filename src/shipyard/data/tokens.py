"""Token files as training input: a 1-D .npy of ids (validated) and content hashes for provenance.

Batches are cut by data/loader.py; this module checks a .npy against the
model (shape, dtype, ids inside the vocabulary) and hashes inputs.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from shipyard import storage
from shipyard.data.hashcache import url_sha256s
from shipyard.data.shards import MANIFEST, file_sha256
from shipyard.errors import DataError


def load_tokens(path: str | Path, vocab_size: int, seq_len: int) -> np.ndarray:
    """Memory-map a 1-D integer .npy of token ids and check it against the model.

    (Token-shard directories are read by data/loader.py's SequenceSource.) A bucket URL is read by
    byte ranges (a RemoteArray); checking its ids streams the whole object once.
    """
    if storage.is_url(path):
        return _remote_tokens(str(path), vocab_size, seq_len)
    path = storage.local(path)
    if not path.is_file():
        raise DataError(f"data.train_tokens: {path} does not exist (expected a 1-D .npy of token ids)")
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise DataError(f"data.train_tokens: {path} is not a readable .npy array ({e})") from e
    _check_shape(path, tokens, seq_len)
    # One streaming pass so an out-of-range id fails here, with its position,
    # rather than as a silent clamp inside the embedding gather.
    chunk = 1 << 24
    _check_ids(path, (tokens[s : s + chunk] for s in range(0, len(tokens), chunk)), vocab_size)
    return tokens


def _check_shape(where, tokens, seq_len: int) -> None:
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(
            f"data.train_tokens: {where} holds a {tokens.dtype} array of shape {tokens.shape}; "
            "expected a 1-D integer array of token ids"
        )
    if len(tokens) < seq_len + 1:
        raise DataError(
            f"data.train_tokens: {where} has {len(tokens)} tokens, fewer than one sequence "
            f"(data.seq_len + 1 = {seq_len + 1})"
        )


def _check_ids(where, parts, vocab_size: int) -> None:
    """Every id of the consecutive arrays `parts` inside the vocabulary, else a DataError with its position."""
    start = 0
    for part in parts:
        bad = np.flatnonzero((part < 0) | (part >= vocab_size))
        if bad.size:
            i = start + int(bad[0])
            raise DataError(
                f"data.train_tokens: {where} has token id {int(part[bad[0]])} at position {i}, "
                f"outside model.vocab_size={vocab_size}"
            )
        start += len(part)


def _remote_tokens(url: str, vocab_size: int, seq_len: int):
    """A 1-D .npy of ids in a bucket as a RemoteArray, checked as load_tokens checks a local one."""
    from shipyard.data.remote_array import RemoteArray

    where = storage.redact(url)
    try:
        tokens = RemoteArray(url)
    except storage.StorageError as e:
        if isinstance(e.__cause__, FileNotFoundError):
            raise DataError(
                f"data.train_tokens: {where} does not exist (expected a 1-D .npy of token ids)"
            ) from e
        raise
    except ValueError as e:
        raise DataError(f"data.train_tokens: {where} is not a readable .npy array ({e})") from e
    expected = tokens.offset + tokens.size * tokens.dtype.itemsize
    if tokens.object_size != expected:
        raise DataError(
            f"data.train_tokens: {where} is {tokens.object_size} bytes, expected {expected} for its .npy "
            "header's shape (truncated or appended to)"
        )
    _check_shape(where, tokens, seq_len)
    _check_ids(where, tokens.chunks(1 << 23), vocab_size)
    return tokens


def is_shard_set(path: str | Path) -> bool:
    """Whether a token source is a shard directory (with a manifest) rather than a single .npy."""
    if storage.is_url(path):
        return not str(path).endswith(".npy")
    return storage.local(path).is_dir()


def tokens_sha256(path: str | Path) -> str:
    """Content hash of a token file, or of a shard directory's manifest (which holds every shard's hash);
    for a bucket URL the object is streamed (a .npy's digest is cached by ETag: data/hashcache.py)."""
    if storage.is_url(path):
        url = str(path)
        if is_shard_set(url):
            return hashlib.sha256(storage.read_bytes(str(storage.join(url, MANIFEST)))).hexdigest()
        parent, name = url.rsplit("/", 1)
        return url_sha256s(parent, [name])[name]
    path = storage.local(path)
    return file_sha256(path / MANIFEST if path.is_dir() else path)
