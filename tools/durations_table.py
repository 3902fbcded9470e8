"""The suite's time, as docs/testing.md shows it: the slowest tests and the seconds per module, read
from pytest's `--durations=0` report (setup, call and teardown of a test added up; a module-scoped
fixture's setup counts toward the first test that asked for it, which is where its time went).

    python tools/durations_table.py LOG [--top 30] [--before OLD_LOG] [--write-seconds TIER]

With `--before`, each row shows the time in the older report beside it (a before/after table).
`--write-seconds TIER` ("not slow" or "slow") records the seconds per module of LOG as that tier's in
tests/module_seconds.json, which tells the test workers which modules to start first
(tests/xdist_schedule.py).
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

SECONDS = Path(__file__).resolve().parents[1] / "tests" / "module_seconds.json"
LINE = re.compile(r"^\s*([\d.]+)s\s+(setup|call|teardown)\s+(.+?)\s*$")


def read(log: Path) -> dict[str, float]:
    """Seconds per test id (setup + call + teardown) from a pytest log with a durations report."""
    seconds: dict[str, float] = defaultdict(float)
    for line in log.read_text(errors="replace").splitlines():
        m = LINE.match(line)
        if m:
            seconds[m.group(3)] += float(m.group(1))
    return dict(seconds)


def modules(seconds: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for test, s in seconds.items():
        out[test.split("::")[0]] += s
    return dict(out)


def _fmt(s: float | None) -> str:
    return "" if s is None else f"{s:.1f}"


def table(now: dict[str, float], before: dict[str, float] | None, top: int, what: str) -> str:
    head = f"| {what} | s |" + (" before (s) |" if before is not None else "")
    rule = "|---|---:|" + ("---:|" if before is not None else "")
    rows = [head, rule]
    for name, s in sorted(now.items(), key=lambda kv: -kv[1])[:top]:
        extra = f" {_fmt(before.get(name))} |" if before is not None else ""
        rows.append(f"| `{name}` | {s:.1f} |{extra}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--before", type=Path)
    parser.add_argument("--write-seconds", metavar="TIER", choices=["not slow", "slow"])
    args = parser.parse_args()
    now = read(args.log)
    before = read(args.before) if args.before else None
    print(f"{len(now)} tests, {sum(now.values()) / 60:.1f} min of test time\n")
    print(table(now, before, args.top, "test"))
    print()
    print(table(modules(now), modules(before) if before else None, 200, "module"))
    if args.write_seconds:
        tiers = json.loads(SECONDS.read_text()) if SECONDS.exists() else {}
        tiers[args.write_seconds] = {m: round(s, 1) for m, s in sorted(modules(now).items())}
        SECONDS.write_text(json.dumps(tiers, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
