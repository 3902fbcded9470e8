"""Data stages on a Ray cluster of 1 and 2 worker nodes, side by side with the local process pool.

The same inputs (the stdlib corpus, `--copies` times over: about 13 MB and 12 work units a copy)
go through `shipyard data filter`, `dedup` and `tokenize`, each run as a user runs it (the CLI, a
fresh process) `--repeats` times; documents/s is the median with its [min, max]. The cluster is
real: `ray start --head` without CPUs and one-CPU worker nodes, all on this machine. Per-node memory
is the peak of the summed resident set of the node's worker processes, sampled every 20 ms while
the stage runs. documents/s counts the whole command (start-up, connecting to the cluster, the
stage); `stage_s` is the stage's own time from its stats.json.

Scaling efficiency is (docs/s with 2 nodes) / (2 x docs/s with 1 node). On a 2-core machine the two
nodes share the cores with the driver, the head's services and the raylets, so it cannot reach 1.

    .venv/bin/python bench/data_cluster.py [--copies 6] [--repeats 3] [--out bench/results/data_cluster.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BIN = Path(sys.executable).parent
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled"}
STAGES = ("filter", "dedup", "tokenize")


def _pids_of(parent: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == parent:
                out.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return out


def _rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class NodeMemory:
    """Peak summed RSS of each raylet's worker processes while a stage runs."""

    def __init__(self, raylets: list[int]):
        self.raylets, self.peak = raylets, dict.fromkeys(raylets, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            for r in self.raylets:
                self.peak[r] = max(self.peak[r], sum(_rss_kib(p) for p in _pids_of(r)))
            time.sleep(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _raylets() -> set[int]:
    out = subprocess.run(["pgrep", "-x", "raylet"], capture_output=True, text=True).stdout.split()
    return {int(p) for p in out}


def start_cluster(nodes: int, port: int) -> list[int]:
    head = [BIN / "ray", "start", "--head", f"--port={port}", "--num-cpus=0", "--include-dashboard=false"]
    subprocess.run([*head, "--disable-usage-stats"], check=True, capture_output=True, env=ENV)
    raylets = []
    for _ in range(nodes):
        before = _raylets()
        node = [BIN / "ray", "start", f"--address=127.0.0.1:{port}", "--num-cpus=1", "--disable-usage-stats"]
        subprocess.run(node, check=True, capture_output=True, env=ENV)
        raylets += sorted(_raylets() - before)
    return raylets


def stop_cluster() -> None:
    subprocess.run([BIN / "ray", "stop", "--force"], capture_output=True, env=ENV)


def run_stage(stage: str, inputs: list[str], out: Path, where: list[str], tok: Path) -> dict:
    extra = ["--tokenizer", str(tok)] if stage == "tokenize" else []
    cmd = [BIN / "shipyard", "data", stage, *inputs, "--out", str(out), "--overwrite", *where, *extra]
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV)
    seconds = time.perf_counter() - t
    if r.returncode:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed:\n{r.stderr}")
    stats = json.loads((out / "stats.json").read_text())
    return {"seconds": seconds, "stage_seconds": stats["seconds"], "documents": stats["documents_in"]}


def summary(values: list[float]) -> dict:
    return {
        "median": round(statistics.median(values), 1),
        "min": round(min(values), 1),
        "max": round(max(values), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--copies", type=int, default=6, help="stdlib corpus copies (about 13 MB each)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench/results/data_cluster.json"))
    args = ap.parse_args()
    from shipyard.data.stdlib import write_stdlib_documents
    from shipyard.parallel.launch import free_port

    with tempfile.TemporaryDirectory(prefix="bench-data-cluster-") as d:
        tmp = Path(d)
        write_stdlib_documents(tmp / "stdlib")
        text = (tmp / "stdlib" / "train.jsonl").read_bytes()
        inputs = []
        for k in range(args.copies):
            (tmp / f"in{k}.jsonl").write_bytes(text)
            inputs.append(str(tmp / f"in{k}.jsonl"))
        tok = tmp / "tok"
        train = [
            BIN / "shipyard",
            "data",
            "tokenizer-train",
            inputs[0],
            "--out",
            str(tok),
            "--set",
            "vocab_size=1024",
        ]
        subprocess.run(train, check=True, capture_output=True, env=ENV)
        setups = {"local 1 process": ["--workers", "1"], "local 2 processes": ["--workers", "2"]}
        results: dict = {}
        for name, where in setups.items():
            for stage in STAGES:
                runs = [run_stage(stage, inputs, tmp / stage, where, tok) for _ in range(args.repeats)]
                rates = [r["documents"] / r["seconds"] for r in runs]
                results.setdefault(name, {})[stage] = {
                    "docs_per_s": summary(rates),
                    "wall_s": summary([r["seconds"] for r in runs]),
                    "stage_s": summary([r["stage_seconds"] for r in runs]),
                    "documents": runs[0]["documents"],
                }
                print(name, stage, results[name][stage], flush=True)
        for nodes in (1, 2):
            name = f"ray {nodes} worker node{'s' if nodes > 1 else ''}"
            port = free_port()
            raylets = start_cluster(nodes, port)
            try:
                for stage in STAGES:
                    rates, memory, walls, inner = [], [], [], []
                    for _ in range(args.repeats):
                        with NodeMemory(raylets) as mem:
                            r = run_stage(stage, inputs, tmp / stage, ["--ray", f"127.0.0.1:{port}"], tok)
                        rates.append(r["documents"] / r["seconds"])
                        walls.append(r["seconds"])
                        inner.append(r["stage_seconds"])
                        memory.append(max(mem.peak.values()) / 1024)
                    results.setdefault(name, {})[stage] = {
                        "docs_per_s": summary(rates),
                        "wall_s": summary(walls),
                        "stage_s": summary(inner),
                        "peak_node_worker_rss_mb": summary(memory),
                        "documents": r["documents"],
                    }
                    print(name, stage, results[name][stage], flush=True)
            finally:
                stop_cluster()
        efficiency = {
            stage: round(
                results["ray 2 worker nodes"][stage]["docs_per_s"]["median"]
                / (2 * results["ray 1 worker node"][stage]["docs_per_s"]["median"]),
                2,
            )
            for stage in STAGES
        }
    report = {
        "benchmark": "data_cluster",
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "corpus": {"copies_of_stdlib": args.copies, "bytes": len(text) * args.copies},
        "repeats": args.repeats,
        "results": results,
        "scaling_efficiency_2_nodes": efficiency,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["scaling_efficiency_2_nodes"]))


if __name__ == "__main__":
    main()
