"""Mixture-of-experts training throughput and MFU on CPU, next to the dense model with the same active size.

Runs, each in its own child process with the same environment:
- `moe-tiny` (the preset: 1 dense + 2 MoE layers, 8 experts top-2 + 1 shared);
- a wider MoE (`moe-small`: 4 MoE layers of 8 experts x 512, top-2, hidden 256,
  vocab 8192, 8 x 256 tokens) with the dropless `blocked` expert matmul and with
  `jax.lax.ragged_dot` (JAX's own grouped matmul, the peer here);
- the dense model whose MLP is exactly two of those experts wide (the same
  active parameters and FLOPs per token): what the MoE costs over dense.

MFU counts active-parameter FLOPs (train.metrics.flops_per_token) against the
fp32 matmul peak of this machine, measured once in its own child process.

    .venv/bin/python bench/moe_throughput.py [--steps 6] [--rounds 3] [--out bench/results/moe_throughput.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

MOE_SMALL = [
    "model.vocab_size=8192",
    "model.hidden_size=256",
    "model.num_layers=4",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.intermediate_size=1024",
    "model.max_seq_len=256",
    "model.scan_unroll=4",
    "model.moe.expert_intermediate_size=512",
    "model.moe.num_shared_experts=0",
    "model.moe.first_dense_layers=0",
    "data.seq_len=256",
]
VARIANTS = {
    "moe-tiny": ["train.global_batch_size=8"],
    "moe-small-blocked": [*MOE_SMALL, "model.moe.grouped_matmul=blocked"],
    "moe-small-ragged_dot": [*MOE_SMALL, "model.moe.grouped_matmul=ragged"],
    "dense-same-active": [*MOE_SMALL, "model.moe=null"],
}


def run_variant(name: str, steps: int, rounds: int) -> dict:
    import jax
    import jax.numpy as jnp

    from shipyard.config import load_config
    from shipyard.model.params import init_params
    from shipyard.model.transformer import num_active_params, num_params, param_specs
    from shipyard.train.metrics import flops_per_token
    from shipyard.train.optim import build_optimizer
    from shipyard.train.step import init_state, make_train_step

    cfg = load_config("moe-tiny", VARIANTS[name])
    B, S = cfg.train.global_batch_size, cfg.data.seq_len
    specs = param_specs(cfg.model)
    opt = build_optimizer(cfg.train, specs)
    state = init_state(cfg, init_params(specs, jax.random.key(0)), opt)
    step = jax.jit(make_train_step(cfg, opt), donate_argnums=0)
    tokens = jax.random.randint(jax.random.key(1), (B, S + 1), 0, cfg.model.vocab_size)
    batch = {"tokens": tokens, "loss_mask": jnp.ones((B, S), jnp.float32)}
    t = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(steps):
            state, m = step(state, batch)
        jax.block_until_ready(m)
        times.append((time.perf_counter() - t) / steps)
    sec = statistics.median(times)
    tok_s = B * S / sec
    return {
        "variant": name,
        "params": num_params(cfg.model),
        "active_params": num_active_params(cfg.model),
        "tokens_per_step": B * S,
        "step_s": sec,
        "tokens_per_s": tok_s,
        "flops_per_token": flops_per_token(cfg.model, S),
        "compile_s": compile_s,
        "loss": float(m["loss"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/results/moe_throughput.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "peak":
        from shipyard.train.metrics import measure_matmul_peak

        print(json.dumps(measure_matmul_peak()))
        return
    if args.child:
        print(json.dumps(run_variant(args.child, args.steps, args.rounds)))
        return

    def child(name: str):
        cmd = [sys.executable, __file__, "--child", name]
        cmd += ["--steps", str(args.steps), "--rounds", str(args.rounds)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=dict(os.environ)).stdout
        return json.loads(out.strip().splitlines()[-1])

    # One peak for every variant, so their MFUs differ only by their own speed.
    peak = child("peak")
    print(f"fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s")
    results = []
    for name in VARIANTS:
        r = child(name)
        r["mfu"] = r["tokens_per_s"] * r["flops_per_token"] / peak
        results.append(r)
        print(
            f"{name:22s} {r['tokens_per_s']:10,.0f} tok/s  MFU {r['mfu']:6.1%}  "
            f"({r['active_params']:,} active of {r['params']:,} params; compile {r['compile_s']:.1f} s)"
        )
    by = {r["variant"]: r for r in results}
    summary = {
        "blocked_over_ragged_dot": by["moe-small-blocked"]["tokens_per_s"]
        / by["moe-small-ragged_dot"]["tokens_per_s"],
        "moe_over_dense_same_active": by["moe-small-blocked"]["tokens_per_s"]
        / by["dense-same-active"]["tokens_per_s"],
    }
    print(json.dumps(summary))
    record = {
        "benchmark": "moe_throughput",
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "matmul_peak_flops": peak,
        "results": results,
        "summary": summary,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
