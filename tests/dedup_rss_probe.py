"""Run by test_dedup.py in a fresh process: dedup of N random documents with two worker processes,
printing this (driver) process's peak RSS before and after as JSON."""

import json
import random
import sys
import tempfile
from pathlib import Path

from shipyard.data.configs import DedupConfig, ReadConfig
from shipyard.data.dedup import run_dedup


def peak_rss_kib() -> int:
    """This process's peak resident set (VmHWM: of this program only; ru_maxrss would carry the
    peak of the process that forked it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def main() -> None:
    n = int(sys.argv[1])
    rng = random.Random(0)
    words = [f"w{i}" for i in range(5000)]
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "in.jsonl"
        with open(src, "w") as f:
            for i in range(n):
                f.write(json.dumps({"id": f"d{i}", "text": " ".join(rng.choices(words, k=30))}) + "\n")
        before = peak_rss_kib()
        stats = run_dedup([str(src)], Path(d) / "out", DedupConfig(), ReadConfig(), workers=2)
        peak = peak_rss_kib()
    print(json.dumps({"documents": stats["documents_in"], "before_kib": before, "peak_kib": peak}))


if __name__ == "__main__":
    main()
