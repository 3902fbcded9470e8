"""Writing outputs so that nobody sees half of one: atomic files and directories, JSON, progress bars.

Every command that writes (data stages, export, import, eval, reports, run
directories) goes through here, so "already exists" and "half written" mean
the same thing everywhere. The caller names itself (`what`) and says how to
get past an existing output (`hint`), so the message fits the command that
raised it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from tqdm import tqdm

from shipyard.errors import ShipyardError


class OutputExists(ShipyardError):
    """The output path of a command exists and the command does not overwrite it."""

    exit_code = 1


def refuse_existing(
    out: Path,
    what: str,
    *,
    hint: str = "choose another output directory",
    error: type[ShipyardError] = OutputExists,
) -> None:
    """The "already exists" error of `atomic_dir`, for callers that want it before slow work."""
    if Path(out).exists():
        raise error(f"{what}: {out} already exists; {hint}")


@contextlib.contextmanager
def atomic_dir(
    out: Path,
    what: str,
    *,
    overwrite: bool = False,
    hint: str = "choose another output directory",
    error: type[ShipyardError] = OutputExists,
) -> Iterator[Path]:
    """Yield a temporary directory next to `out` that becomes `out` when the block completes;
    on any error it is removed and `out` is left as it was. An existing `out` is refused (with
    `what`, the command, and `hint`, how to proceed) unless `overwrite`."""
    out = Path(out)
    if not overwrite:
        refuse_existing(out, what, hint=hint, error=error)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_atomic(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so a reader never sees half a file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_json(path: Path, obj) -> None:
    """`obj` as indented JSON, atomically."""
    write_atomic(Path(path), json.dumps(obj, indent=2) + "\n")


def progress(
    iterable: Iterable | None = None, *, desc: str, unit: str, total: int | None = None, **kw
) -> tqdm:
    """A progress bar with rate and ETA on stderr, shown only when stderr is a terminal (logs and
    test output stay clean). Extra keywords go to tqdm (e.g. `initial`, `unit_scale`)."""
    kw.setdefault("disable", None if sys.stderr.isatty() else True)
    return tqdm(iterable, desc=desc, unit=unit, total=total, dynamic_ncols=True, mininterval=0.5, **kw)


def human_bytes(n: float) -> str:
    """Bytes in the largest binary unit they fill, two decimals: '1.50 GiB', '640 B'."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"
