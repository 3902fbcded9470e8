"""The embedded default corpus: the running interpreter's standard library.

No download is possible on a fresh machine, so shipyard's default documents
are the stdlib's .py sources (about 800 files, 12 MB of code and docstrings
on CPython 3.11). The train/validation split is by a hash of each file's path
relative to the stdlib root, so it is the same on every machine with the same
Python version.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from pathlib import Path

from shipyard.data.stage import stage_output

VALIDATION_PERCENT = 2
SPLITS = ("train", "validation")


def stdlib_files() -> list[tuple[str, Path]]:
    """(relative path, absolute path) of every .py under the stdlib, sorted; tests and site-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in ("site-packages", "test", "tests", "__pycache__")
        )
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = Path(dirpath) / name
                out.append((path.relative_to(root).as_posix(), path))
    return out


def split_of(relpath: str) -> str:
    digest = hashlib.sha256(relpath.encode()).digest()
    return "validation" if int.from_bytes(digest[:4], "little") % 100 < VALIDATION_PERCENT else "train"


def write_stdlib_documents(out_dir: Path, overwrite: bool = False) -> dict:
    """Write <out_dir>/{train,validation}.jsonl (fields id, text, source) and stats.json.

    The directory is assembled under a temporary name and renamed into place
    when complete, so an interrupted run never leaves one that looks finished.
    """
    stats = {split: {"documents": 0, "bytes": 0} for split in SPLITS}
    stats["skipped_not_utf8"] = 0
    with stage_output(Path(out_dir), overwrite, "stdlib") as dest:
        tmp = dest.local
        handles = {split: open(tmp / f"{split}.jsonl", "w", encoding="utf-8") for split in SPLITS}  # noqa: SIM115
        try:
            for rel, path in stdlib_files():
                try:
                    text = path.read_text(encoding="utf-8")
                except UnicodeDecodeError:
                    stats["skipped_not_utf8"] += 1
                    continue
                split = split_of(rel)
                handles[split].write(
                    json.dumps({"id": f"stdlib/{rel}", "text": text, "source": str(path)}) + "\n"
                )
                stats[split]["documents"] += 1
                stats[split]["bytes"] += len(text.encode("utf-8"))
        finally:
            for h in handles.values():
                h.close()
        (tmp / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats
