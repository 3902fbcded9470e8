"""Pipeline roots in a bucket: local staging, publication, fetching and "is this step done there?".

A step of a pipeline whose root is a URL (`s3://bucket/prefix`, `gs://`, `memory://`) runs
exactly as with a local root, into a local directory: the *staging directory*,
`$XDG_CACHE_HOME/shipyard/pipeline/<name>-<hash>` (named by the step's content hash, so
the same step on any machine stages in the same place). When it has succeeded (its
`provenance.json` and `_SUCCESS` written, marker last) the directory is published to
`<root>/<name>-<hash>` with `storage.publish_dir`, which uploads `_SUCCESS` last: the
marker means the same thing in the bucket as on disk, "everything here is complete".

A step is done iff its marker exists in the bucket; a prefix with objects but no marker
is an upload that was killed (or a step that failed half way through publishing) and is
redone. Before a step runs, the upstream outputs it reads are fetched into their staging
directories, unless a complete copy of exactly the published one is already there (its
`_SUCCESS`, and its `provenance.json` byte for byte the bucket's). A fetched copy is
checked against the artifact digests its provenance records before anything reads it.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from shipyard import storage
from shipyard.errors import ConfigError, DataError
from shipyard.experiment.steps import digest
from shipyard.storage import MARKER, StorageError
from shipyard.user_cache import user_cache


def staging_root() -> Path:
    """$XDG_CACHE_HOME/shipyard/pipeline (`user_cache`)."""
    return user_cache("pipeline")


def staging_dir(step_dir: str) -> Path:
    """Where step directory `<name>-<hash>` is run, or fetched to, on this machine."""
    return staging_root() / step_dir


def check_root(root: str) -> None:
    """One line when a bucket root cannot be used: credentials in the URL, or a bucket that
    does not exist (found before any step runs, not when the first one publishes)."""
    parts = root.split("://", 1)[1]
    if "@" in parts.split("/", 1)[0] or "?" in root:
        raise ConfigError(
            f"pipeline root {storage.redact(root)}: a URL with user info or a query; credentials "
            "come from the environment (AWS_* variables, ~/.aws, application default credentials)"
        )
    if root.startswith("memory://"):
        return
    fs, path = storage.filesystem(root)
    bucket = path.split("/", 1)[0]
    found = storage.retrying(lambda: fs.exists(bucket), f"checking bucket {bucket}")
    if not found:
        raise StorageError(
            f"pipeline root {storage.redact(root)}: bucket {bucket!r} does not exist (or these "
            "credentials cannot see it); create it first or give another --root"
        )


def state(url: str) -> str:
    """`done` (marker there), `partial` (objects but no marker: a killed upload) or `absent`."""
    if storage.is_published(url):
        return "done"
    return "partial" if storage.list_files(url) else "absent"


def read_provenance(url: str) -> dict:
    return json.loads(storage.read_bytes(str(storage.join(url, "provenance.json"))))


def previous(root: str, name: str) -> dict | None:
    """Provenance of the newest published output of a step called `name` under `root` (for the
    reason a step reruns: config changed, input changed...), or None."""
    fs, path = storage.filesystem(root)
    base = path.rstrip("/")
    try:
        entries = storage.retrying(lambda: fs.ls(base, detail=False), f"listing {storage.redact(root)}")
    except StorageError:
        return None  # an empty prefix: nothing published under it yet
    found = []
    for entry in entries:
        step_dir = entry.rstrip("/").rsplit("/", 1)[-1]
        url = str(storage.join(root, step_dir))
        if step_dir.startswith(f"{name}-") and storage.is_published(url):
            prov = read_provenance(url)
            found.append((prov.get("started", 0), step_dir, prov))
    return max(found, key=lambda f: f[:2])[2] if found else None


def publish(local_dir: Path, url: str, log=print) -> None:
    """A finished step's directory (its `_SUCCESS` present) to `url`, the marker last."""
    if not (local_dir / MARKER).is_file():
        raise AssertionError(f"{local_dir} is not a finished step (no {MARKER})")
    started = time.time()
    names = storage.publish_dir(local_dir, url)
    size = sum(f.stat().st_size for f in local_dir.rglob("*") if f.is_file())
    log(
        f"  published {len(names)} files ({size / 1e6:.1f} MB) in {time.time() - started:.1f} s "
        f"-> {storage.redact(url)}"
    )


def fetch(url: str, local_dir: Path, kind: str, log=print) -> Path:
    """The published step at `url` in `local_dir`: kept when it is the complete copy of exactly
    that publication, else downloaded (atomically) and checked against its recorded digests."""
    if not storage.is_published(url):
        raise DataError(
            f"pipeline: {storage.redact(url)} has no {MARKER} (not a finished step); rerun the pipeline"
        )
    remote = storage.read_bytes(str(storage.join(url, "provenance.json")))
    mine = local_dir / "provenance.json"
    if (local_dir / MARKER).is_file() and mine.is_file() and mine.read_bytes() == remote:
        return local_dir
    log(f"  fetching {storage.redact(url)} -> {local_dir}")
    started = time.time()
    storage.download_dir(url, local_dir)
    recorded = json.loads(remote).get("artifacts")
    try:
        found = digest(kind, local_dir)
    except Exception as e:  # a file the digest reads is missing or unreadable: same verdict
        found = {"error": f"{type(e).__name__}: {e}"}
    if found != recorded or (local_dir / "provenance.json").read_bytes() != remote:
        shutil.rmtree(local_dir, ignore_errors=True)
        raise StorageError(
            f"pipeline: the copy of {storage.redact(url)} does not match the artifact digests its "
            f"provenance.json records ({found} vs {recorded}); the published step was changed or "
            "damaged: rerun it with --force"
        )
    log(f"  fetched and verified in {time.time() - started:.1f} s")
    return local_dir
