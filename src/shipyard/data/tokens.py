"""Token files as training input: a 1-D .npy of ids (validated) and content hashes for provenance.

Batches are cut by data/loader.py; this module checks a .npy against the
model (shape, dtype, ids inside the vocabulary) and hashes inputs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shipyard.data.shards import MANIFEST, file_sha256
from shipyard.errors import DataError


def load_tokens(path: str | Path, vocab_size: int, seq_len: int) -> np.ndarray:
    """Memory-map a 1-D integer .npy of token ids and check it against the model.

    (Token-shard directories are read by data/loader.py's SequenceSource.)
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data.train_tokens: {path} does not exist (expected a 1-D .npy of token ids)")
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise DataError(f"data.train_tokens: {path} is not a readable .npy array ({e})") from e
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(
            f"data.train_tokens: {path} holds a {tokens.dtype} array of shape {tokens.shape}; "
            "expected a 1-D integer array of token ids"
        )
    if len(tokens) < seq_len + 1:
        raise DataError(
            f"data.train_tokens: {path} has {len(tokens)} tokens, fewer than one sequence "
            f"(data.seq_len + 1 = {seq_len + 1})"
        )
    # One streaming pass so an out-of-range id fails here, with its position,
    # rather than as a silent clamp inside the embedding gather.
    chunk = 1 << 24
    for start in range(0, len(tokens), chunk):
        part = tokens[start : start + chunk]
        bad = np.flatnonzero((part < 0) | (part >= vocab_size))
        if bad.size:
            i = start + int(bad[0])
            raise DataError(
                f"data.train_tokens: {path} has token id {int(tokens[i])} at position {i}, "
                f"outside model.vocab_size={vocab_size}"
            )
    return tokens


def tokens_sha256(path: str | Path) -> str:
    """Content hash of a token file, or of a shard directory's manifest (which holds every shard's hash)."""
    path = Path(path)
    return file_sha256(path / MANIFEST if path.is_dir() else path)
