"""A stage's finished units, remembered so that a rerun after the driver died goes on from them.

A local stage output is built in `.<name>.partial` beside it (a fixed name, so the next run finds
it; `stage.stage_output`). Its `_resume/` holds `header.json` (which run this is: the stage, its
inputs, config and unit plan) and a JSON per finished unit of each pass: the result the driver
folded in, and the sha256 of every file the unit wrote. A rerun with the same header skips each
unit whose files are all there with those digests and runs the rest, so its output is the same
bytes as an uninterrupted run's; `_resume/` is removed before the output is renamed into place.
A partial run with another header is never mixed in: the rerun refuses it in one line, or starts
over with --overwrite.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from shipyard import __version__
from shipyard.data.documents import ReadStats, Unit
from shipyard.errors import DataError
from shipyard.output import write_json

RESUME = "_resume"


def header(stage: str, inputs: list[str], config: dict, units: list[Unit]) -> dict:
    """What makes two runs the same run: a partial output is resumed only under the same header."""
    plan = json.dumps([asdict(u) for u in units], sort_keys=True).encode()
    return {
        "stage": stage,
        "shipyard_version": __version__,
        "inputs": inputs,
        "config": config,
        "units": {"count": len(units), "sha256": hashlib.sha256(plan).hexdigest()},
    }


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class Journal:
    """The finished units of one pass of a partial output at `root`."""

    root: Path
    """The partial output directory (the files units list are relative to it)."""
    name: str
    """The pass ('units', or a stage's own: 'sketch', 'write')."""

    def path(self, index: int) -> Path:
        return self.root / RESUME / f"{self.name}-{index:05d}.json"

    def done(self, index: int) -> dict | None:
        """Unit `index`'s recorded result, when every file it wrote is there with its digest."""
        try:
            entry = json.loads(self.path(index).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        for rel, digest in entry["files"].items():
            target = self.root / rel
            if not target.is_file() or file_sha256(target) != digest:
                return None
        return decode(entry["result"])

    def record(self, index: int, result: dict) -> None:
        """Note unit `index` as finished (after its files are written)."""
        write_json(self.path(index), {"files": result.get("files", {}), "result": encode(result)})


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
