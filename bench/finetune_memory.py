"""Memory of one fine-tuning step on the `small` preset: full training vs LoRA vs QLoRA vs the last layers.

Compiles the train step (XLA's memory analysis, no step is run) for each
variant on one CPU device with `shipyard.plan.compiled`, the same numbers
`shipyard plan` prints: arguments (params, optimizer state, batch), the
temporaries (activations, gradients, optimizer update), and the peak. Each
variant is compiled with the preset's `remat: none` and with `remat: full`
(which removes most activations, so the state's share shows).

QLoRA variants hold the frozen base's attention and MLP weights as NF4 (or
int8) codes + scales. Their `base_weight_bytes` is what XLA's memory analysis
counts for those weights: the step's argument bytes minus those of the same
LoRA step on the fp32 base, plus the fp32 bytes of those weights (the two
steps differ only there); `base_vs_fp32` divides it by the fp32 bytes.

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
    "qlora nf4 r=8 on q,k,v,o,gate,up,down": [
        "train.finetune={lora: {rank: 8, targets: [q, k, v, o, gate, up, down]}, quantize_base: nf4}"
    ],
    "qlora nf4+double quant r=8 on all": [
        "train.finetune={lora: {rank: 8, targets: [q, k, v, o, gate, up, down]}, quantize_base: nf4, "
        "double_quant: true}"
    ],
    "qlora int8 r=8 on all": [
        "train.finetune={lora: {rank: 8, targets: [q, k, v, o, gate, up, down]}, quantize_base: int8}"
    ],
    "last 2 of 6 layers": ["train.finetune={train_last_layers: 2}"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/finetune_memory.json"))
    args = parser.parse_args()

    from shipyard.config import load_config
    from shipyard.model.partition import Partition
    from shipyard.plan import compiled

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
                    "argument_bytes": c["argument_bytes"],
                    "compile_s": time.perf_counter() - t0,
                }
            )
            r = rows[-1]
            print(
                f"remat={remat:4s} {name:34s} trainable {trainable:>10,}  peak {r['peak_mib']:7.1f} MiB  "
                f"params {r['params_mib']:6.1f}  optimizer {r['optimizer_mib']:6.1f}  temporaries {r['temp_mib']:7.1f}",
                flush=True,
            )
    fp32_base = 4 * block_weight_params(load_config("small").model)
    for remat in ("none", "full"):
        full = next(r for r in rows if r["remat"] == remat and r["variant"] == "full")
        lora = next(
            r for r in rows if r["remat"] == remat and r["variant"].startswith("lora r=8 on q,k,v,o,")
        )
        for r in rows:
            if r["remat"] == remat:
                r["peak_vs_full"] = r["peak_mib"] / full["peak_mib"]
            if r["remat"] == remat and r["variant"].startswith("qlora"):
                base = r["argument_bytes"] - lora["argument_bytes"] + fp32_base
                r.update(base_weight_bytes=base, base_fp32_bytes=fp32_base, base_vs_fp32=base / fp32_base)
                print(
                    f"remat={remat:4s} {r['variant']:34s} base weights in the step's arguments "
                    f"{base / 2**20:.2f} MiB = {base / fp32_base:.3f} x fp32 ({fp32_base / 2**20:.2f} MiB)"
                )
    result = {
        "benchmark": "finetune_memory",
        "preset": "small (16M params, batch 8 x 256 tokens, fp32)",
        "host": platform.node(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


def block_weight_params(model) -> int:
    """Parameters of the attention and dense-MLP weights (what QLoRA quantizes) of `model`."""
    from shipyard.model.quant import BLOCK_WEIGHTS
    from shipyard.model.transformer import param_specs

    specs = param_specs(model)
    return sum(
        getattr(stack, name).size
        for stack in (specs.blocks, specs.moe_blocks)
        if stack is not None
        for name in BLOCK_WEIGHTS
        if getattr(stack, name) is not None
    )


if __name__ == "__main__":
    main()
