"""Compile wall time of the train step for TPU and GPU targets on this host (`shipyard plan --target`).

Per target and model size: the seconds XLA:TPU or XLA:GPU takes to compile the step for the
target's compile-only devices (lowering timed apart), the compiled peak per device and the HLO
fingerprint, each the median of `--repeat` compiles in one process (later compiles of the same
program are not served by a cache: JAX's persistent cache is off here). What a user of
`plan --target` and `plan --search` waits for per layout: docs/targets.md.

    python bench/target_compile.py [--repeat 3] [--quick] [--out bench/results/target_compile.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)

CASES = [
    ("tiny", "tpu-v5p:2x2x1", ["mesh.fsdp=4", "mesh.data=1"]),
    ("tiny", "h100x8", ["mesh.fsdp=8", "mesh.data=1", "train.precision.compute_dtype=bfloat16"]),
    ("moe-tiny", "tpu-v5p:2x2x1", ["mesh.expert=4", "mesh.data=1", "mesh.fsdp=1"]),
    ("moe-tiny", "h100x8", ["mesh.expert=4", "mesh.data=2", "mesh.fsdp=1"]),
    ("marin-8b", "tpu-v5p:4x4x4", ["mesh.fsdp=64", "mesh.data=1"]),
    ("marin-8b", "h100x64", ["mesh.fsdp=64", "mesh.data=1"]),
]
QUICK = CASES[:4]


def measure(config: str, spec: str, overrides: list[str], repeat: int) -> dict:
    from shipyard.config import load_config
    from shipyard.parallel import targets
    from shipyard.plan_target import analyse, lower_step

    target = targets.parse_target(spec)
    cfg = load_config(config, overrides)
    devices = targets.compile_only_devices(target)
    lower_s, compile_s, result = [], [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        lowered, mesh, program = lower_step(cfg, devices)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        lower_s.append(t1 - t0)
        compile_s.append(t2 - t1)
        result = analyse(compiled, mesh, program)
    return {
        "config": config,
        "target": spec,
        "overrides": overrides,
        "devices": target.devices,
        "lower_seconds": lower_s,
        "compile_seconds": compile_s,
        "compile_median": statistics.median(compile_s),
        "compile_spread": [min(compile_s), max(compile_s)],
        "peak_bytes": result["peak_bytes"],
        "hlo_fingerprint": result["hlo_fingerprint"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="the tiny shapes only")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from shipyard.cpu_tuning import environment

    rows = []
    print(
        f"{'config':<10} {'target':<15} {'devices':>7} {'compile s (median [min, max])':>32} {'peak GiB':>9}"
    )
    for config, spec, overrides in QUICK if args.quick else CASES:
        r = measure(config, spec, overrides, args.repeat)
        rows.append(r)
        lo, hi = r["compile_spread"]
        print(
            f"{config:<10} {spec:<15} {r['devices']:>7} {r['compile_median']:>19.1f} [{lo:.1f}, {hi:.1f}]"
            f"{r['peak_bytes'] / 2**30:>10.2f}",
            flush=True,
        )
    result = {"bench": "target_compile", "environment": environment(), "results": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
