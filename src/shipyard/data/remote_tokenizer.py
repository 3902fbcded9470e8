"""A tokenizer named by URL, fetched once into the local cache.

A tokenizer is a few small files (tokenizer.json, tokenizer_config.json, a
chat template), read whole by `tokenizers` from a local path; so a URL
(`s3://bucket/tok` for a published directory, or `s3://bucket/tok/tokenizer.json`)
is downloaded to `$XDG_CACHE_HOME/shipyard/tokenizers/<key>` and used from
there. Only a complete publication is taken: the prefix's `_SUCCESS` marker
must exist (a `data tokenizer-train --out URL` writes it last), and when the
marker lists files with their sha256 (shipyard's stage marker does), every
downloaded file is checked against it. The cache key hashes the URL and the
marker's content, so a republished tokenizer is fetched again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from shipyard import storage
from shipyard.errors import DataError

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
"""What a tokenizer directory may hold that loading it reads."""


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/shipyard/tokenizers (XDG_CACHE_HOME defaults to ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shipyard" / "tokenizers"


def local_tokenizer(path: str | Path) -> Path:
    """A local path for tokenizer `path`: itself when local, else its cached download."""
    storage.check_scheme(path, "tokenizer")
    if not storage.is_url(path):
        return storage.local(path)
    url = str(path).rstrip("/")
    is_file = url.endswith((".json", ".jinja"))
    prefix, file = url.rsplit("/", 1) if is_file else (url, None)
    shown = storage.redact(url)
    if not storage.is_published(prefix):
        raise DataError(
            f"tokenizer {shown}: {storage.redact(prefix)} is not a complete publication (no "
            f"{storage.MARKER}); publish it with `shipyard data tokenizer-train --out URL`, or upload "
            f"an empty {storage.MARKER} object there after its files"
        )
    marker = storage.read_bytes(str(storage.join(prefix, storage.MARKER)))
    key = hashlib.sha256(storage.redact(prefix).encode() + b"\0" + marker).hexdigest()[:32]
    dest = cache_dir() / key
    if not dest.is_dir():
        _download(prefix, dest, _listed_hashes(marker), shown, file)
    return dest / file if file else dest


def _listed_hashes(marker: bytes) -> dict[str, str] | None:
    """name -> sha256 from a shipyard stage marker; None for a marker without a listing (an empty one)."""
    try:
        files = json.loads(marker).get("files")
    except (ValueError, AttributeError):
        return None
    return {n: f["sha256"] for n, f in files.items()} if isinstance(files, dict) else None


def _download(prefix: str, dest: Path, hashes: dict[str, str] | None, shown: str, file: str | None) -> None:
    """The tokenizer files under `prefix` into `dest` (atomically), each checked against `hashes`."""
    present = set(hashes) if hashes is not None else set(storage.list_files(prefix))
    names = sorted(n for n in present if n in TOKENIZER_FILES or n == file)
    if (file or TOKENIZER_FILES[0]) not in names:
        raise DataError(f"tokenizer {shown}: no {file or TOKENIZER_FILES[0]} under {storage.redact(prefix)}")
    storage.download_dir(prefix, dest, names)
    for name in names if hashes is not None else ():
        got = hashlib.sha256((dest / name).read_bytes()).hexdigest()
        if got != hashes[name]:
            shutil.rmtree(dest, ignore_errors=True)
            raise DataError(
                f"tokenizer {shown}: {name} has sha256 {got[:12]}..., its {storage.MARKER} lists "
                f"{hashes[name][:12]}... (changed after publication); republish it"
            )
