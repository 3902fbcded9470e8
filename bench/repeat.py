"""Run one benchmark several times back to back and record the median and spread of every number.

    .venv/bin/python bench/repeat.py bench/train_throughput.py [--runs 3] [-- ARGS FOR THE BENCH]

A number quoted in the README is the median of at least three runs on an idle machine, with the
spread: one run on a VM that is noisy by 10-30% says little. Each run is the benchmark's own script
in its own process with its own `--out` (a temporary file); this writes
`bench/results/<name>.repeat.json`: every run's whole result, and for every top-level number (tokens/s,
ratios, MFU) its median, min and max over the runs. Nothing here knows what a benchmark measures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LABELS = ("variant", "name", "stage", "mode")
"""Fields that name a row of a result's table (`results: [{variant: ..., tokens_per_s: ...}, ...]`)."""


def numbers(result: dict, prefix: str = "") -> dict[str, float]:
    """The scalar numbers of a result, nested dicts and tables of rows flattened with dots (lists of
    plain numbers are skipped: they are a run's own rounds, already summarised by that run)."""
    found = {}
    for key, value in result.items():
        name = f"{prefix}{key}"
        if isinstance(value, bool):
            continue
        if isinstance(value, int | float):
            found[name] = float(value)
        elif isinstance(value, dict):
            found.update(numbers(value, f"{name}."))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, row in enumerate(value):  # a table of variants: each row named by its label
                label = next((row[k] for k in LABELS if isinstance(row.get(k), str)), str(i))
                found.update(numbers(row, f"{name}.{label}."))
    return found


def summarise(runs: list[dict]) -> dict[str, dict[str, float]]:
    """{number: {median, min, max}} over the runs, for the numbers every run has."""
    per_run = [numbers(r) for r in runs]
    common = [k for k in per_run[0] if all(k in p for p in per_run)]
    return {
        k: {
            "median": statistics.median(p[k] for p in per_run),
            "min": min(p[k] for p in per_run),
            "max": max(p[k] for p in per_run),
        }
        for k in common
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("script", type=Path, help="a bench/*.py that takes --out and writes one JSON object")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, help="default: bench/results/<script name>.repeat.json")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)  # after --: the benchmark's own arguments
    args, extra = ap.parse_args(argv[:cut]), argv[cut + 1 :]
    if args.runs < 1:
        ap.error(f"--runs {args.runs}: expected at least 1")
    if not args.script.is_file():
        ap.error(f"{args.script}: no such benchmark script")
    out = args.out or Path("bench/results") / f"{args.script.stem}.repeat.json"
    runs, started = [], time.strftime("%Y-%m-%dT%H:%M:%S")
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            part = Path(tmp) / f"run{i}.json"
            print(f"[repeat] run {i + 1}/{args.runs}: {args.script} {' '.join(extra)}", flush=True)
            done = subprocess.run([sys.executable, str(args.script), *extra, "--out", str(part)])
            if done.returncode != 0:
                print(
                    f"[repeat] run {i + 1} failed with exit {done.returncode}; nothing written",
                    file=sys.stderr,
                )
                return done.returncode
            runs.append(json.loads(part.read_text()))
    record = {
        "benchmark": args.script.stem,
        "started": started,
        "runs": len(runs),
        "args": extra,
        "summary": summarise(runs),
        "results": runs,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_suffix(".tmp")
    tmp_out.write_text(json.dumps(record, indent=1) + "\n")
    tmp_out.replace(out)
    for key, s in record["summary"].items():
        print(f"{key}: {s['median']:.4g} [{s['min']:.4g}, {s['max']:.4g}]")
    print(f"[repeat] wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
