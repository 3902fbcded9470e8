"""Memory of one fine-tuning step on the `small` preset: full training vs LoRA vs the last layers only.

Compiles the train step (XLA's memory analysis, no step is run) for each
variant on one CPU device with `shipyard.plan.compiled`, the same numbers
`shipyard plan` prints: arguments (params, optimizer state, batch), the
temporaries (activations, gradients, optimizer update), and the peak. Each
variant is compiled with the preset's `remat: none` and with `remat: full`
(which removes most activations, so the state's share shows).

    .venv/bin/python bench/finetune_memory.py [--out bench/results/finetune_memory.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

VARIANTS = {
    "full": [],
    "lora r=8 on q,k,v,o,gate,up,down": [
        "train.finetune={lora: {rank: 8, targets: [q, k, v, o, gate, up, down]}}"
    ],
    "lora r=8 on q,k,v,o": ["train.finetune={lora: {rank: 8}}"],
    "last 2 of 6 layers": ["train.finetune={train_last_layers: 2}"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/finetune_memory.json"))
    args = parser.parse_args()

    from shipyard.config import load_config
    from shipyard.plan import compiled
    from shipyard.train.finetune import Partition

    sizes = {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1}
    rows = []
    for remat in ("none", "full"):
        for name, overrides in VARIANTS.items():
            cfg = load_config("small", [f"model.remat={remat}", *overrides])
            t0 = time.perf_counter()
            c = compiled(cfg, sizes)
            trainable = sum(
                s.size
                for s in __import__("jax").tree.leaves(
                    Partition(cfg.model, cfg.train.finetune).trainable_specs(),
                    is_leaf=lambda x: hasattr(x, "logical_axes"),
                )
            )
            rows.append(
                {
                    "variant": name,
                    "remat": remat,
                    "trainable_params": trainable,
                    "peak_mib": c["peak_bytes"] / 2**20,
                    "params_mib": c["params_bytes"] / 2**20,
                    "optimizer_mib": c["optimizer_bytes"] / 2**20,
                    "temp_mib": c["temp_bytes"] / 2**20,
                    "compile_s": time.perf_counter() - t0,
                }
            )
            r = rows[-1]
            print(
                f"remat={remat:4s} {name:34s} trainable {trainable:>10,}  peak {r['peak_mib']:7.1f} MiB  "
                f"params {r['params_mib']:6.1f}  optimizer {r['optimizer_mib']:6.1f}  temporaries {r['temp_mib']:7.1f}",
                flush=True,
            )
    for remat in ("none", "full"):
        full = next(r for r in rows if r["remat"] == remat and r["variant"] == "full")
        for r in rows:
            if r["remat"] == remat:
                r["peak_vs_full"] = r["peak_mib"] / full["peak_mib"]
    result = {
        "benchmark": "finetune_memory",
        "preset": "small (16M params, batch 8 x 256 tokens, fp32)",
        "host": platform.node(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
