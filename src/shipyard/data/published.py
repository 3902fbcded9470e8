"""Small published directories named by URL (a tokenizer, a classifier), fetched once into the cache.

What `tokenizers` and fastText load is a few small files read whole from a
local path, so a URL of such a directory is downloaded to
`$XDG_CACHE_HOME/shipyard/<kind>/<key>` and used from there. Only a complete
publication is taken: the prefix's `_SUCCESS` marker must exist (a stage
with `--out URL` writes it last), and when the marker lists files with their
sha256 (a stage's marker does: see `stage.publish_output`), every downloaded
file is checked against it. The key hashes the URL and the marker's content,
so a republished directory is fetched again and an unchanged one never is.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from shipyard import storage
from shipyard.data.hashcache import sha256_files
from shipyard.errors import DataError
from shipyard.user_cache import user_cache


def cache_dir(kind: str) -> Path:
    """$XDG_CACHE_HOME/shipyard/<kind> (`user_cache`)."""
    return user_cache(kind)


def fetch_published(
    prefix: str, names: tuple[str, ...], required: str, kind: str, what: str, producer: str
) -> Path:
    """The files `names` (those present; `required` must be) of published prefix `prefix`, as a
    local cached directory. `what` starts the error lines; `producer` says what publishes one."""
    prefix = prefix.rstrip("/")
    shown = storage.redact(prefix)
    if not storage.is_published(prefix):
        raise DataError(
            f"{what}: {shown} is not a complete publication (no {storage.MARKER}); publish it with "
            f"`{producer}`, or upload an empty {storage.MARKER} object there after its files"
        )
    marker = storage.read_bytes(str(storage.join(prefix, storage.MARKER)))
    key = hashlib.sha256(shown.encode() + b"\0" + marker).hexdigest()[:32]
    dest = cache_dir(kind) / key
    if not dest.is_dir():
        hashes = _listed_hashes(marker)
        present = set(hashes) if hashes is not None else set(storage.list_files(prefix))
        wanted = sorted(n for n in present if n in names)
        if required not in wanted:
            raise DataError(f"{what}: no {required} under {shown}")
        storage.download_dir(prefix, dest, wanted)
        actual = sha256_files(dest, wanted, fresh=True) if hashes is not None else {}
        for name, got in actual.items():
            if got != hashes[name]:
                shutil.rmtree(dest, ignore_errors=True)
                raise DataError(
                    f"{what}: {name} has sha256 {got[:12]}..., its {storage.MARKER} lists "
                    f"{hashes[name][:12]}... (changed after publication); republish it"
                )
    return dest


def _listed_hashes(marker: bytes) -> dict[str, str] | None:
    """name -> sha256 from a stage's marker; None for a marker without a listing (an empty one)."""
    try:
        files = json.loads(marker).get("files")
    except (ValueError, AttributeError):
        return None
    return {n: f["sha256"] for n, f in files.items()} if isinstance(files, dict) else None


def local_dir(path: str | Path, names: tuple[str, ...], kind: str, what: str, producer: str) -> Path:
    """`path` itself when local; for a URL, its files `names` (the first required) from the cache."""
    storage.check_scheme(path, what)
    if not storage.is_url(path):
        return storage.local(path)
    return fetch_published(str(path), names, names[0], kind, f"{what} {storage.redact(path)}", producer)
