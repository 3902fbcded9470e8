"""The GPU check: MFU, tokens/s and peak memory of real train steps next to the planner's prediction.

Two shapes, bf16, seq 4096, remat full, chunked loss, the backend's attention
kernel (`model.attention_impl=auto`: cuDNN flash attention on a GPU):

* `dense-1b`: a Llama-style 1.3B model (hidden 2048, 16 layers, 16 heads of
  128, 8 KV heads, SwiGLU 8192, the Llama-3 128K vocabulary);
* `marin-8b-8l`: the marin-8b preset's shape (hidden 4096, 32 heads, 8 KV
  heads, SwiGLU 14336, 128K vocabulary) at 8 of its 32 layers, so one GPU
  holds its fp32 master params and AdamW state.

Next to each measured step: the step time `shipyard plan --target <device>x1` predicts for the
same config (XLA:GPU's compile of it, deviceless, and the roofline of docs/targets.md).

Each shape runs in its own child process (so each peak is its own): build the
train program on one device, compile (timed), run `--warmup` steps, time
`--steps` more, read the device's `peak_bytes_in_use`. Printed and written
as JSON next to the planner's figures for the same config on one device: the
analytic total (`plan.analytic`) and the compiled peak XLA reports for this
very step on this backend (`memory_analysis`, what `shipyard plan` reads on
fake CPU devices). MFU = FLOPs per token (6 x active params + attention,
`train.metrics.flops_per_token`) x tokens/s / the device's dense bf16 peak
(`plan.DEVICES`, default h200: 989 TFLOP/s); on CPU the best measured fp32 matmul.

    python bench/accelerator.py [--device h200] [--steps 5] [--out bench/results/accelerator.json]
    python bench/accelerator.py --smoke   # a tiny shape at seq 256 in fp32: rehearses the script on CPU

On the lent GPU machine (no network; its image, Python 3.12 with JAX 0.11,
lacks pydantic and zstandard), with their wheels downloaded here into `.whl/`
(git-excluded; ../.library/device/README.md: `pip download --no-deps
--only-binary=:all: --python-version 3.12 ...` for pydantic==2.14.4,
pydantic-core==2.50.5, annotated-types, typing-inspection, typing-extensions,
zstandard) and carried:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
      PYTHONPATH=/tmp/site:src python3 bench/accelerator.py --out $OUT/accelerator.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {
    "dense-1b": {
        "base": "llama3-8b",
        "model": dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_layers=16,
            num_heads=16,
            num_kv_heads=8,
            head_dim=128,
            max_seq_len=4096,
        ),
        "batch": 8,
    },
    "marin-8b-8l": {"base": "marin-8b", "model": dict(num_layers=8), "batch": 8},
}
SMOKE = {
    "base": "small",
    "model": dict(num_layers=2, max_seq_len=256),
    "batch": 4,
    "seq": 256,
    "dtype": "float32",
}
TARGET_MFU = 0.5
"""The issue's target for the 8B shape on an H200; peak memory within 15% of the plan."""


def overrides(shape: dict, seq: int, dtype: str) -> list[str]:
    out = [f"model.{k}={v}" for k, v in shape["model"].items()]
    return out + [
        f"data.seq_len={seq}",
        f"train.global_batch_size={shape['batch']}",
        "train.microbatches=1",
        f"train.precision.compute_dtype={dtype}",
        "model.remat=full",
        "model.attention_impl=auto",
        "mesh.data=-1",
        "mesh.fsdp=1",
        "mesh.expert=1",
    ]


def run_shape(name: str, shape: dict, device_name: str, steps: int, warmup: int) -> dict:
    """Runs in the child: build, compile, step, measure (one device)."""
    import jax
    import numpy as np

    from shipyard import plan
    from shipyard.config import load_config
    from shipyard.model.params import init_params
    from shipyard.parallel.mesh import make_mesh
    from shipyard.train.metrics import flops_per_token, measure_matmul_peak
    from shipyard.train.program import build_program
    from shipyard.train.step import init_state

    seq, dtype = shape.get("seq", 4096), shape.get("dtype", "bfloat16")
    cfg = load_config(shape["base"], overrides(shape, seq, dtype))
    device = plan.DEVICES[device_name]
    sizes = {a: 1 for a in plan.parse_mesh("")}
    predicted = plan.analytic(cfg, sizes, device, None, TARGET_MFU)
    program = build_program(cfg, make_mesh(cfg.mesh, jax.devices()[:1]))

    t0 = time.perf_counter()
    compiled = program.lower_train_step().compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    compiled_peak = (
        mem.argument_size_in_bytes
        + mem.temp_size_in_bytes
        + mem.output_size_in_bytes
        - mem.alias_size_in_bytes
    )

    params = init_params(program.specs, jax.random.key(0), program.shardings)
    state = init_state(cfg, params, program.optimizer, program.shardings)
    rng = np.random.default_rng(0)
    batch = {
        "tokens": jax.device_put(
            rng.integers(0, cfg.model.vocab_size, (shape["batch"], seq + 1), dtype=np.int32),
            program.batch_shardings["tokens"],
        ),
        "loss_mask": jax.device_put(
            np.ones((shape["batch"], seq), np.float32), program.batch_shardings["loss_mask"]
        ),
    }
    losses = []
    for _ in range(warmup):
        state, m = compiled(state, batch, None)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, m = compiled(state, batch, None)
        losses.append(m["loss"])
    jax.block_until_ready(state)
    step_s = (time.perf_counter() - t0) / steps
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    tokens_per_s = shape["batch"] * seq / step_s
    flops = flops_per_token(cfg.model, seq)
    # A GPU's peak is its datasheet number; a CPU's depends on the host (AVX-512 or not, clocks),
    # so there the divisor is a measured matmul, as the trainer's MFU on CPU.
    peak_flops = measure_matmul_peak() if jax.default_backend() == "cpu" else device.peak_flops
    return {
        "shape": name,
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "jax_version": jax.__version__,
        "params_total": predicted["params_total"],
        "seq_len": seq,
        "batch": shape["batch"],
        "compute_dtype": dtype,
        "compile_seconds": compile_s,
        "step_seconds": step_s,
        "tokens_per_second": tokens_per_s,
        "mfu": flops * tokens_per_s / peak_flops,
        "peak_flops": peak_flops,
        "target_mfu": TARGET_MFU,
        "peak_bytes_measured": peak,
        "peak_bytes_compiled": compiled_peak,
        "peak_bytes_analytic": predicted["bytes"]["total"],
        "measured_over_compiled": None if peak is None else peak / compiled_peak,
        "losses": [float(x) for x in losses],
    }


def predict(name: str, device: str) -> dict:
    """The plan's step time for this shape on one `device` GPU compiled by XLA:GPU for it
    (`shipyard plan --target <device>x1`: docs/targets.md), to print next to the measured one. Needs
    the CUDA plugin, not the GPU: the compile is deviceless, in its own child process."""
    from shipyard import plan
    from shipyard.config import load_config
    from shipyard.parallel.targets import parse_target

    shape = SMOKE if name == "smoke" else SHAPES[name]
    seq, dtype = shape.get("seq", 4096), shape.get("dtype", "bfloat16")
    cfg = load_config(shape["base"], [*overrides(shape, seq, dtype), "mesh.data=1"])
    try:
        target = parse_target(f"{device}x1")  # a ConfigError for a device with no target (cpu)
        p = plan.plan(cfg, {"data": 1}, plan.target_device(target), target=target)
    except Exception as e:  # noqa: BLE001 - a prediction that cannot be made is reported, not fatal
        return {"predicted_error": str(e).splitlines()[0][:300]}
    r = p["roofline"]
    return {
        "predicted_step_seconds": r["step_seconds"],
        "predicted_overlapped_step_seconds": r["overlapped_step_seconds"],
        "predicted_mfu": r["mfu"],
        "predicted_peak_bytes": p["compiled"]["peak_bytes"],
        "predicted_hlo_fingerprint": p["compiled"]["hlo_fingerprint"],
    }


def child(name: str, device: str, steps: int, warmup: int) -> dict:
    shape = SMOKE if name == "smoke" else SHAPES[name]
    return run_shape(name, shape, device, steps, warmup)


def spawn(name: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", name, "--device", args.device]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        return {"shape": name, "error": (proc.stderr.strip().splitlines() or ["(no output)"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    gib = 2**30
    out = ["shape          tok/s     MFU    step s  predicted  compile s  peak GiB  compiled  analytic"]
    for r in rows:
        if "error" in r:
            out.append(f"{r['shape']:<13}  failed: {r['error']}")
            continue
        peak = r["peak_bytes_measured"]
        out.append(
            f"{r['shape']:<13} {r['tokens_per_second']:>8,.0f}  {r['mfu']:>5.1%}  {r['step_seconds']:>7.3f}"
            f"  {r.get('predicted_step_seconds', float('nan')):>9.3g}  {r['compile_seconds']:>9.1f}  {'-' if peak is None else f'{peak / gib:8.2f}':>8}"
            f"  {r['peak_bytes_compiled'] / gib:8.2f}  {r['peak_bytes_analytic'] / gib:8.2f}"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="h200", help="plan.DEVICES name the MFU is measured against")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=200, help="seconds per shape")
    ap.add_argument("--smoke", action="store_true", help="a tiny fp32 shape (rehearsal on CPU)")
    ap.add_argument("--no-predict", action="store_true", help="skip the target compile's predicted step time")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.device, args.steps, args.warmup)))
        return
    names = ["smoke"] if args.smoke else list(SHAPES)
    rows = [{**spawn(n, args), **({} if args.no_predict else predict(n, args.device))} for n in names]
    print(table(rows))
    result = {"bench": "accelerator", "device": args.device, "results": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
