"""LoRA adapters as a PEFT directory: adapter_config.json + adapter_model.safetensors.

The `peft` library loads it on top of the base model exported with
`shipyard export hf` (the run's train.init_from, exported), and the result
computes what shipyard's adapted model computes. PEFT stores per layer and
projection lora_A [r, in] and lora_B [out, r] (torch Linear layout) with
scaling lora_alpha / r, which is shipyard's A [in, r] and B [r, out]
transposed, the head dims flattened the way the HF export flattens them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

_MODULES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


def peft_tensors(cfg, adapters) -> dict[str, np.ndarray]:
    """PEFT state dict names -> fp32 arrays, layers numbered across the dense and MoE stacks."""
    out = {}
    first = {"blocks": 0, "moe_blocks": cfg.model.num_dense_layers}
    for stack, tree in adapters.items():
        if tree is None:
            continue
        for target, a in tree["a"].items():
            b = tree["b"][target]
            for j in range(a.shape[0]):
                name = f"base_model.model.model.layers.{first[stack] + j}.{_MODULES[target]}"
                rank = a.shape[-1]
                out[f"{name}.lora_A.weight"] = np.ascontiguousarray(a[j].reshape(-1, rank).T, np.float32)
                out[f"{name}.lora_B.weight"] = np.ascontiguousarray(b[j].reshape(rank, -1).T, np.float32)
    return out


def write_peft_dir(cfg, adapters, out: Path, base: str | None = None) -> dict:
    """Write a LoRA run's adapters (host arrays) as a PEFT LoRA directory, atomically; `base` is
    recorded as base_model_name_or_path (the exported base model's directory or hub name)."""
    from safetensors.numpy import save_file

    from shipyard.output import atomic_dir

    lora = cfg.train.finetune.lora
    tensors = peft_tensors(cfg, adapters)
    modules = sorted({_MODULES[t].split(".")[-1] for t in lora.targets})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
    }
    with atomic_dir(Path(out), "export peft") as tmp:
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"tensors": len(tensors), "targets": modules}
