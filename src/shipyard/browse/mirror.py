"""A pipeline root in a bucket (`s3://`, `gs://`, `memory://`) as a local directory to browse: each
step prefix downloaded into `$XDG_CACHE_HOME/shipyard/browse/<digest of the URL>/<step>`, again only
when its objects changed (name, size, ETag or modification time). Unlike the pipeline's own fetch
(experiment/remote.py), a copy that does not match its recorded digests is kept, not refused: the
browser's graph is where such a step shows ✗."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from shipyard import storage
from shipyard.errors import DataError
from shipyard.user_cache import user_cache


def cache_dir(url: str) -> Path:
    return user_cache("browse", hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16])


def _listing(url: str) -> str:
    """What identifies the objects under `url` now: each one's name, size and version mark (S3's
    ETag, else a modification time): a changed byte changes its ETag, so the copy is fetched again."""
    fs, path = storage.filesystem(url)
    base = path.rstrip("/")
    found = storage.retrying(lambda: fs.find(base, detail=True), f"listing {storage.redact(url)}")
    rows = []
    for key, info in sorted(found.items()):
        mark = info.get("ETag") or info.get("LastModified") or info.get("mtime") or info.get("created")
        rows.append([key[len(base) + 1 :], info.get("size"), str(mark)])
    return json.dumps(rows)


def mirror(url: str, say=print) -> Path:
    """The local copy of the bucket root `url` (its step prefixes: those with a provenance.json)."""
    root = url.rstrip("/")
    fs, path = storage.filesystem(root)
    try:
        entries = storage.retrying(
            lambda: fs.ls(path.rstrip("/"), detail=False), f"listing {storage.redact(root)}"
        )
    except storage.StorageError as e:
        raise DataError(
            f"browse: {storage.redact(root)} cannot be listed ({e}); expected a pipeline root"
        ) from None
    local = cache_dir(root)
    local.mkdir(parents=True, exist_ok=True)
    names = set()
    for entry in sorted(entries):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        step_url = str(storage.join(root, name))
        if not storage.exists(str(storage.join(step_url, "provenance.json"))):
            continue  # not a step (or one whose upload never got that far)
        names.add(name)
        listing = _listing(step_url)
        seen = local / f".{name}.listing.json"
        if (local / name).is_dir() and seen.is_file() and seen.read_text() == listing:
            continue
        say(f"browse: fetching {storage.redact(step_url)}")
        shutil.rmtree(local / name, ignore_errors=True)
        storage.download_dir(step_url, local / name)
        seen.write_text(listing)
    for gone in [p for p in local.iterdir() if p.is_dir() and p.name not in names]:  # deleted since
        shutil.rmtree(gone, ignore_errors=True)
    if not names:
        raise DataError(
            f"browse: {storage.redact(root)} holds no pipeline steps (prefixes with provenance.json)"
        )
    return local
