"""Pipeline schedule: measured train-step time against microbatches, next to the theoretical bubble.

For pipeline = 2 and 4 stages (and one stage, the schedule without a bubble)
and microbatches 1, 2, 4, 8 (GPipe; plus the circular schedule with 2 rounds
where microbatches >= stages), one process on 8 CPU host devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`, set here before JAX
starts) builds the real train program of a small dense model (8 layers,
hidden 128, seq 128, 16 sequences per step) on a mesh of `stages` devices,
compiles it, runs `--warmup` steps and times `--steps` more (median).

Next to each time: the bubble (P - 1) / (M*R + P - 1) (parallel.pipeline.bubble_fraction)
and the time the schedule predicts from the one-stage run at the same
microbatches, t1 / P / (1 - bubble): the work split over P stages, stretched
by the idle fill/drain ticks. On a CPU the "devices" are threads sharing the
machine's cores, so stages do not really run side by side: with 2 cores the
measured times show the schedule's overheads (more ticks, ppermute copies,
smaller matmuls) rather than a pipeline's speed-up, and they are noisy when
other processes share the cores. The bubble column is what an accelerator
cluster would see.

    .venv/bin/python bench/pipeline_bubble.py [--steps 5] [--warmup 2] [--out bench/results/pipeline_bubble.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

MODEL = [
    "model.num_layers=8",
    "model.hidden_size=128",
    "model.intermediate_size=384",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "data.seq_len=128",
    "train.global_batch_size=16",
]


def configs() -> list[tuple[int, int, int]]:
    """(stages, microbatches, repeats) to time."""
    out = []
    for stages in (1, 2, 4):
        for micro in (1, 2, 4, 8):
            out.append((stages, micro, 1))
            if stages > 1 and micro >= stages:
                out.append((stages, micro, 2))
    return out


def time_step(stages: int, micro: int, repeats: int, steps: int, warmup: int) -> dict:
    import jax
    import numpy as np

    from shipyard.config import MeshConfig, load_config
    from shipyard.model.params import init_params
    from shipyard.parallel.mesh import make_mesh
    from shipyard.parallel.pipeline import bubble_fraction
    from shipyard.train.program import build_program
    from shipyard.train.step import init_state

    schedule = [f"train.pipeline.microbatches={micro}", f"train.pipeline.repeats={repeats}"]
    mesh_cfg = MeshConfig(pipeline=stages, data=1)
    cfg = load_config("tiny", [*MODEL, *schedule]).model_copy(update={"mesh": mesh_cfg})
    program = build_program(cfg, make_mesh(mesh_cfg, jax.devices()[:stages]))
    state = init_state(
        cfg, init_params(program.specs, jax.random.key(0), program.shardings), program.optimizer
    )
    B, L = cfg.train.global_batch_size, cfg.data.seq_len
    tokens = np.random.default_rng(0).integers(0, 256, (B, L + 1), dtype=np.int32)
    batch = jax.device_put(
        {"tokens": tokens, "loss_mask": np.ones((B, L), np.float32)}, program.batch_shardings
    )
    start = time.perf_counter()
    state, metrics = program.train_step(state, batch, None)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - start
    for _ in range(warmup):
        state, metrics = program.train_step(state, batch, None)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = program.train_step(state, batch, None)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return {
        "stages": stages,
        "microbatches": micro,
        "repeats": repeats,
        "bubble": bubble_fraction(stages, micro, repeats),
        "step_ms": 1000 * statistics.median(times),
        "step_ms_all": [1000 * t for t in times],
        "first_step_s": compile_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/results/pipeline_bubble.json"))
    args = ap.parse_args()
    rows = [time_step(*c, args.steps, args.warmup) for c in configs()]
    one_stage = {r["microbatches"]: r["step_ms"] for r in rows if r["stages"] == 1}
    print(f"{'stages':>6} {'micro':>5} {'rounds':>6} {'bubble':>7} {'step ms':>8} {'predicted':>9}")
    for r in rows:
        P = r["stages"]
        r["predicted_ms"] = one_stage[r["microbatches"]] / P / (1 - r["bubble"])
        print(
            f"{P:>6} {r['microbatches']:>5} {r['repeats']:>6} {r['bubble']:>7.1%} "
            f"{r['step_ms']:>8.1f} {r['predicted_ms']:>9.1f}"
        )
    result = {
        "what": "median train-step time vs pipeline microbatches on CPU host devices, next to the "
        "schedule's bubble (P-1)/(M*R+P-1) and t(1 stage) / P / (1 - bubble)",
        "model": MODEL,
        "steps": args.steps,
        "warmup": args.warmup,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "note": "CPU host devices share the machine's cores: stages do not run concurrently, so the "
        "times show the schedule's overhead, not a speed-up; noisy while other processes run",
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
