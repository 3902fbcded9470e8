"""Loader throughput from token shards in a bucket (moto_server on 127.0.0.1), side by side with the
same loader on the local copy, against what the `small` preset's training step consumes.

The shards are the standard library's source as byte tokens (bytecorpus, ~12 MB, written as
shipyard's token shards with ShardWriter and a manifest), uploaded with `storage.publish_dir` to a
bucket of a moto_server this script starts (and stops). Each variant builds the training loader
(`build_loader`, data.verify off: hashing is a one-off, reported separately) with the small preset's
batch (8 x 256) and times `rows(step)` over `--steps` steps, the rows in the training order (Grain's
global shuffle: every row a random place in the set):

- `bucket`: the loader as training uses it on a bucket (a step's rows from ROW_THREADS threads)
- `bucket_serial`: the same, one row at a time (what the threads buy)
- `local`: the memory-mapped local copy
- `scan_cache` / `scan_nocache`: rows read in order (held-out evaluation), with the block cache
  (1 MiB blocks) and without it (one ranged GET per row)

Tokens/s counts B x L tokens per step, as training throughput does. The `small` preset's consumption
is bench/results/train_throughput.json's `shipyard_tokens_per_s` (that bench trains the small
preset's shape) unless `--measure-small N` runs `shipyard train small` on the local shards for N
steps here. The acceptance is bucket >= 20x small's consumption. moto_server is a Python server on
the same 2 cores as the loader (`bucket_server_cpu_fraction` / `bucket_client_cpu_fraction`: CPU
seconds per wall second of each end during the `bucket` variant), so these numbers are a floor for
a real store's.

    .venv/bin/python bench/bucket_loader.py [--steps 100] [--measure-small 0] [--out bench/results/bucket_loader.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from shipyard import storage
from shipyard.data import loader as loader_mod
from shipyard.data.bytecorpus import write_byte_tokens
from shipyard.data.loader import SequenceSource, build_loader
from shipyard.data.remote_array import BlockCache
from shipyard.data.shards import ShardWriter, open_shards

ROOT = Path(__file__).resolve().parents[1]
BATCH, SEQ, VOCAB = 8, 256, 8192  # the small preset's batch, sequence length and vocabulary


def start_moto() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen(
        [str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.1)
    endpoint = f"http://127.0.0.1:{port}"
    # a local test server's made-up credentials, as a user's environment would carry real ones
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench-secret",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint,
    )
    return proc, endpoint


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def write_shards(out: Path, shard_tokens: int) -> dict:
    """The stdlib as byte tokens, cut into shards with a manifest (as `data tokenize` writes them)."""
    tmp = out.parent / "tokens.npy"
    write_byte_tokens(tmp, split="train")
    tokens = np.load(tmp)
    out.mkdir()
    w = ShardWriter(out, np.dtype(np.uint16), shard_tokens)
    for i in range(0, tokens.size, 1 << 16):
        w.write(tokens[i : i + (1 << 16)], 1)
    manifest = {
        "vocab_size": 257,
        "dtype": "uint16",
        "eos_id": 256,
        "shards": w.close(),
        "tokens": int(tokens.size),
    }
    manifest["documents"] = len(manifest["shards"])
    (out / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def time_rows(load, steps: int, rounds: int = 3) -> dict:
    """Median tokens/s of `load(step)` over `steps` steps (rounds on disjoint steps, first warm-up)."""
    load(10_000)  # connections opened, pools started
    per_round = []
    for r in range(rounds):
        t = time.perf_counter()
        for s in range(r * steps, (r + 1) * steps):
            load(s)
        per_round.append(steps * BATCH * SEQ / (time.perf_counter() - t))
    return {"tokens_per_s": statistics.median(per_round), "rounds_tokens_per_s": per_round}


def scan(src: SequenceSource, rows: int) -> dict:
    """Rows 0..rows-1 in order (held-out evaluation's pattern): tokens/s and requests per row."""
    before = sum(a.requests for a in src.arrays)
    t = time.perf_counter()
    for i in range(rows):
        src[i]
    took = time.perf_counter() - t
    requests = sum(a.requests for a in src.arrays) - before
    return {"tokens_per_s": rows * SEQ / took, "requests_per_row": requests / rows}


def small_consumption(measure_steps: int, shards: Path, tmp: Path) -> dict:
    if measure_steps <= 0:
        got = json.loads((ROOT / "bench/results/train_throughput.json").read_text())
        return {
            "tokens_per_s": got["shipyard_tokens_per_s"],
            "source": "bench/results/train_throughput.json shipyard_tokens_per_s (the small preset's shape)",
        }
    argv = [sys.executable, "-m", "shipyard.cli.main", "train", "small", f"data.train_tokens={shards}"]
    argv += [f"train.steps={measure_steps}", "train.logging.log_every=1", "train.logging.progress=false"]
    argv += [
        "train.logging.tensorboard=false",
        "train.checkpoint.every=null",
        "--run-dir",
        str(tmp / "small"),
    ]
    subprocess.run(argv, check=True, cwd=ROOT, capture_output=True)
    rows = [json.loads(x) for x in (tmp / "small" / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r][2:]  # past compilation
    return {
        "tokens_per_s": statistics.median(rates),
        "source": f"measured: shipyard train small, {measure_steps} steps",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100, help="steps per timed round")
    ap.add_argument("--shard-tokens", type=int, default=4_000_000)
    ap.add_argument(
        "--measure-small", type=int, default=0, help="steps of `train small` to measure (0: from JSON)"
    )
    ap.add_argument("--out", type=Path, default=Path("bench/results/bucket_loader.json"))
    args = ap.parse_args()
    proc, endpoint = start_moto()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            manifest = write_shards(tmp / "shards", args.shard_tokens)
            import boto3

            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
            url = "s3://bench/shards"
            t = time.perf_counter()
            storage.publish_dir(tmp / "shards", url)
            upload_s = time.perf_counter() - t
            t = time.perf_counter()
            open_shards(url, verify=True)
            verify_s = time.perf_counter() - t
            result = run_variants(url, tmp / "shards", args.steps, proc.pid)
            small = small_consumption(args.measure_small, tmp / "shards", tmp)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    shard_bytes = manifest["tokens"] * 2
    result.update(
        small_consumption_tokens_per_s=small["tokens_per_s"],
        small_consumption_source=small["source"],
        ratio_bucket_over_small=result["bucket_tokens_per_s"] / small["tokens_per_s"],
        target_ratio=20.0,
        shards=len(manifest["shards"]),
        shard_tokens=manifest["tokens"],
        upload_mb_per_s=shard_bytes / upload_s / 1e6,
        verify_mb_per_s=shard_bytes / verify_s / 1e6,
        batch=BATCH,
        seq_len=SEQ,
        row_threads=loader_mod.ROW_THREADS,
        cpu=platform.machine(),
        cores=os.cpu_count(),
    )
    out = {"benchmark": "bucket_loader", **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if not isinstance(v, list | dict)}, indent=2))


def run_variants(url: str, local: Path, steps: int, server_pid: int) -> dict:
    out = {}
    for name, path, threads in (
        ("bucket", url, None),
        ("bucket_serial", url, 1),
        ("local", str(local), None),
    ):
        loader = build_loader(
            [path], [1.0], seed=0, batch_size=BATCH, seq_len=SEQ, vocab_size=VOCAB, verify=False
        )
        if threads is not None:
            loader.threads = threads
        server, client, wall = cpu_seconds(server_pid), time.process_time(), time.perf_counter()
        timed = time_rows(loader.rows, steps)
        out[f"{name}_tokens_per_s"] = timed["tokens_per_s"]
        out[f"{name}_rounds_tokens_per_s"] = timed["rounds_tokens_per_s"]
        if name == "bucket":  # where the time goes: both ends share the machine's cores
            wall = time.perf_counter() - wall
            out["bucket_server_cpu_fraction"] = (cpu_seconds(server_pid) - server) / wall
            out["bucket_client_cpu_fraction"] = (time.process_time() - client) / wall
    src = SequenceSource(url, SEQ, VOCAB, verify=False)
    got = scan(src, 20_000)  # 10 MB: ten blocks
    out["scan_cache_tokens_per_s"], out["scan_cache_requests_per_row"] = (
        got["tokens_per_s"],
        got["requests_per_row"],
    )
    nocache = SequenceSource(url, SEQ, VOCAB, verify=False)
    for a in nocache.arrays:
        a.cache = BlockCache(max_blocks=0)
    got = scan(nocache, 2000)  # one GET per row: slow, so fewer rows
    out["scan_nocache_tokens_per_s"] = got["tokens_per_s"]
    out["scan_nocache_requests_per_row"] = got["requests_per_row"]
    random_src = SequenceSource(url, SEQ, VOCAB, verify=False)  # byte ranges: bytes fetched per token
    rng = np.random.default_rng(0)
    for i in rng.integers(0, len(random_src), 500):
        random_src[int(i)]
    fetched = sum(a.fetched_bytes for a in random_src.arrays)
    out["random_rows_bytes_fetched_per_token"] = fetched / (500 * (SEQ + 1))
    return out


if __name__ == "__main__":
    main()
