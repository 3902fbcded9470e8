"""`shipyard browse`'s build time and the index's load time on the quickstart's output.

Build: `shipyard browse ROOT --static OUT` as a user runs it (a subprocess: the interpreter, the
scan, re-hashing every step's artifacts, every page written), wall seconds. Index: a started
`shipyard browse ROOT` server, the index opened in headless Chromium (Selenium), the navigation's
load event end from the browser's Navigation Timing, milliseconds. Median and range of `--repeat`
rounds. Targets (issue): build <= 10 s on 2 cores, index < 1 s.

    .venv/bin/python bench/browse_build.py --root runs/quickstart [--repeat 3] [--out bench/results/browse_build.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from browse_fixtures import browse_server, chromium  # noqa: E402
from report import emit, median_range  # noqa: E402


def build_seconds(root: Path, tmp: Path, k: int) -> float:
    out = tmp / f"site-{k}"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "shipyard.cli", "browse", str(root), "--static", str(out)], check=True,
                   capture_output=True, env={**os.environ, "SHIPYARD_NO_REEXEC": "1"})  # fmt: skip
    return time.perf_counter() - t0


def index_ms(browser, base: str) -> float:
    browser.get(base + "?round=" + str(time.time()))
    timing = browser.execute_script("return performance.getEntriesByType('navigation')[0].toJSON()")
    return float(timing["loadEventEnd"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", required=True, type=Path, help="a pipeline root, e.g. runs/quickstart")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="shipyard-browse-bench-") as name:
        builds = [build_seconds(args.root, Path(name), k) for k in range(args.repeat)]
        pages = len(list((Path(name) / "site-0").rglob("*.html")))
    with browse_server(args.root) as base, chromium() as browser:
        index_ms(browser, base)  # the first visit opens the browser's caches
        loads = [index_ms(browser, base) for _ in range(args.repeat)]

    def summary(values):
        return {
            "median": round(statistics.median(values), 3),
            "range": [round(min(values), 3), round(max(values), 3)],
        }

    result = {
        "build_seconds": median_range(builds, 3),
        "index_load_ms": median_range(loads, 3),
        "pages": pages,
        "steps": sum(1 for p in args.root.iterdir() if (p / "provenance.json").is_file()),
        "cpus": os.cpu_count(),
        "rounds": {"build_seconds": builds, "index_load_ms": loads},
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
