"""A stage's finished units, remembered so that a rerun after the driver died goes on from them.

A local stage output is built in `.<name>.partial` beside it (a fixed name, so the next run finds
it; `stage.stage_output`). Its `_resume/` holds `header.json` (which run this is: the stage, its
inputs, config and unit plan) and a JSON per finished unit of each pass: the result the driver
folded in, and the sha256 of every file the unit wrote. A rerun with the same header skips each
unit whose files are all there with those digests and runs the rest, so its output is the same
bytes as an uninterrupted run's; `_resume/` is removed before the output is renamed into place.
A partial run with another header is never mixed in: the rerun refuses it in one line, or starts
over with --overwrite.

An output URL is resumed the same way with its partial state in the bucket: the units' parts and
scratch files are uploaded by the tasks to the (unpublished: tagged, no marker) prefix itself, and
`_resume/` lives under it (`open_remote`); so a rerun from another machine resumes it too. The
digests of a resumed run's files are checked by the stage's workers (`finished`), not the driver.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from shipyard import __version__, storage
from shipyard.data.documents import ReadStats, Unit
from shipyard.data.hashcache import file_sha256
from shipyard.errors import DataError
from shipyard.output import write_json

RESUME = "_resume"


def header(stage: str, inputs: list[str], config: dict, units: list[Unit]) -> dict:
    """What makes two runs the same run: a partial output is resumed only under the same header."""
    plan = json.dumps([asdict(u) for u in units], sort_keys=True).encode()
    # through JSON: the header compares equal to itself read back (tuples become lists)
    return json.loads(
        json.dumps(
            {
                "stage": stage,
                "shipyard_version": __version__,
                "inputs": inputs,
                "config": config,
                "units": {"count": len(units), "sha256": hashlib.sha256(plan).hexdigest()},
            }
        )
    )


def read_if_there(path: str | Path) -> bytes | None:
    """A file's or object's bytes; None when it is not there."""
    try:
        return storage.read_bytes(str(path)) if storage.is_url(path) else Path(path).read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return None
    except storage.StorageError as e:
        if isinstance(e.__cause__, FileNotFoundError):
            return None
        raise


def stored_sha256(path: str | Path) -> str | None:
    """A file's or object's sha256; None when it is not there."""
    if not storage.is_url(path):
        try:
            return file_sha256(path)
        except (FileNotFoundError, IsADirectoryError):
            return None
    data = read_if_there(path)
    return None if data is None else hashlib.sha256(data).hexdigest()


def intact(item: tuple) -> bool:
    """Worker: whether every file {relative path: sha256} under `root` is there with its digest."""
    root, files = item
    return all(stored_sha256(storage.join(root, rel)) == digest for rel, digest in files.items())


@dataclass(frozen=True)
class Journal:
    """The finished units of one pass of a partial output at `root`."""

    root: str | Path
    """The partial output: a directory or an output URL (the files units list are relative to it)."""
    name: str
    """The pass ('units', or a stage's own: 'sketch', 'write')."""

    def path(self, index: int) -> str | Path:
        return storage.join(self.root, RESUME, f"{self.name}-{index:05d}.json")

    def entry(self, index: int) -> dict | None:
        """Unit `index`'s record as written (its files not checked)."""
        data = read_if_there(self.path(index))
        try:
            return None if data is None else json.loads(data)
        except json.JSONDecodeError:
            return None

    def finished(self, count: int, check: Callable[[Iterable], Iterator[bool]]) -> dict[int, dict]:
        """The recorded results of the units of `count` whose files are all there with their
        digests; `check` maps `intact` over (root, files) items (the stage's pool)."""
        entries = {i: e for i in range(count) if (e := self.entry(i)) is not None}
        if not entries:
            return {}
        verdicts = check((self.root, e["files"]) for e in entries.values())
        return {i: decode(e["result"]) for (i, e), ok in zip(entries.items(), verdicts) if ok}

    def record(self, index: int, result: dict) -> None:
        """Note unit `index` as finished (after its files are written). Its result's `files`
        ({path: sha256}, a path absolute or relative to the root) are listed relative to the root."""
        root = f"{str(self.root).rstrip('/')}/"
        files = {(p[len(root) :] if p.startswith(root) else p): d for p, d in result.get("files", {}).items()}
        result = {**result, "files": files}
        entry = {"files": files, "result": encode(result)}
        path = self.path(index)
        if storage.is_url(path):
            storage.write_bytes(path, json.dumps(entry, sort_keys=True).encode())
        else:
            write_json(path, entry)


Journals = Callable[[str], "Journal | None"]
"""A stage's journal of each named pass or step (`StageDir.journal`)."""


def no_journal(name: str) -> None:
    """The `Journals` of a stage that is not resumed."""
    return None


def encode(result: dict) -> dict:
    out = dict(result)
    if isinstance(out.get("read"), ReadStats):
        out["read"] = asdict(out["read"])
    return out


def decode(entry: dict) -> dict:
    out = dict(entry)
    if "read" in out:
        out["read"] = ReadStats(**out["read"])
    if "dropped" in out:
        out["dropped"] = Counter(out["dropped"])
    return out


def partial_dir(out: Path) -> Path:
    return out.parent / f".{out.name}.partial"


def open_partial(out: Path, run: dict, overwrite: bool, what: str) -> Path:
    """The partial directory of output `out` for the run `run` (a `header`): resumed when it holds
    the same run, made fresh when there is none; another run's is refused, or removed with
    `overwrite`."""
    partial = partial_dir(out)
    head = partial / RESUME / "header.json"
    if partial.exists():
        try:
            old = json.loads(head.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            old = None
        if old == run:
            # what a killed writer left half-written beside its file (written beside, then renamed)
            for stray in partial.rglob(".*.tmp"):
                stray.unlink()
            return partial
        if old is not None and not overwrite:
            raise DataError(
                f"{what}: {partial} holds a partial run with other settings ({difference(old, run)}); "
                "rerun with the same inputs and settings to resume it, or pass --overwrite to start over"
            )
        shutil.rmtree(partial)
    (partial / RESUME).mkdir(parents=True)
    write_json(head, run)
    return partial


def open_remote(url: str, run: dict, overwrite: bool, what: str) -> bool:
    """Whether output URL `url` holds an unfinished run `run` to resume (True), or nothing of one
    (False: the caller starts it afresh). Another unfinished run's is refused in one line unless
    `overwrite` (then the caller removes it)."""
    data = read_if_there(storage.join(url, RESUME, "header.json"))
    try:
        old = None if data is None else json.loads(data)
    except json.JSONDecodeError:
        old = None
    if old is None:
        return False
    if storage.is_published(url):  # a finished output: its _resume/ is a leftover, not a partial run
        return False
    if old == run:
        return True
    if not overwrite:
        raise DataError(
            f"{what}: {storage.redact(url)} holds a partial run with other settings "
            f"({difference(old, run)}); rerun with the same inputs and settings to resume it, "
            "or pass --overwrite to start over"
        )
    return False


def start_remote(url: str, run: dict) -> None:
    """Record run `run` as the one the unfinished output URL `url` is being built by."""
    storage.write_bytes(
        str(storage.join(url, RESUME, "header.json")), json.dumps(run, sort_keys=True).encode()
    )


def difference(old: dict, new: dict, prefix: str = "") -> str:
    """The first setting that differs between two headers, as 'key: old -> new'."""
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            return difference(a, b, f"{prefix}{key}.")
        return f"{prefix}{key}: {json.dumps(a)} -> {json.dumps(b)}"
    return "none"
