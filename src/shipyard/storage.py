"""Object storage through fsspec: URLs, retries with backoff, atomic publication.

Everything shipyard reads or writes may be a local path or a URL: `s3://`,
`gs://`, `memory://` (and `file://`, which is a local path). Credentials come
from each library's usual places (for S3: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY,
AWS_ENDPOINT_URL, ~/.aws/config; for GCS: application default credentials); shipyard
never takes them as arguments, and `redact` strips any that a URL carries before
it is printed or recorded.

Object stores have no rename, so a directory is *published*: its files go to the
final prefix, then a marker object (`_SUCCESS` by default) last. A reader takes a
prefix as complete only when its marker exists, so an upload killed half way is
never mistaken for a finished one; publishing again deletes the marker first.

Every operation is retried with exponential backoff on transient errors (a
refused or dropped connection, a timeout, a 5xx), so a store that is briefly
down or a proxy that drops connections costs time, not the run. Each retried
unit is idempotent: a whole-object PUT, a ranged GET, a listing.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

from shipyard.errors import ShipyardError

MARKER = "_SUCCESS"
REMOTE_SCHEMES = ("s3", "gs", "gcs", "memory")
T = TypeVar("T")


class StorageError(ShipyardError):
    """A storage URL cannot be read or written (missing object, no access, store down past the retries)."""

    exit_code = 3


@dataclass(frozen=True)
class Retry:
    """How hard to retry a transient storage error before giving up."""

    attempts: int = 9
    """Tries in all (the first plus retries)."""
    first_delay: float = 0.2
    """Seconds before the first retry; each later wait doubles, with jitter."""
    max_delay: float = 8.0
    """Cap on one wait; the defaults ride out about 30 s of outage."""


DEFAULT_RETRY = Retry()


def is_url(path: str | Path) -> bool:
    """Whether `path` names remote storage (a scheme other than file://)."""
    if isinstance(path, Path):
        return False
    scheme = urlsplit(str(path)).scheme
    return scheme in REMOTE_SCHEMES


def local(path: str | Path) -> Path:
    """A local path (file:// URLs included) as a Path; refuses remote URLs."""
    if is_url(path):
        raise ValueError(f"{path} is remote storage, not a local path")
    s = str(path)
    return Path(urlsplit(s).path) if s.startswith("file://") else Path(s)


def check_scheme(path: str | Path, what: str) -> None:
    """One clear line for a URL whose scheme shipyard does not know (s3:/, htp://...)."""
    s = str(path)
    scheme = urlsplit(s).scheme
    if "://" in s and scheme not in (*REMOTE_SCHEMES, "file"):
        raise StorageError(
            f"{what}: {redact(s)} has scheme {scheme!r}; expected a local path or one of "
            "s3://, gs://, memory://, file://"
        )


def redact(url: str | Path) -> str:
    """`url` without user info or query (where credentials can hide), for messages and provenance."""
    s = str(url)
    if "://" not in s:
        return s
    parts = urlsplit(s)
    host = parts.hostname or ""
    if parts.port:
        host += f":{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def join(base: str | Path, *names: str) -> str | Path:
    """`base`/name/..., a URL for a URL and a Path for a path."""
    if is_url(base):
        return "/".join([str(base).rstrip("/"), *(n.strip("/") for n in names)])
    return Path(base).joinpath(*names)


def _transient(e: BaseException) -> bool:
    """Connection trouble or a server-side error, worth retrying; not a missing object or a denial."""
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    names = {c.__name__ for c in type(e).__mro__}
    transient_names = {
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "ClientConnectorError",
        "ClientOSError",
        "ServerDisconnectedError",
        "ClientPayloadError",
        "IncompleteReadError",
        "ResponseStreamingError",
        "ProtocolError",
    }
    if names & transient_names:
        return True
    text = str(e)
    return any(code in text for code in ("500", "502", "503", "504", "SlowDown", "InternalError"))


def retrying(fn: Callable[[], T], what: str, retry: Retry = DEFAULT_RETRY, log=None) -> T:
    """`fn()`, retried on transient errors with exponential backoff and jitter; a StorageError
    naming `what` when the tries run out or the error is not transient."""
    delay = retry.first_delay
    for attempt in range(1, retry.attempts + 1):
        try:
            return fn()
        except Exception as e:
            if isinstance(e, ShipyardError):
                raise
            if isinstance(e, FileNotFoundError):
                raise StorageError(f"{what}: not found") from e
            if type(e).__name__ == "NoCredentialsError":  # botocore: nothing in env, ~/.aws or metadata
                raise StorageError(
                    f"{what}: no credentials for the bucket; set AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) where the stage is started: its tasks get them from there"
                ) from e
            if not _transient(e) or attempt == retry.attempts:
                tries = f" after {attempt} tries" if attempt > 1 else ""
                raise StorageError(
                    f"{what}: {type(e).__name__}: {str(e).splitlines()[0][:200]}{tries}"
                ) from e
            if log is not None:
                log(f"shipyard: {what}: {type(e).__name__}; retrying in {delay:.1f} s")
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, retry.max_delay)
    raise AssertionError("unreachable")


def filesystem(url: str):
    """(fsspec filesystem, path inside it) for a URL. Listings are not cached: other processes
    publish into the same prefixes, and a stale listing would hide their markers."""
    import fsspec.core

    scheme = urlsplit(url).scheme
    options = {}
    if scheme == "s3":
        # fsspec caches filesystems by their arguments: naming the endpoint (which botocore would
        # read from AWS_ENDPOINT_URL anyway) gives a changed endpoint a fresh client
        options = {"use_listings_cache": False, "endpoint_url": os.environ.get("AWS_ENDPOINT_URL")}
    fs, path = fsspec.core.url_to_fs(url, **options)
    return fs, path


def read_bytes(
    url: str, start: int | None = None, end: int | None = None, retry: Retry = DEFAULT_RETRY
) -> bytes:
    """An object's bytes, or bytes [start, end) of it (a ranged GET)."""
    fs, path = filesystem(url)
    return retrying(lambda: fs.cat_file(path, start=start, end=end), f"reading {redact(url)}", retry)


def write_bytes(url: str, data: bytes, retry: Retry = DEFAULT_RETRY) -> None:
    """One object written whole (an object store's PUT is atomic: readers see all of it or none)."""
    fs, path = filesystem(url)
    retrying(lambda: fs.pipe_file(path, data), f"writing {redact(url)}", retry)


def exists(url: str, retry: Retry = DEFAULT_RETRY) -> bool:
    fs, path = filesystem(url)
    return retrying(lambda: fs.exists(path), f"checking {redact(url)}", retry)


def size(url: str, retry: Retry = DEFAULT_RETRY) -> int:
    fs, path = filesystem(url)
    return int(retrying(lambda: fs.size(path), f"sizing {redact(url)}", retry))


def list_files(url: str, retry: Retry = DEFAULT_RETRY) -> list[str]:
    """Every object under prefix `url`, as sorted names relative to it ('a/b.npy')."""
    fs, path = filesystem(url)
    root = path.rstrip("/")
    found = retrying(lambda: fs.find(root), f"listing {redact(url)}", retry)
    return sorted(p[len(root) + 1 :] for p in found if p.startswith(root + "/"))


def remove(url: str, retry: Retry = DEFAULT_RETRY) -> None:
    """Delete everything under prefix `url` (and an object named `url`); nothing there is fine."""
    fs, path = filesystem(url)

    def rm():
        with contextlib.suppress(FileNotFoundError):
            fs.rm(path.rstrip("/"), recursive=True)

    retrying(rm, f"deleting {redact(url)}", retry)


def is_published(url: str, marker: str = MARKER, retry: Retry = DEFAULT_RETRY) -> bool:
    """Whether the prefix `url` was published completely (its marker exists)."""
    return exists(str(join(url, marker)), retry)


def publish_dir(
    source: Path,
    url: str,
    marker: str = MARKER,
    marker_text: bytes = b"",
    retry: Retry = DEFAULT_RETRY,
    replace: bool = True,
) -> list[str]:
    """Upload every file under local `source` to prefix `url`, then the marker, last.

    The marker of an earlier publication is deleted first (and, with `replace`, everything
    else under the prefix), so no reader ever sees a marker next to a mix of old and new
    files. A file named like the marker in `source` is uploaded as the marker, last.
    Returns the names uploaded."""
    source = Path(source)
    fs, path = filesystem(url)
    root = path.rstrip("/")
    retrying(lambda: _rm_quiet(fs, f"{root}/{marker}"), f"unpublishing {redact(url)}", retry)
    if replace:
        remove(url, retry)
    names = sorted(p.relative_to(source).as_posix() for p in source.rglob("*") if p.is_file())
    payload = [n for n in names if n != marker]
    for name in payload:
        local_file = source / name
        retrying(
            lambda local_file=local_file, name=name: fs.put_file(str(local_file), f"{root}/{name}"),
            f"uploading {redact(url)}/{name}",
            retry,
        )
    final = (source / marker).read_bytes() if marker in names else marker_text
    retrying(lambda: fs.pipe_file(f"{root}/{marker}", final), f"publishing {redact(url)}", retry)
    return [*payload, marker]


def _rm_quiet(fs, path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(path)


def download_dir(url: str, dest: Path, names: list[str] | None = None, retry: Retry = DEFAULT_RETRY) -> Path:
    """Every object under prefix `url` (or just `names`) into local `dest`, atomically: into a
    temporary sibling first, renamed into place when all have arrived."""
    from shipyard.output import atomic_dir

    dest = Path(dest)
    fs, path = filesystem(url)
    root = path.rstrip("/")
    names = list_files(url, retry) if names is None else names
    with atomic_dir(dest, "download", overwrite=True) as tmp:
        for name in names:
            target = tmp / name
            target.parent.mkdir(parents=True, exist_ok=True)
            retrying(
                lambda name=name, target=target: fs.get_file(f"{root}/{name}", str(target)),
                f"downloading {redact(url)}/{name}",
                retry,
            )
    return dest


class RangeReader:
    """Byte ranges of one remote object, each a ranged GET (retried), never the whole object."""

    def __init__(self, url: str, retry: Retry = DEFAULT_RETRY):
        self.url, self.retry = url, retry
        self._fs, self._path = filesystem(url)
        self.size = int(retrying(lambda: self._fs.size(self._path), f"sizing {redact(url)}", retry))

    def read(self, start: int, end: int) -> bytes:
        """Bytes [start, end) of the object."""

        def get() -> bytes:
            data = self._fs.cat_file(self._path, start=start, end=end)
            if len(data) != end - start:  # a body cut short that the client did not notice
                raise ConnectionError(f"got {len(data)} bytes of {end - start}")
            return data

        return retrying(get, f"reading {redact(self.url)} bytes {start}-{end}", self.retry)


ENV_PREFIXES = ("AWS_", "GOOGLE_", "GCS_", "FSSPEC_")


def environment() -> dict[str, str]:
    """This process's object-storage settings (endpoint, region, credentials) from the environment."""
    return {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}


def apply_environment(env: dict[str, str]) -> None:
    """Take `env` (`environment()` of the planning process) as this process's storage settings."""
    for k in [k for k in os.environ if k.startswith(ENV_PREFIXES) and k not in env]:
        del os.environ[k]
    os.environ.update(env)
