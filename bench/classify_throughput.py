"""`data classify` throughput (MB/s of input text) on the stdlib corpus, one process and all cores.

The classifier is trained first (its time is reported too, not counted in
MB/s) on the stdlib's docstrings against the same words shuffled, with the
default ClassifierTrainConfig; then `run_classify` (reading, scoring, writing
the kept records with their scores, stats and the PNG: the real stage) runs
over `--scale` copies of the ~12 MB stdlib train split (197 MB by default)
with --top-fraction 0.5 (two passes: the scores, then the kept documents;
the second reuses the first's scores) and with a threshold (one pass).

MB/s is wall time around the whole call (model check, pool start, both passes).
`machine.free_cores_*` says how many cores the machine actually gave before and
after (a busy loop in `cores` processes against one; on a shared machine it is
less than `cores`, and the 1 vs 2 worker comparison means little).

    .venv/bin/python bench/classify_throughput.py [--scale 16] [--out bench/results/classify_throughput.json]
"""

from __future__ import annotations

import argparse
import ast
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

from shipyard.data.classifier import run_classifier_train, run_classify
from shipyard.data.configs import ClassifierTrainConfig, ClassifyConfig, ReadConfig
from shipyard.data.stage import default_workers
from shipyard.data.stdlib import stdlib_files, write_stdlib_documents


def _training_sets(tmp: Path, n_files: int) -> tuple[Path, Path]:
    """Docstrings of the first n_files stdlib files (>= 20 words) and the same words shuffled."""
    rng = random.Random(0)
    pos, neg = open(tmp / "pos.jsonl", "w"), open(tmp / "neg.jsonl", "w")  # noqa: SIM115
    with pos, neg:
        for rel, path in stdlib_files()[:n_files]:
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError):
                continue
            for node in ast.walk(tree):
                if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                doc = ast.get_docstring(node)
                if doc and len(doc.split()) >= 20:
                    words = doc.split()
                    rng.shuffle(words)
                    rid = f"{rel}:{getattr(node, 'lineno', 0)}"
                    pos.write(json.dumps({"id": rid, "text": doc}) + "\n")
                    neg.write(json.dumps({"id": rid + "#shuffled", "text": " ".join(words)}) + "\n")
    return tmp / "pos.jsonl", tmp / "neg.jsonl"


def _spin(n: int) -> float:
    start = time.perf_counter()
    x = 0
    for i in range(n):
        x += i
    return time.perf_counter() - start


def free_cores(workers: int, n: int = 10_000_000) -> float:
    """About how many cores this machine gives us now: a pure-Python loop's time in one process
    over its time in `workers` processes at once, times `workers` (= workers on an idle machine)."""
    import multiprocessing

    one = _spin(n)
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        many = max(pool.map(_spin, [n] * workers))
    return round(workers * one / many, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=300, help="stdlib files whose docstrings train the model")
    ap.add_argument("--scale", type=int, default=16, help="copies of the stdlib train split to classify")
    ap.add_argument("--out", type=Path, default=Path("bench/results/classify_throughput.json"))
    args = ap.parse_args()
    workers = default_workers()
    read = ReadConfig()
    results: dict = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": workers},
        "python": sys.version.split()[0],
        "scale": args.scale,
        "runs": {},
    }
    results["machine"]["free_cores_before"] = free_cores(workers)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        pos, neg = _training_sets(tmp, args.files)
        start = time.perf_counter()
        report = run_classifier_train([pos], [neg], tmp / "model", ClassifierTrainConfig(), read)
        results["train"] = {
            "seconds": round(time.perf_counter() - start, 2),
            "held_out": report["held_out"],
            "counts": report["counts"],
        }
        print(f"trained in {results['train']['seconds']} s: held-out {report['held_out']}", flush=True)
        write_stdlib_documents(tmp / "stdlib")
        # --scale copies of the train split (ids made unique), so the pool's start is a small part
        lines = (tmp / "stdlib" / "train.jsonl").read_text().splitlines()
        with open(tmp / "corpus.jsonl", "w") as f:
            for c in range(args.scale):
                for line in lines:
                    rec = json.loads(line)
                    f.write(json.dumps({**rec, "id": f"{c}/{rec['id']}"}) + "\n")
        corpus = [str(tmp / "corpus.jsonl")]
        rules = {"top_fraction_0.5": ClassifyConfig(top_fraction=0.5), "threshold_0.5": ClassifyConfig()}
        for name, cfg in rules.items():
            for w in sorted({1, workers}):
                start = time.perf_counter()
                st = run_classify(corpus, tmp / f"{name}-{w}", tmp / "model", cfg, read, w)
                wall = time.perf_counter() - start  # with the model check and the pool's start
                r = {
                    "workers": w,
                    "mb_in": round(st["bytes_in"] / 1e6, 2),
                    "documents_in": st["documents_in"],
                    "documents_out": st["documents_out"],
                    "seconds": round(wall, 3),
                    "mb_per_s": round(st["bytes_in"] / 1e6 / wall, 2),
                }
                results["runs"][f"{name}/workers={w}"] = r
                print(
                    f"{name:18s} workers={w}: {r['mb_per_s']:6.2f} MB/s ({r['mb_in']} MB, {r['seconds']} s)"
                )
    results["machine"]["free_cores_after"] = free_cores(workers)
    print(f"free cores (a busy loop in {workers} processes vs one): {results['machine']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
