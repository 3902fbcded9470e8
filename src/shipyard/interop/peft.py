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

from shipyard.errors import RunDirError

_MODULES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


def load_run_adapters(run_dir: Path, step: int | None = None):
    """(config, step, {stack: {"a": {...}, "b": {...}} or None}) of a LoRA run, as host numpy."""
    import jax

    from shipyard.interop.hf import run_checkpoint
    from shipyard.model.params import abstract_params
    from shipyard.train.checkpoint import checkpoint_dir, restore_params
    from shipyard.train.finetune import Partition

    run_dir = Path(run_dir)
    cfg, step = run_checkpoint(run_dir, step, "export peft")
    partition = Partition(cfg.model, cfg.train.finetune)
    if partition.kind != "lora":
        raise RunDirError(
            f"export peft: {run_dir} did not train LoRA adapters (train.finetune.lora is not set); "
            "use `shipyard export hf` for its full weights"
        )
    specs = partition.trainable_specs()
    adapters = restore_params(checkpoint_dir(run_dir), step, abstract_params(specs))
    return cfg, step, jax.tree.map(np.asarray, adapters)


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


def export_peft(run_dir: Path, out: Path, step: int | None = None, base: str | None = None) -> dict:
    """Write the run's adapters as a PEFT LoRA directory (atomically); `base` is recorded as
    base_model_name_or_path (the exported base model's directory or hub name)."""
    from safetensors.numpy import save_file

    from shipyard.data.stage import stage_output

    cfg, step, adapters = load_run_adapters(run_dir, step)
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
    with stage_output(Path(out), overwrite=False, stage="export peft") as tmp:
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"step": step, "tensors": len(tensors), "targets": modules}
