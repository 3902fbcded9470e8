"""`shipyard browse ROOT --static OUT`: the site's pages written as files that open from `file://`
(relative links, the package's script and style copied beside them, nothing fetched from a network).
Written into a temporary directory next to OUT and renamed into place, so a failed build leaves no
half site; ROOT is only read."""

from __future__ import annotations

import shutil
from pathlib import Path

from shipyard.browse.html import ASSETS
from shipyard.browse.server import read_asset
from shipyard.errors import DataError
from shipyard.output import progress


def check_output(root: Path | None, out: Path) -> None:
    """DataError unless `out` is a new directory outside `root` (None: a bucket root), checked
    before any work."""
    if out.exists():
        raise DataError(f"browse --static: {out} already exists; give a new directory")
    if root is not None and out.resolve().is_relative_to(Path(root).resolve()):
        raise DataError(f"browse --static: {out} is inside ROOT {root}; the browser writes nothing there")


def write_static(site, out: str | Path) -> list[str]:
    """Every page of `site.static_paths()` under `out` (which must not exist); the paths written."""
    out = Path(out)
    check_output(site.root, out)
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "assets").mkdir(parents=True)
    for name in ASSETS:
        (tmp / "assets" / name).write_bytes(read_asset(name))
    paths = site.static_paths()
    for path in progress(paths, desc="browse --static", unit="page"):
        html = site.render(path)
        if html is None:  # every listed path renders; a None is a bug worth a loud stop
            raise RuntimeError(f"browse: {path} is listed but renders nothing")
        target = tmp / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(html, encoding="utf-8")
    tmp.rename(out)
    return paths
