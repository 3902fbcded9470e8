"""`shipyard serve` at its defaults for a 135M-class model: seconds from the command to the first
answered request, and resident memory (then, once the other programs have compiled on the server's
compile thread, and the peak), against the KV-cache size the start-up log states.

The model has SmolLM2-135M's shapes (hidden 576, 30 layers, 9 heads, 3 KV heads, MLP 1536, 49,152
ids, 8,192 positions, tied embeddings) and random weights; the tokenizer is
bench/serve_throughput.py's 8,192-token BPE (the request sends token ids, so the larger vocabulary
only widens the head). Served with no flags but the port, as a new user starts it, so the KV cache
covers the model's whole context, and the server compiles its first programs (`Engine.first_programs`)
before it listens and the rest on a thread while it serves (the compile cache is turned off: a
first start).

    .venv/bin/python bench/serve_startup.py [--max-len L] [--out bench/results/serve_startup.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import serve_throughput as bench  # noqa: E402 (the tokenizer and the port helper)

SHAPE = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
    max_seq_len=8192,
)  # fmt: skip


def write_run(run_dir: Path) -> int:
    """A run directory holding random weights of SHAPE; the parameter count."""
    import jax

    from shipyard.config import load_config, to_yaml
    from shipyard.model.params import init_params
    from shipyard.model.transformer import param_specs
    from shipyard.run.checkpoint import Checkpointer
    from shipyard.train.optim import build_optimizer
    from shipyard.train.step import init_state

    cfg = load_config("small", [f"model.{k}={v}" for k, v in SHAPE.items()] + ["model.tie_embeddings=true"])
    specs = param_specs(cfg.model)
    params = init_params(specs, jax.random.key(0))
    state = init_state(cfg, params, build_optimizer(cfg.train, specs))
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    ckpt = Checkpointer(run_dir, cfg.train.checkpoint, cfg.train.steps)
    ckpt.save(1, state, wait=True)
    ckpt.close()
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """`field` of /proc/PID/status in MB (MiB): VmRSS now, VmHWM the peak so far."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_settled(pid: int, t0: float, quiet_s: float = 10.0, limit_s: float = 1800) -> float | None:
    """Seconds from t0 until the idle server stops using the CPU (under 0.1 CPU-s in `quiet_s`): its
    compile thread (`Engine.compile_rest`) has compiled the other programs. None past `limit_s`."""
    last = cpu_s(pid)
    while time.monotonic() - t0 < limit_s:
        time.sleep(quiet_s)
        now = cpu_s(pid)
        if now - last < 0.1:
            return time.monotonic() - t0 - quiet_s
        last = now
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-len", type=int, default=None, help="pass --max-len (default: serve's default)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/serve_startup.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="shipyard-servestartup-") as tmp:
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        bench.write_tokenizer(run_dir / "tokenizer", Path(tmp))
        n_params = write_run(run_dir)
        port = bench._free_port()
        cmd = [sys.executable, "-m", "shipyard.cli", "serve", str(run_dir), "--port", str(port)]
        cmd += ["--compile-cache", "off"] + (["--max-len", str(args.max_len)] if args.max_len else [])
        log = Path(tmp) / "server.log"
        t0 = time.monotonic()
        with log.open("w") as f:
            proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
            )
        url, first, peak = f"http://127.0.0.1:{port}", None, 0.0
        try:
            while first is None and time.monotonic() - t0 < 1800:
                if proc.poll() is not None:
                    raise SystemExit(f"serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
                peak = max(peak, rss_mb(proc.pid))
                try:
                    r = httpx.post(url + "/v1/completions", json={"model": "run", "prompt": list(range(100, 140)), "max_tokens": 4, "temperature": 0}, timeout=5)  # fmt: skip
                    if r.status_code in (200, 400):
                        first = time.monotonic() - t0
                        status = r.status_code
                except httpx.HTTPError:
                    time.sleep(1.0)
            ready_rss = rss_mb(proc.pid)
            settled = wait_settled(proc.pid, t0) if first is not None else None
            settled_rss, hwm = rss_mb(proc.pid), rss_mb(proc.pid, "VmHWM")
        finally:
            bench.stop_server(proc)
        text = log.read_text()
    kv = re.search(r"KV cache .* = ([0-9.]+) MiB", text)
    result = {
        "model": {**SHAPE, "parameters": n_params},
        "max_len_flag": args.max_len,
        "first_answer_s": round(first, 1) if first is not None else None,
        "first_answer_status": status if first is not None else None,
        "rss_after_first_mb": round(ready_rss, 1),
        "rss_peak_sampled_mb": round(peak, 1),
        "programs_compiled_s": round(settled, 1) if settled is not None else None,
        "rss_programs_compiled_mb": round(settled_rss, 1),
        "rss_peak_mb": round(hwm, 1),
        "kv_cache_stated_mib": float(kv[1]) if kv else None,
        "weights_fp32_mib": round(n_params * 4 / 2**20, 1),
        "log_tail": text.splitlines()[-12:],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
