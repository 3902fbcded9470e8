"""Summarise a SHIPYARD_TEST_CPU_LOG file (tests/cpu_log.py): the tier's CPU seconds, and the
tests and modules that cost most, as markdown tables.

    python tools/cpu_table.py LOG [--top N]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    try:
        rows = [json.loads(line) for line in args.log.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        print(f"cpu_table: cannot read {args.log}: {e}", file=sys.stderr)
        return 2
    for row in rows:
        row["total"] = row["cpu"] + row["children"]
    total = sum(r["total"] for r in rows)
    print(f"{len(rows)} tests, {total:,.0f} CPU s ({total / 60:.1f} min) counted\n")
    print("| test | CPU s | of it children | wall s |\n|---|---:|---:|---:|")
    for r in sorted(rows, key=lambda r: -r["total"])[: args.top]:
        print(f"| `{r['nodeid']}` | {r['total']:.1f} | {r['children']:.1f} | {r['wall']:.1f} |")
    modules: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in rows:
        m = modules[r["nodeid"].split("::")[0]]
        m[0] += r["total"]
        m[1] += r["wall"]
    print("\n| module | CPU s | wall s |\n|---|---:|---:|")
    for name, (cpu, wall) in sorted(modules.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"| `{name}` | {cpu:.1f} | {wall:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
