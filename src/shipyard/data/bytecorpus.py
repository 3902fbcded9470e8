"""The embedded default corpus as byte-level tokens.

No download is possible on a fresh machine, so the default training text is
the running interpreter's standard-library source. Each file becomes its UTF-8
bytes (ids 0-255) followed by EOS (id 256). The train/validation split is by a
hash of the file's path relative to the stdlib root, so it is the same on every
machine with the same Python version.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from shipyard.data.stdlib import split_of, stdlib_files

EOS_ID = 256


def write_byte_tokens(out: Path, split: str = "train", max_bytes: int | None = None) -> dict:
    """Write the split as a uint16 .npy; return stats (files, tokens)."""
    chunks, total, files = [], 0, 0
    for rel, path in stdlib_files():
        if split_of(rel) != split:
            continue
        data = path.read_bytes()
        if max_bytes is not None and total + len(data) + 1 > max_bytes:
            break
        chunks.append(np.frombuffer(data, dtype=np.uint8).astype(np.uint16))
        chunks.append(np.array([EOS_ID], dtype=np.uint16))
        total += len(data) + 1
        files += 1
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, np.uint16)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.npy")
    np.save(tmp, tokens, allow_pickle=False)
    os.replace(tmp, out)
    return {"files": files, "tokens": int(tokens.size), "split": split, "path": str(out)}
