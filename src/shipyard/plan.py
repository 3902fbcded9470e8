"""Plan before you rent: memory, FLOPs and time of a config on a mesh, analytic and compiled.

Analytic: parameters (total, active) from the spec tree; bytes per device of
params, gradients and optimizer state under the sharding rules (each array's
shard is its size over the mesh axes its logical axes map to); activations
from the remat policy and microbatch; FLOPs per token (6 x active matmul
params + attention, the PaLM convention, `train.metrics.flops_per_token`);
step time at a stated MFU.

Compiled: the real train step lowered with abstract inputs
(`jax.ShapeDtypeStruct`s carrying the mesh's shardings; nothing allocated) on
fake CPU devices of the same count, in a child process (the device count is
fixed when JAX starts), and XLA's memory analysis (arguments, temporaries,
outputs) and cost analysis. `--compile-layers N` compiles N layers (plus the
leading dense ones) and extrapolates per-layer costs linearly, saying so.

Byte accounting of shipyard's precision policy, per parameter: fp32 master
params (4), fp32 gradients (4: the gradient of an fp32 param), and AdamW's
two fp32 moments (8), 16 in all (Muon matrices keep one moment: 12). The
often-quoted 8B x (2 + 2 + 8) = 96 GB assumes bf16 params and gradients;
the plan's `bytes_per_param` shows which terms differ.

With an RLConfig (`shipyard plan --rl`), the plan is of `shipyard rl`'s trainer (`rl_train_config`)
plus what an RL run holds beside it: the rollout engine's KV cache and its copy of the merged
weights on the mesh's first device, and the KL reference (`_rl_bytes`).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from shipyard.config import Config, MeshConfig, RLConfig
from shipyard.data.sizing import parse_amount
from shipyard.errors import ConfigError
from shipyard.output import human_bytes

if TYPE_CHECKING:  # jax is imported only where a plan needs it
    from shipyard.parallel.layout import Layout


@dataclass(frozen=True)
class Device:
    """One accelerator model: what the planner divides by."""

    name: str
    memory_bytes: float
    """HBM per device."""
    peak_flops: float
    """Dense bf16 peak FLOP/s per device (fp32 on CPU)."""
    platform: str | None = None
    """The JAX backend it runs ("gpu", "tpu"); None: looked up by name in `_BACKENDS`."""
    fp8_flops: float | None = None
    """Dense fp8 matmul peak FLOP/s per device (train.precision=fp8); None: no fp8 units, its matmuls
    run at the bf16 peak."""


DEVICES = {
    "h100": Device("h100", 80 * 2**30, 989e12, fp8_flops=1979e12),
    "h200": Device("h200", 141 * 2**30, 989e12, fp8_flops=1979e12),
    "a100": Device("a100", 80 * 2**30, 312e12),
    "tpu-v5p": Device("tpu-v5p", 95 * 2**30, 459e12),
    "cpu": Device("cpu", 24 * 2**30, 150e9),
}


def parse_bytes(text: str) -> float:
    """'80GiB', '141 GB', '1.5e9' -> bytes (the data planner's reading of an amount)."""
    return parse_amount(text, "--device-memory", "a size", "80GiB, 141GB or 8e10")


def parse_mesh(text: str) -> dict[str, int]:
    """'data=2,fsdp=8,expert=4' -> sizes of every mesh axis (unnamed ones are 1)."""
    from shipyard.config import MESH_AXIS_NAMES

    sizes = dict.fromkeys(MESH_AXIS_NAMES, 1)
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        if name.strip() not in sizes or not value.strip().isdigit() or int(value) < 1:
            raise ConfigError(
                f"--mesh: {part!r} is not axis=size; expected e.g. data=2,fsdp=8,tensor=1,expert=4 "
                f"with axes {', '.join(MESH_AXIS_NAMES)} and positive sizes"
            )
        sizes[name.strip()] = int(value)
    return sizes


def config_mesh(mesh: MeshConfig) -> dict[str, int]:
    """The sizes of a config's own mesh (`shipyard plan` without --mesh); -1 needs a device count."""
    from shipyard.config import MESH_AXIS_NAMES

    sizes = {a: getattr(mesh, a) for a in MESH_AXIS_NAMES}
    if -1 in sizes.values():
        axis = next(a for a, v in sizes.items() if v == -1)
        raise ConfigError(
            f"--mesh: the config's mesh.{axis} is -1 (all remaining devices), so it names no device count; "
            "give --mesh, e.g. pipeline=4,fsdp=32,expert=8"
        )
    return sizes


def _all_axes(sizes: dict[str, int]) -> dict[str, int]:
    """Sizes of every mesh axis, the unnamed ones 1."""
    from shipyard.config import MESH_AXIS_NAMES

    return {**dict.fromkeys(MESH_AXIS_NAMES, 1), **sizes}


class _MeshShape:
    """Just the axis sizes, which is all the sharding rules look at (no devices needed)."""

    def __init__(self, sizes: dict[str, int]):
        self.shape = sizes


_fmt = human_bytes


# ----------------------------------------------------------------------------- analytic


def _state_bytes(cfg: Config, layout: Layout) -> dict[str, float]:
    """Per-device bytes of params, gradients and optimizer state under the layout's sharding rules."""
    import jax
    import numpy as np

    from shipyard.model.params import is_spec
    from shipyard.model.partition import Partition
    from shipyard.parallel.mesh import logical_to_pspec

    mesh, rules, sizes = layout.mesh, layout.rules, layout.mesh.shape
    partition = Partition(cfg.model, cfg.train.finetune)

    def local(spec) -> float:
        pspec = logical_to_pspec(spec.logical_axes, spec.shape, mesh, rules)
        split = math.prod(
            sizes[a] for entry in pspec if entry for a in ((entry,) if isinstance(entry, str) else entry)
        )
        return spec.size / split

    # Gradients and optimizer moments exist only for what trains (all of it, the adapters or the
    # last layers); frozen params are held once, without either.
    trained = opt = largest = 0.0
    for spec in jax.tree.leaves(partition.trainable_specs(), is_leaf=is_spec):
        n = local(spec)
        trained += n
        largest = max(largest, n)
        muon_matrix = cfg.train.optimizer.name == "muon" and spec.role == "weight"
        opt += n * (4.0 if muon_matrix else 8.0)
    frozen_specs = partition.frozen_specs()
    frozen = sum(local(s) for s in jax.tree.leaves(frozen_specs, is_leaf=is_spec))
    # The frozen part at its own dtypes: a QLoRA base holds uint8 NF4 codes (or int8) and their scales.
    frozen_bytes = sum(
        local(s) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(frozen_specs, is_leaf=is_spec)
    )
    out = {"params": 4.0 * trained + frozen_bytes, "grads": 4.0 * trained, "optimizer": opt}
    out["params_count_local"] = trained + frozen
    out["trained_local"] = trained
    out["largest_local_param"] = largest
    # DPO with reference: on_the_fly keeps the starting trainable tree in the compute dtype for the
    # reference forward (train/reference.py: reference_copy); a cached reference keeps none.
    pref = cfg.train.preference
    on_the_fly = pref is not None and pref.loss == "dpo" and pref.reference == "on_the_fly"
    out["reference"] = trained * np.dtype(cfg.train.precision.compute_dtype).itemsize if on_the_fly else 0.0
    if partition.quantize_base is not None:
        out["quantized_base"] = _quantized_base(frozen_specs, partition.quantize_base, local)
        out["params_count_local"] += out["quantized_base"]["params"] - out["quantized_base"]["stored"]
    return out


def _quantized_base(frozen_specs, mode: str, local) -> dict:
    """The quantized block weights of a QLoRA base, per device: their parameters, stored elements and
    bytes (codes + scales), and the bytes those parameters would take in fp32."""
    import jax
    import numpy as np

    from shipyard.model import quant
    from shipyard.model.params import is_spec

    params = stored = nbytes = 0.0
    for stack in (frozen_specs.blocks, frozen_specs.moe_blocks):
        for name in quant.BLOCK_WEIGHTS:
            node = None if stack is None else getattr(stack, name)
            if not quant.is_any_quantized(node):
                continue
            leaves = jax.tree.leaves(node, is_leaf=is_spec)
            main = node.codes if mode == "nf4" else node.q
            params += local(main) * (2 if mode == "nf4" else 1)  # two NF4 codes a byte
            stored += sum(local(s) for s in leaves)
            nbytes += sum(local(s) * np.dtype(s.dtype).itemsize for s in leaves)
    return {"mode": mode, "params": params, "stored": stored, "bytes": nbytes, "fp32_bytes": 4.0 * params}


def _attention_keys(cfg: Config, sizes: dict[str, int], device: Device) -> tuple[float, str]:
    """(keys whose fp32 scores and probabilities exist at once per query row, the kernel that runs).

    The reference (and ordered) attention holds every key of the sequence (of the local chunk under
    context parallelism, one ring step at a time); the blocked, cuDNN and splash kernels one key block.
    """
    import jax.numpy as jnp

    from shipyard.model.attention import attention_impl

    keys = cfg.data.seq_len / sizes.get("context", 1)
    d = cfg.data
    segments = d.document_masking or d.chat is not None or d.preference is not None
    dtype = jnp.dtype(cfg.train.precision.compute_dtype)
    impl = attention_impl(cfg.model, _platform(device), int(keys), dtype, segments)
    return (keys if impl in ("reference", "ordered") else min(keys, cfg.model.attention_block)), impl


_BACKENDS = {"h100": "gpu", "h200": "gpu", "a100": "gpu", "tpu-v5p": "tpu"}
"""The JAX backend each planned device runs (what model.attention_impl: auto resolves against)."""


def _platform(device: Device) -> str:
    """The JAX backend `device` runs: what `auto` kernels (attention, grouped matmul) resolve against."""
    return device.platform or _BACKENDS.get(device.name, "cpu")


def _loss_tokens(cfg: Config, tokens: float) -> float:
    """Tokens whose fp32 logits exist at once: one chunk of train.loss_chunk_tokens, or all."""
    chunk = cfg.train.loss_chunk_tokens
    return tokens if chunk is None else min(tokens, chunk)


def _layer_bytes(
    cfg: Config, sizes: dict[str, int], c: float, keys: float, impl: str
) -> list[tuple[float, float]]:
    """Per layer, in order: (all intermediates of the layer, the matmul outputs among them) per token,
    bytes; `c` the compute dtype's bytes, `keys` and `impl` the attention's (`_attention_keys`)."""
    m, t = cfg.model, sizes["tensor"]
    E, D = m.hidden_size, m.head_dim
    H, K = m.num_heads / t, m.num_kv_heads / t
    # cuDNN's and splash's kernels keep each tile of scores on chip (SRAM / VMEM): none in HBM
    scores = 0.0 if impl in ("cudnn", "splash") else H * keys * (4 + c)

    def layer(mlp_width: float) -> tuple[float, float]:
        attn = c * (3 * E + (H + 2 * K) * D + (H + K) * D + H * D) + scores
        dots = c * ((H + 2 * K) * D + 2 * E)
        mlp = c * 3 * mlp_width
        return attn + mlp, dots + c * 2 * mlp_width

    layers = [layer(m.intermediate_size / t)] * m.num_dense_layers
    if m.moe is not None:
        e = m.moe
        # Routed rows per local token: dropless, a device's expert compute takes all k copies of its
        # expert group's tokens (ep x k rows, the ones routed elsewhere come out zero); with a
        # capacity, its experts' buffers (capacity_factor x k rows). Each row: its sorted copy, its
        # output, gate/up/act; plus the shared experts. (Counting k rows, the plan said 22 GiB where
        # XLA:TPU needs 159-375 GiB for the 535B model with expert groups of 8-64.)
        rows = e.experts_per_token * (sizes["expert"] if e.capacity_factor is None else e.capacity_factor)
        width = (rows * e.expert_intermediate_size + e.num_shared_experts * e.expert_intermediate_size) / t
        full, dots = layer(width)
        # Expert parallelism all-gathers the group's tokens (ep x E) before sorting copies of them.
        dispatch = c * E * (sizes["expert"] + 2 * rows)
        layers += [(full + dispatch, dots + c * rows * E)] * m.num_moe_layers
    return layers


def _loss_bytes(
    cfg: Config, sizes: dict[str, int], tokens: float, c: float, overlap: float
) -> tuple[float, float]:
    """(what the loss adds to the peak, its transients): the head's gradient accumulator, and of the
    transients only what exceeds `overlap`, the largest layer's backward under remat.

    The loss runs after the last layer's forward and is done before the first layer's backward, so
    under remat its transients (a chunk's fp32 logits and their gradient, the gathered head) and the
    largest layer's backward never coexist: the peak holds the larger of the two. The accumulator is
    the head's gradient, alive through the layers' backward. Without remat every layer's
    intermediates are saved, all alive while the loss runs (`overlap` 0). (marin-8b on 64 v5p chips,
    XLA:TPU's heap peak 28.70 GiB: the saved inputs + the largest layer + the accumulator + the state,
    docs/targets.md.)
    """
    from shipyard.train import chunked_loss

    m, t, E = cfg.model, sizes["tensor"], cfg.model.hidden_size
    logits = 2 * 4.0 * m.vocab_size / t  # fp32 logits and their gradient
    # Chunked, the head's gradient is accumulated over chunks in an fp32 buffer of its own, and it is
    # the gradient of the gathered head: whole over fsdp until its reduce-scatter after the loop
    # (XLA:GPU's buffer assignment for marin-8b on 64 H100s: f32[4096, 128256]).
    accumulator = chunked_loss.accumulator_bytes(tokens, E, m.vocab_size / t, cfg.train.loss_chunk_tokens)
    # FSDP gathers the head whole (compute dtype) for the loss, as it gathers each layer's weights.
    gathered_head = c * E * m.vocab_size / t if sizes["fsdp"] > 1 else 0.0
    transient = _loss_tokens(cfg, tokens) * logits + gathered_head
    return accumulator + max(transient - overlap, 0.0), transient


def _activation_bytes(cfg: Config, layout: Layout, device: Device) -> dict[str, float]:
    """Activation memory per device of one microbatch's forward+backward (an estimate; see docs/plan.md).

    Context parallelism splits each sequence's tokens over `context`; a pipeline stage holds
    1/pipeline of the layers but the saved activations of every pipeline microbatch in flight
    (all of the microbatch's tokens pass through every stage before the backward pass).
    """
    m, sizes, schedule = cfg.model, layout.mesh.shape, layout.schedule
    c = 2.0 if cfg.train.precision.compute_dtype != "float32" else 4.0
    batch_split = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    b = cfg.train.global_batch_size / cfg.train.microbatches / batch_split
    S, E = cfg.data.seq_len, m.hidden_size
    keys, impl = _attention_keys(cfg, sizes, device)
    layers = _layer_bytes(cfg, sizes, c, keys, impl)
    tokens = b * S / layout.context
    stages = 1 if schedule is None else schedule.stages
    in_flight = 1 / schedule.microbatches if stages > 1 else 1.0  # one pipeline microbatch at a time
    gathered = _blocked_expert_weights(cfg, sizes, device, tokens * in_flight, c)
    if stages > 1:
        # The pipeline cuts the last stack (the MoE layers of a MoE model) into equal parts; stage 0
        # also runs a MoE model's leading dense layers, so it holds the most.
        last = m.num_moe_layers if m.moe is not None else m.num_layers
        layers = layers[: len(layers) - last] + layers[len(layers) - last :][: last // stages]
    peak_layer = max(full for full, _ in layers) * in_flight
    moe_layers = m.num_moe_layers if stages == 1 or m.moe is None else m.num_moe_layers // stages
    # The blocked expert compute's gathered weights (per layer, not per token): under remat the
    # backward recomputes the layer's three, then makes each one's gradient in turn; without remat
    # every MoE layer's three are saved for the backward.
    if gathered and m.remat in ("full", "save_dots"):
        peak_layer = max(peak_layer, layers[-1][0] * in_flight + 4 * gathered / tokens)  # a MoE layer
    if m.remat == "full":
        saved = len(layers) * c * E + peak_layer
    elif m.remat == "save_dots":
        saved = sum(d for _, d in layers) + peak_layer
    else:
        saved = sum(f for f, _ in layers) + (3 * moe_layers + 1) * gathered / tokens
    overlap = tokens * peak_layer if m.remat in ("full", "save_dots") else 0.0
    loss, transient = _loss_bytes(cfg, sizes, tokens, c, overlap)
    return {
        "activations": tokens * saved,
        "logits": loss,
        "loss_transient": transient,
        "logit_tokens": _loss_tokens(cfg, tokens),
        "microbatch_tokens_per_device": tokens,
        "attention_impl": impl,
        "attention_keys": keys,
        "stage_layers": len(layers),
    }


def _blocked_expert_weights(
    cfg: Config, sizes: dict[str, int], device: Device, tokens: float, c: float
) -> float:
    """Bytes of one of a dropless MoE layer's weight matrices gathered per block by the blocked expert
    compute (`moe.block_layout`), or 0 where it does not run (capacity mode; `ragged` on TPU). On the
    535B recipe on H200s: 800 blocks x 6144 x 2176 x 2 B = 21.4 GB a matrix, XLA:GPU's
    `loop_gather_fusion` buffers (docs/targets.md)."""
    from shipyard.model.moe import block_layout, grouped_matmul_impl

    e = cfg.model.moe
    if e is None or e.capacity_factor is not None or grouped_matmul_impl(e, _platform(device)) != "blocked":
        return 0.0
    ep = sizes["expert"]
    rows = int(tokens * ep * e.experts_per_token)  # every copy of the expert group's tokens
    blocks, _ = block_layout(max(rows, 1), max(e.num_experts // ep, 1))
    return blocks * cfg.model.hidden_size * e.expert_intermediate_size / sizes["tensor"] * c


def _pipeline(layout: Layout) -> dict | None:
    """The layout's pipeline schedule: its shape and bubble (None without a pipeline axis)."""
    schedule = layout.schedule
    if schedule is None or schedule.stages == 1:
        return None
    from shipyard.parallel.pipeline import bubble_fraction

    return {
        "stages": schedule.stages,
        "microbatches": schedule.microbatches,
        "repeats": schedule.repeats,
        "bubble": bubble_fraction(schedule.stages, schedule.microbatches, schedule.repeats),
    }


def _host_bytes(cfg: Config, state: dict) -> dict[str, float]:
    """Train-state bytes per device held in host memory with train.offload (`resident`), and the
    device bytes the streamed update needs at once (`streamed`: one parameter's worth of what is
    offloaded, the largest; XLA may overlap more)."""
    off = cfg.train.offload
    resident = (state["optimizer"] if off.optimizer else 0.0) + (
        state["params"] - (state.get("quantized_base") or {}).get("bytes", 0.0) if off.params else 0.0
    )
    if not resident:
        return {"resident": 0.0, "streamed": 0.0}
    per_param = (8.0 if off.optimizer else 0.0) + (4.0 if off.params else 0.0)
    return {"resident": resident, "streamed": state["largest_local_param"] * per_param}


def analytic(
    cfg: Config,
    sizes: dict[str, int],
    device: Device,
    tokens: float | None,
    mfu: float,
    rl: RLConfig | None = None,
) -> dict:
    """The analytic plan as a dict (all byte figures per device; with `rl`, of the mesh's first
    device, which also hosts the rollout engine)."""
    from shipyard.model import fp8
    from shipyard.model.transformer import num_active_params, num_params
    from shipyard.parallel.layout import layout_for
    from shipyard.train.metrics import flops_per_token

    sizes = _all_axes(sizes)
    n_dev = math.prod(sizes.values())
    # One layout for every term below (rules, pipeline schedule, context split), as the train
    # program builds it; the planner's mesh is only the axis sizes.
    layout = layout_for(cfg, _MeshShape(sizes))
    state = _state_bytes(cfg, layout)
    act = _activation_bytes(cfg, layout, device)
    # A compute-dtype copy of the (sharded) params exists during the step for bf16/fp16.
    # A QLoRA base is not copied: each matmul dequantizes its weight to the compute dtype.
    castable = state["params"] - (state.get("quantized_base") or {}).get("bytes", 0.0)
    copy = 0.0 if cfg.train.precision.compute_dtype == "float32" else castable / 2
    host = _host_bytes(cfg, state)
    extra = _rl_bytes(cfg, rl, state, n_dev) if rl is not None else None
    if extra is not None:
        state["reference"] = extra["reference"]
    flops_tok = flops_per_token(cfg.model, cfg.data.seq_len)
    step_tokens = cfg.train.global_batch_size * cfg.data.seq_len
    pipeline = _pipeline(layout)
    # Pipeline stages idle for the bubble's share of the schedule.
    busy = 1.0 - (pipeline["bubble"] if pipeline else 0.0)
    # train.precision=fp8: the block matmuls' share of the FLOPs runs at the fp8 peak (where there is
    # one), the rest (head, attention scores, experts, router) at the bf16 peak.
    fp8_share = (
        6.0 * fp8.params_per_token(cfg.model) / flops_tok if cfg.train.precision.matmul == "fp8" else 0.0
    )
    per_flop = (1 - fp8_share) / device.peak_flops + fp8_share / (device.fp8_flops or device.peak_flops)
    step_s = flops_tok * step_tokens * per_flop / (n_dev * mfu * busy)
    out = {
        "devices": n_dev,
        "mesh": sizes,
        "device": asdict(device),
        "params_total": num_params(cfg.model),
        "params_active": num_active_params(cfg.model),
        "bytes_per_param": _bytes_per_param(state),
        "bytes": _device_bytes(state, copy, act, host, extra),
        "pipeline": pipeline,
        "context": layout.context,
        "attention_impl": act["attention_impl"],
        "attention_keys": act["attention_keys"],
        "stage_layers": act["stage_layers"],
        "logit_tokens": act["logit_tokens"],
        "loss_transient": act["loss_transient"],
        "quantized_base": state.get("quantized_base"),
        "microbatch_tokens_per_device": act["microbatch_tokens_per_device"],
        "flops_per_token": flops_tok,
        "flops_per_step": flops_tok * step_tokens,
        "fp8_flop_share": fp8_share,
        "mfu": mfu,
        "step_seconds": step_s,
        "tokens_per_second": step_tokens / step_s,
    }
    if extra is not None:
        out["rl"] = extra["rl"]
    if tokens is not None:
        seconds = tokens / out["tokens_per_second"]
        out.update(token_budget=tokens, days=seconds / 86400, device_hours=seconds * n_dev / 3600)
    return out


def _bytes_per_param(state: dict) -> dict[str, float]:
    """The train state's bytes per parameter on a device: params, grads and optimizer state."""
    # shipyard's policy (module doc); optimizer: 8 for AdamW, between 4 and 8 with Muon.
    return {
        # 4 (fp32); a QLoRA base (quantized_base) lowers the average
        "params": state["params"] / max(state["params_count_local"], 1.0),
        # averaged over all params: with train.finetune only the trainable ones have these
        "grads": state["grads"] / max(state["params_count_local"], 1.0),
        "optimizer": state["optimizer"] / max(state["params_count_local"], 1.0),
    }


def _device_bytes(state: dict, copy: float, act: dict, host: dict, extra: dict | None) -> dict[str, float]:
    """Each term of a device's memory and their total: the train state, the compute copy, the
    reference, activations and logits, less what is offloaded (plus what streams back), and with
    `extra` (--rl) the rollout engine's KV cache and weights."""
    total = (
        state["params"]
        + state["grads"]
        + state["optimizer"]
        + copy
        + state["reference"]
        + act["activations"]
        + act["logits"]
        - host["resident"]
        + host["streamed"]
    )
    if extra is not None:
        total += extra["rollout_kv"] + extra["rollout_params"]
    return {
        "params": state["params"],
        "grads": state["grads"],
        "optimizer": state["optimizer"],
        "compute_copy": copy,
        "reference": state["reference"],
        "activations": act["activations"],
        "logits": act["logits"],
        "offloaded": host["resident"],
        "offload_streamed": host["streamed"],
        **(
            {"rollout_kv": extra["rollout_kv"], "rollout_params": extra["rollout_params"]}
            if extra is not None
            else {}
        ),
        "total": total,
    }


# ----------------------------------------------------------------------------- rl


def rl_train_config(cfg: Config, rl: RLConfig) -> Config:
    """The config of `shipyard rl`'s trainer (rl/step.py) for the model of `cfg`: one update is
    prompts_per_step x group_size replies of data.seq_len tokens (prompt + reply) in one microbatch,
    AdamW on fp32 params computing in fp32, the whole sequence's logits at once (token_logps),
    train.finetune = rl.finetune, on rl.mesh when it is set."""
    train = cfg.train.model_copy(
        update={
            "global_batch_size": rl.prompts_per_step * rl.group_size,
            "microbatches": 1,
            "finetune": rl.finetune,
            "optimizer": cfg.train.optimizer.model_copy(update={"name": "adamw"}),
            "precision": cfg.train.precision.model_copy(update={"compute_dtype": "float32"}),
            "loss_chunk_tokens": None,
            "pipeline": None,
            "offload": type(cfg.train.offload)(),
            "preference": None,
        }
    )
    return cfg.model_copy(update={"train": train, **({"mesh": rl.mesh} if rl.mesh is not None else {})})


def rl_mesh(rl: RLConfig, mesh: dict[str, int] | None) -> dict[str, int]:
    """The RL trainer's mesh sizes: rl.mesh, else `mesh` (--mesh), else one device (`shipyard rl`'s
    mesh: null); only data and fsdp may split it, as `shipyard rl` requires."""
    from shipyard.config import MESH_AXIS_NAMES

    if rl.mesh is not None and mesh is not None:
        raise ConfigError("--rl: mesh= and --mesh both give the RL trainer's mesh; give one of them")
    if rl.mesh is None:
        sizes = _all_axes(mesh or {})
        other = [a for a in ("pipeline", "context", "tensor", "expert") if sizes[a] != 1]
        if other:
            raise ConfigError(
                f"--mesh: rl splits its trainer over data and fsdp only (got {', '.join(other)} > 1); "
                "set them to 1"
            )
        return sizes
    sizes = {a: getattr(rl.mesh, a) for a in MESH_AXIS_NAMES}
    if -1 in sizes.values():
        axis = next(a for a, v in sizes.items() if v == -1)
        raise ConfigError(
            f"--rl: mesh.{axis} is -1 (all remaining devices), so it names no device count; "
            "give every axis, e.g. mesh={data: 1, fsdp: 4}"
        )
    return sizes


def _rl_bytes(cfg: Config, rl: RLConfig, state: dict, n_dev: int) -> dict:
    """What an RL run holds beyond its trainer, in bytes, on the mesh's first device (which hosts
    the rollout engine): the engine's fp32 KV cache (2 x [layers, max_batch, data.seq_len, kv_heads,
    head_dim], inference/decode.py: init_cache), its fp32 copy of the merged weights (none for
    full training on one device: the engine shares the trainer's buffers) and, with beta > 0, the
    KL reference: an fp32 copy of the starting trainable params (all of them, the LoRA adapters
    or the last layers), sharded like them."""
    from shipyard.model.transformer import num_params

    m = cfg.model
    kv = 2.0 * m.num_layers * rl.max_batch * cfg.data.seq_len * m.num_kv_heads * m.head_dim * 4.0
    shared = rl.finetune is None and n_dev == 1
    weights = 0.0 if shared else 4.0 * num_params(m)
    reference = 4.0 * state["trained_local"] if rl.beta else 0.0
    finetune = rl.finetune
    what = (
        "full"
        if finetune is None
        else "lora"
        if finetune.lora is not None
        else f"train_last_layers={finetune.train_last_layers}"
    )
    return {
        "rollout_kv": kv,
        "rollout_params": weights,
        "reference": reference,
        "rl": {
            "prompts_per_step": rl.prompts_per_step,
            "group_size": rl.group_size,
            "rows": rl.prompts_per_step * rl.group_size,
            "seq_len": cfg.data.seq_len,
            "max_batch": rl.max_batch,
            "max_tokens": rl.max_tokens,
            "beta": rl.beta,
            "finetune": what,
            "engine_shares_params": shared,
            "kv_cache_shape": [m.num_layers, rl.max_batch, cfg.data.seq_len, m.num_kv_heads, m.head_dim],
        },
    }


def judged_bytes(plan: dict) -> float:
    """The bytes per device the verdict judges: the compiled peak when there is one, else the
    analytic total. With --rl the compiled step is the trainer alone, so the rollout engine (KV
    cache, weights copy) and the KL reference are added to it."""
    compiled = plan.get("compiled") or {}
    if compiled.get("peak_bytes", 0) <= 0:
        return plan["bytes"]["total"]
    b = plan["bytes"]
    engine = b["rollout_kv"] + b["rollout_params"] + b["reference"] if plan.get("rl") else 0
    return compiled["peak_bytes"] + engine


def verdict(plan: dict, memory: float, cfg: Config) -> tuple[bool, list[str]]:
    """(fits, advice): plainly whether the peak fits in `memory` (with 10% headroom), and what to change.

    The advice is concrete: the fsdp size at which the train state takes at
    most 60% of a device, remat=full if it is not on, and the number of
    microbatches at which the activations fit beside the state (activations
    scale with the tokens of one microbatch).
    """
    compiled = plan.get("compiled") or {}
    peak = judged_bytes(plan)
    budget = 0.9 * memory
    if peak <= budget:
        return True, []
    b, sizes, advice = plan["bytes"], plan["mesh"], []
    # With --rl the rollout engine sits on the first device beside the trainer; sharding does not shrink it.
    engine = b.get("rollout_kv", 0.0) + b.get("rollout_params", 0.0)
    if plan.get("rl"):
        r = plan["rl"]
        advice.append(
            f"the rollout engine takes {_fmt(engine)} on the mesh's first device (KV cache "
            f"{_fmt(b['rollout_kv'])} for rl max_batch={r['max_batch']} rows of data.seq_len={r['seq_len']}, "
            f"weights copy {_fmt(b['rollout_params'])}): lower max_batch or data.seq_len"
        )
    state = b["params"] + b["grads"] + b["optimizer"] + b["compute_copy"] + b.get("reference", 0.0)
    if state > 0.6 * memory:
        need = 2 ** math.ceil(math.log2(sizes["fsdp"] * state / (0.6 * memory)))
        advice.append(
            f"params+grads+optimizer take {_fmt(state)} per device: shard them over more devices "
            f"(mesh fsdp={need} or more, now {sizes['fsdp']}; or more expert parallelism for MoE)"
        )
        state = 0.6 * memory
    act = peak - state - engine if compiled else b["activations"] + b["logits"]
    room = budget - state - engine
    if 0 < room < act:  # (room <= 0 only with --rl: the rollout engine alone fills the device)
        if cfg.model.remat != "full":
            advice.append(f"set model.remat=full (now {cfg.model.remat}): keep only each layer's input")
        per_device = cfg.train.global_batch_size // (sizes["data"] * sizes["fsdp"] * sizes["expert"])
        factor = cfg.train.microbatches * act / max(room, 1.0)
        options = [n for n in range(1, per_device + 1) if per_device % n == 0 and n >= factor]
        if plan.get("rl"):  # shipyard rl updates on the whole rollout batch at once
            advice.append(
                f"activations take {_fmt(act)} with {room / 2**30:.1f} GiB left: fewer rows per update "
                f"(rl prompts_per_step x group_size = {cfg.train.global_batch_size}) or more data x fsdp devices"
            )
        elif options:
            advice.append(
                f"activations take {_fmt(act)} with {room / 2**30:.1f} GiB left: "
                f"train.microbatches={options[0]} (now {cfg.train.microbatches})"
            )
        else:
            advice.append(
                f"activations take {_fmt(act)} even one sequence per device at a time: shorter "
                "data.seq_len, tensor parallelism, or more devices"
            )
    return False, advice


# ----------------------------------------------------------------------------- compiled


def plan_program(cfg: Config):
    """The train program the compiled plan analyses: `train.program.build_program`, the one
    `shipyard train` runs, on this process's devices (fake CPU ones in the child)."""
    from shipyard.train.program import build_program

    # The plan reads no data, so the data's EOS id (document masking without data.eos_id) is
    # unknown; any id compiles to the same program.
    return build_program(cfg, eos_id=0)


def _compiled_child(cfg_yaml: str, sizes: dict[str, int]) -> dict:
    """Runs inside a process started with as many fake CPU devices as the mesh has."""
    from shipyard.config import build_config, read_yaml
    from shipyard.plan_target import local_bytes
    from shipyard.train import offload

    program = plan_program(build_config(read_yaml(cfg_yaml, "plan config")))
    state, frozen = program.abstract_state, program.abstract_frozen
    compiled = program.lower_train_step().compile()
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost

    trained_bytes, frozen_bytes = local_bytes(state.params), local_bytes(frozen)
    state_bytes = local_bytes(state)
    # XLA CPU's memory analysis counts pinned-host arguments with the device's; train.offload's
    # host-resident state is not device memory.
    host = sum(offload.host_state_bytes(state).values())
    return {
        "argument_bytes": mem.argument_size_in_bytes,
        "output_bytes": mem.output_size_in_bytes,
        "alias_bytes": mem.alias_size_in_bytes,
        "temp_bytes": mem.temp_size_in_bytes,
        # Donated state aliases the outputs, so the peak is arguments + temporaries
        # + whatever output is not an alias (the metrics).
        "peak_bytes": mem.argument_size_in_bytes
        + mem.temp_size_in_bytes
        + mem.output_size_in_bytes
        - mem.alias_size_in_bytes
        - host,
        "host_bytes": host,
        "state_bytes": state_bytes + frozen_bytes,
        "params_bytes": trained_bytes + frozen_bytes,
        "optimizer_bytes": state_bytes - trained_bytes,
        "flops_per_device": float(cost.get("flops", 0.0)) if cost else 0.0,
    }


def _run_child(cfg: Config, sizes: dict[str, int]) -> dict:
    from shipyard.config import to_yaml

    n = math.prod(sizes.values())
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    payload = json.dumps({"config": to_yaml(cfg), "mesh": sizes})
    proc = subprocess.run(
        [sys.executable, "-m", "shipyard.plan", "--child"],
        input=payload,
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ConfigError(f"plan: compiling the train step on {n} fake CPU devices failed: {tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compiled(cfg: Config, sizes: dict[str, int], layers: int | None = None, runner=None) -> dict:
    """Compiled memory/cost analysis per device; with `layers`, from two reduced depths, extrapolated.
    `runner(cfg, sizes)` compiles one depth (default: the fake-CPU child, `_run_child`)."""
    runner = runner or _run_child
    m = cfg.model
    # A pipeline stage holds 1/pipeline of the (last stack's) layers: reduced depths add whole
    # layers to every stage.
    unit = sizes.get("pipeline", 1)
    if layers is None or m.num_dense_layers + 3 * unit * layers >= m.num_layers:
        out = runner(cfg, sizes)
        out["extrapolated"] = False
        return out
    # Two depths that keep the leading dense layers and scan at least two MoE layers
    # (a one-trip scan is compiled differently): per-layer cost = their difference.
    lo, hi = m.num_dense_layers + 2 * unit * layers, m.num_dense_layers + 3 * unit * layers
    train = cfg.train
    if (
        unit > 1
        and train.pipeline is not None
        and (hi - m.num_dense_layers) % (unit * train.pipeline.repeats)
    ):
        # The reduced depths do not cut into pipeline x repeats chunks: compile them as GPipe
        # (the circular schedule's rounds add one microbatch's activations per stage, no weights).
        train = train.model_copy(update={"pipeline": train.pipeline.model_copy(update={"repeats": 1})})
    runs = [
        runner(
            cfg.model_copy(update={"model": m.model_copy(update={"num_layers": n}), "train": train}), sizes
        )
        for n in (lo, hi)
    ]
    out = _extrapolated(runs, hi - lo, m.num_layers - hi)
    out["extrapolated"] = True
    out["compiled_layers"] = [lo, hi]
    out["compiled_repeats"] = None if train.pipeline is None else train.pipeline.repeats
    return out


def _extrapolated(runs: list[dict], step: int, more: int) -> dict:
    """The deeper run's figures plus `more` layers at the per-layer difference of the two runs
    (`step` layers apart); collectives row by row; what is not a number from the deeper run."""

    def grow(a: float, b: float) -> float:
        # XLA's buffer reuse is not exactly linear in depth; never extrapolate a shrink.
        return b + max((b - a) / step, 0.0) * more

    out = {}
    for key, b in runs[1].items():
        a = runs[0].get(key)
        if isinstance(b, (int, float)) and not isinstance(b, bool) and isinstance(a, (int, float)):
            out[key] = grow(a, b)
        elif key == "collectives":
            before = {(r["kind"], tuple(r["axes"]), r["crosses_hosts"]): r for r in a or []}
            out[key] = [
                {
                    **r,
                    **{
                        k: grow(
                            before.get((r["kind"], tuple(r["axes"]), r["crosses_hosts"]), {}).get(k, 0.0),
                            r[k],
                        )
                        for k in ("count", "bytes", "wire_bytes")
                    },
                }
                for r in b
            ]
        else:
            out[key] = b
    return out


def target_device(target) -> Device:
    """A `parallel.targets.Target`'s device as the planner divides by: each device's share of its
    chip's memory and bf16 peak."""
    chip = target.chip
    fp8 = None if chip.fp8_flops is None else target.per_device(chip.fp8_flops)
    return Device(
        target.spec,
        target.per_device(chip.memory_bytes),
        target.per_device(chip.bf16_flops),
        chip.platform,
        fp8_flops=fp8,
    )


def plan(cfg: Config, sizes: dict[str, int], device: Device, tokens: float | None = None, mfu: float = 0.4,
         compile_layers: int | None = None, with_compiled: bool = True, rl: RLConfig | None = None,
         target=None) -> dict:  # fmt: skip
    """Analytic plan (+ compiled analysis) + verdict for `cfg` on a mesh of `sizes`; with `rl`, of
    `shipyard rl`'s trainer for `cfg`'s model (`sizes`: its mesh, see `rl_mesh`) and the rollout
    engine and KL reference beside it; with a `target` (`parallel.targets.Target`), compiled by the
    target's own compiler (`shipyard.plan_target`) instead of on fake CPU devices."""
    sizes = _all_axes(sizes)
    if target is not None and math.prod(sizes.values()) != target.devices:
        raise ConfigError(
            f"--mesh: axis sizes {sizes} multiply to {math.prod(sizes.values())}, but {target.spec} has "
            f"{target.devices} devices; give a mesh of that many (-1 in the config's mesh fills it)"
        )
    if target is not None:
        from shipyard.train.program import check_precision

        check_precision(cfg, target.platform)
    if rl is not None:
        cfg = rl_train_config(cfg, rl)
        if cfg.data.seq_len <= rl.max_tokens:
            raise ConfigError(
                f"--rl: max_tokens={rl.max_tokens} leaves no room for a prompt in data.seq_len="
                f"{cfg.data.seq_len} (the rollout's prompt + reply length)"
            )
        if cfg.train.global_batch_size % (sizes["data"] * sizes["fsdp"]):
            raise ConfigError(
                f"--rl: prompts_per_step x group_size = {cfg.train.global_batch_size} rows do not split "
                f"over data x fsdp = {sizes['data'] * sizes['fsdp']} devices"
            )
    cfg = cfg.model_copy(update={"mesh": MeshConfig(**sizes, rules=cfg.mesh.rules)})
    batch_split = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    if cfg.train.global_batch_size % (cfg.train.microbatches * batch_split):
        raise ConfigError(
            f"train.global_batch_size: {cfg.train.global_batch_size} does not split into "
            f"{cfg.train.microbatches} microbatches over data x fsdp x expert = {batch_split} devices"
        )
    out = analytic(cfg, sizes, device, tokens, mfu, rl)
    if with_compiled and target is not None:
        _target_compiled(out, cfg, sizes, compile_layers, target)
    elif with_compiled:
        target = cfg
        moe = cfg.model.moe
        if moe is not None and moe.capacity_factor is None and device.name != "cpu":
            # XLA CPU lowers a dropless grouped matmul either as every expert on every
            # row (ragged_dot) or with per-block weight copies (blocked); neither is what
            # a GPU/TPU grouped GEMM allocates. Capacity buffers of 1.25 x the routed rows are.
            model = cfg.model.model_copy(update={"moe": moe.model_copy(update={"capacity_factor": 1.25})})
            target = cfg.model_copy(update={"model": model})
        moe_stand_in = target is not cfg
        if out["attention_impl"] in ("cudnn", "splash"):
            # The child compiles on CPU, where the vendor kernels do not exist; blocked attention
            # holds the same one key block of scores per query.
            model = target.model.model_copy(update={"attention_impl": "blocked"})
            target = target.model_copy(update={"model": model})
        out["compiled"] = compiled(target, sizes, compile_layers)
        out["compiled"]["moe_stand_in"] = moe_stand_in
        out["compiled"]["attention_stand_in"] = (
            out["attention_impl"] if target.model.attention_impl != cfg.model.attention_impl else None
        )
    fits, advice = verdict(out, device.memory_bytes, cfg)
    out.update(fits=fits, advice=advice)
    if rl is not None:
        out["rl"]["verdict_bytes"] = judged_bytes(out)
    return out


def _target_compiled(out: dict, cfg: Config, sizes: dict, compile_layers: int | None, target) -> None:
    """The compiled section of a target plan: the step compiled by the target's compiler, its
    collectives and the roofline (plan_target.py)."""
    from shipyard import plan_target

    c = compiled(cfg, sizes, compile_layers, runner=lambda cfg, sizes: plan_target.run_child(cfg, target))
    # Vendor kernels (splash, cuDNN attention) are opaque in the HLO: their FLOPs are the analytic
    # attention term of flops_per_token (scores and values, forward and backward, the whole matrix).
    m, seq = cfg.model, cfg.data.seq_len
    attention = 12 * m.num_layers * seq * m.num_heads * m.head_dim * cfg.train.global_batch_size * seq
    attention /= out["devices"]
    kernel_flops = attention if any("splash" in k or "fmha" in k for k in c["kernels"]) else 0.0
    if m.moe is not None and any("ragged" in k or "gmm" in k for k in c["kernels"]):
        # XLA:TPU runs ragged_dot as a Mosaic grouped-matmul kernel: the routed experts' matmuls
        # (6 x top-k x 3 projections, forward and backward) are inside it.
        routed = 6 * m.moe.experts_per_token * 3 * m.hidden_size * m.moe.expert_intermediate_size
        kernel_flops += routed * m.num_moe_layers * cfg.train.global_batch_size * seq / out["devices"]
    out["compiled"] = c
    out["target"] = {"spec": target.spec, "chip": target.chip.name, "platform": target.platform,
                     "chips": target.chips, "source": target.chip.source}  # fmt: skip
    out["roofline"] = plan_target.roofline(c, target, out["flops_per_step"] / out["devices"], kernel_flops)


def compare_table(plans: list[tuple[str, dict]]) -> str:
    """Plans of one model on several layouts, side by side: what each device holds, the bubble,
    the step time and the verdict."""

    def peak(p):
        c = p.get("compiled") or {}
        return judged_bytes(p) if p.get("rl") else c.get("peak_bytes") or p["bytes"]["total"]

    def layout(p):
        return " x ".join(f"{k}={v}" for k, v in p["mesh"].items() if v > 1) or "1 device"

    rows = [
        ("layout", layout),
        ("devices", lambda p: f"{p['devices']:,} x {p['device']['name']}"),
        (
            "state per device",
            lambda p: _fmt(p["bytes"]["params"] + p["bytes"]["grads"] + p["bytes"]["optimizer"]),
        ),
        ("activations", lambda p: _fmt(p["bytes"]["activations"])),
        ("logits", lambda p: _fmt(p["bytes"]["logits"])),
        (
            "peak per device",
            lambda p: (
                _fmt(peak(p))
                + (" (compiled)" if p.get("compiled") else " (analytic)")
                + (" + rollout" if p.get("rl") and p.get("compiled") else "")
            ),
        ),
        ("pipeline bubble", lambda p: f"{p['pipeline']['bubble']:.1%}" if p.get("pipeline") else "-"),
        ("step time", lambda p: f"{p['step_seconds']:.3g} s at {p['mfu']:.0%} MFU"),
        ("tokens/s", lambda p: f"{p['tokens_per_second']:,.0f}"),
        ("fits", lambda p: "yes" if p["fits"] else "NO"),
    ]
    names = [name for name, _ in plans]
    cells = [[label] + [fn(p) for _, p in plans] for label, fn in rows]
    widths = [max(len(r[i]) for r in cells + [[""] + names]) for i in range(len(plans) + 1)]
    head = "  ".join(x.ljust(w) for x, w in zip(["", *names], widths))
    return "\n".join([head] + ["  ".join(x.ljust(w) for x, w in zip(r, widths)) for r in cells])


def _quantized_line(q: dict | None) -> list[str]:
    """The QLoRA line under `params`: the quantized base's bytes per parameter, scales included."""
    if not q:
        return []
    return [
        f"    of which the {q['mode']} base (attention + MLP weights): {_fmt(q['bytes'])} for {q['params']:,.0f} "
        f"params = {q['bytes'] / max(q['params'], 1):.3g} B/param with scales (fp32: {_fmt(q['fp32_bytes'])}); "
        "embedding, norms, head, MoE experts and adapters fp32"
    ]


def _pipeline_line(pipe: dict | None) -> list[str]:
    if not pipe:
        return []
    return [
        f"pipeline: {pipe['stages']} stages x {pipe['repeats']} repeat(s), {pipe['microbatches']} microbatches: "
        f"bubble {pipe['bubble']:.1%} of each step idle (counted in the step time below)"
    ]


def _rl_head(rl: dict | None) -> list[str]:
    """With --rl: what the planned trainer step is."""
    if not rl:
        return []
    return [
        f"rl trainer: {rl['prompts_per_step']} prompts x {rl['group_size']} replies = {rl['rows']} rows of "
        f"data.seq_len={rl['seq_len']} tokens (prompt + reply) in one update, AdamW, fp32; finetune: {rl['finetune']}"
    ]


def _rl_lines(rl: dict | None, b: dict) -> list[str]:
    """With --rl: the KL reference and the rollout engine's bytes (analytic, first device)."""
    if not rl:
        return []
    layers, rows, slots, heads, dims = rl["kv_cache_shape"]
    kinds = {"full": "the starting params", "lora": "the starting LoRA adapters"}
    what = kinds.get(rl["finetune"], "the starting trained layers")
    reference = (
        f"(beta={rl['beta']:g}: {what}, fp32, sharded like them)"
        if rl["beta"]
        else "(beta=0: no reference copy kept)"
    )
    return [
        f"  reference     {_fmt(b['reference'])}  {reference}",
        f"  rollout KV    {_fmt(b['rollout_kv'])}  (the engine's fp32 cache: 2 x [{layers:,} layers, "
        f"{rows:,} rows (max_batch), {slots:,} slots (data.seq_len), {heads:,} kv heads, {dims:,} dims])",
        f"  rollout copy  {_fmt(b['rollout_params'])}  "
        + (
            "(the engine shares the trainer's weights: full training on one device)"
            if rl["engine_shares_params"]
            else "(the engine's fp32 copy of the merged weights)"
        ),
    ]


def render(p: dict) -> str:
    """The plan as text a person reads."""
    target = []
    if p.get("roofline"):
        from shipyard import plan_target

        target = [
            *plan_target.collective_lines(p["compiled"], p["target"]["platform"]),
            *plan_target.time_lines(p),
        ]
    lines = [*_analytic_lines(p), *_compiled_lines(p), *target, *_time_lines(p), _verdict_line(p)]
    return "\n".join(lines)


def _analytic_lines(p: dict) -> list[str]:
    """The mesh, the parameters, and the analytic per-device bytes, attention and pipeline."""
    b, bpp, rl = p["bytes"], p["bytes_per_param"], p.get("rl")
    return [
        f"mesh {p['mesh']} = {p['devices']} x {p['device']['name']} ({_fmt(p['device']['memory_bytes'])} each)",
        f"parameters: {p['params_total']:,} total, {p['params_active']:,} active per token",
        f"train state per parameter: params {bpp['params']:.3g} B "
        f"({'fp32 master' if not p.get('quantized_base') else 'fp32 adapters and the rest, quantized base'}) + grads {bpp['grads']:.3g} B "
        f"+ optimizer {bpp['optimizer']:.3g} B = {sum(bpp.values()):.3g} B; unsharded "
        f"{p['params_total']:,} x {sum(bpp.values()):.3g} B = {p['params_total'] * sum(bpp.values()) / 1e9:,.1f} GB",
        *_rl_head(rl),
        "per device (analytic):"
        if not rl
        else "per device (analytic; the mesh's first device, which also hosts the rollout engine):",
        f"  params        {_fmt(b['params'])}",
        *_quantized_line(p.get("quantized_base")),
        f"  grads         {_fmt(b['grads'])}",
        f"  optimizer     {_fmt(b['optimizer'])}",
        f"  compute copy  {_fmt(b['compute_copy'])}",
        *(
            [
                f"  reference     {_fmt(b['reference'])}  (DPO on_the_fly: the starting trainable params, compute dtype)"
            ]
            if b.get("reference") and not rl
            else []
        ),
        f"  activations   {_fmt(b['activations'])}  ({p['microbatch_tokens_per_device']:,.0f} tokens per microbatch per device"
        + (f", {p['stage_layers']} layers per pipeline stage)" if p.get("pipeline") else ")"),
        f"  logits        {_fmt(b['logits'])}  (the loss: fp32, {p['logit_tokens']:,.0f} tokens at once"
        + (", train.loss_chunk_tokens" if p["logit_tokens"] < p["microbatch_tokens_per_device"] else "")
        + f"; the head's gradient accumulator, and of its {_fmt(p['loss_transient'])} of transients only"
        " what exceeds a layer's backward, which starts after the loss ends)",
        *(
            [
                f"  offloaded     -{_fmt(b['offloaded'])} held in host memory (train.offload), "
                f"+{_fmt(b['offload_streamed'])} streamed through the device for the update"
            ]
            if b.get("offloaded")
            else []
        ),
        *_rl_lines(rl, b),
        f"  total         {_fmt(b['total'])}",
        f"attention: {p['attention_impl']} (scores of {p['attention_keys']:,.0f} keys per query at once"
        + (f"; a ring over context={p['context']})" if p["context"] > 1 else ")"),
        *_pipeline_line(p.get("pipeline")),
    ]


def _compiled_lines(p: dict) -> list[str]:
    """XLA's per-device bytes and FLOPs of the compiled step (when there is one), its stand-ins, and
    with --rl what the verdict adds to its peak."""
    c, rl = p.get("compiled"), p.get("rl")
    lines: list[str] = []
    if c:
        how = (
            f" (extrapolated from {c['compiled_layers'][0]} and {c['compiled_layers'][1]} layers"
            + (
                f", pipeline repeats={c['compiled_repeats']}"
                if p.get("pipeline") and c.get("compiled_repeats") != p["pipeline"]["repeats"]
                else ""
            )
            + ")"
            if c["extrapolated"]
            else ""
        )
        t = p.get("target")
        where = (
            f"XLA:{t['platform'].upper()}, compiled for {t['spec']} without the chips"
            if t
            else f"XLA, compiled on {p['devices']} fake CPU devices: the CPU compiler's view"
        )
        lines += [
            f"per device ({where}){how}:",
            f"  arguments     {_fmt(c['argument_bytes'])}  (params {_fmt(c['params_bytes'])}, optimizer+counters {_fmt(c['optimizer_bytes'])})",
            f"  temporaries   {_fmt(c['temp_bytes'])}",
            f"  outputs       {_fmt(c['output_bytes'])}  ({_fmt(c['alias_bytes'])} aliased to donated arguments)",
            f"  peak          {_fmt(c['peak_bytes'])}" + ("  (the compiler's heap simulation)" if t else ""),
            *(_target_flops_lines(p) if t else []),
            *(
                []
                if t
                else [
                    f"  FLOPs/step    {c['flops_per_device']:.4g} per device (XLA cost analysis; a scanned layer counts once)"
                ]
            ),
        ]
    if c and c.get("attention_stand_in"):
        lines.append(
            f"  (attention compiled as blocked, standing in for {c['attention_stand_in']}: "
            "the vendor kernel does not exist on the CPU the plan compiles on)"
        )
    if c and c.get("moe_stand_in"):
        lines.append(
            "  (MoE experts compiled in capacity mode, factor 1.25, standing in for the GPU/TPU "
            "grouped matmul: XLA CPU lowers dropless expert matmuls differently)"
        )
    if c and rl:
        lines.append(
            f"  + rl          {_fmt(judged_bytes(p) - c['peak_bytes'])}  (rollout KV + rollout copy + reference: "
            f"not in the compiled trainer step, added to its peak for the verdict) = {_fmt(judged_bytes(p))}"
        )
    return lines


def _target_flops_lines(p: dict) -> list[str]:
    """A target compile's FLOPs and memory traffic per device, and what they were counted from."""
    c, r = p["compiled"], p["roofline"]
    xla = (
        f"; XLA's cost analysis says {c['xla_flops']:.4g}, a loop body once"
        if c.get("xla_flops")
        else "; XLA's cost analysis gives none for this target"
    )
    kernels = ", ".join(f"{k} x{v:.0f}" for k, v in sorted(c["kernels"].items()))
    lines = [
        f"  FLOPs/step    {c['hlo_flops']:.4g} per device (matmuls in the compiled HLO, loops x trips{xla})"
    ]
    if c.get("hlo_fp8_flops"):
        lines.append(
            f"  of them fp8   {c['hlo_fp8_flops']:.4g} (matmuls with float8 operands: train.precision=fp8)"
        )
    if kernels:
        lines.append(
            f"  + kernels     {r['kernel_flops']:.4g} (analytic attention, in vendor kernels: {kernels})"
        )
    lines.append(
        f"  HBM traffic   {_fmt(c['traffic_bytes'])} per device (bytes each kernel reads and writes)"
    )
    if c.get("unknown_loops"):
        lines.append(f"  ({c['unknown_loops']} loop(s) of unknown trip count counted once)")
    return lines


def _time_lines(p: dict) -> list[str]:
    """FLOPs, the step time and throughput at the plan's MFU, and the token budget's days."""
    lines = [
        f"FLOPs: {p['flops_per_token']:.4g} per token (6 x active params + attention), {p['flops_per_step']:.4g} per step",
        *_fp8_line(p),
        f"at {p['mfu']:.0%} MFU: {p['step_seconds']:.3g} s per step, {p['tokens_per_second']:,.0f} tokens/s",
    ]
    if "token_budget" in p:
        lines.append(
            f"{p['token_budget']:.3g} tokens: {p['days']:,.1f} days, {p['device_hours']:,.0f} device-hours"
        )
    return lines


def _fp8_line(p: dict) -> list[str]:
    share = p.get("fp8_flop_share", 0.0)
    if not share:
        return []
    peak = p["device"].get("fp8_flops")
    where = (
        f"at the fp8 peak ({peak:.4g} FLOP/s)" if peak else "at the bf16 peak: this device has no fp8 units"
    )
    return [f"fp8 matmuls: {share:.1%} of the FLOPs (attention and MLP projections), {where}"]


def _verdict_line(p: dict) -> str:
    """Whether the step fits the device's memory (the compiled peak when there is one), and what to
    change when it does not."""
    b, c, rl = p["bytes"], p.get("compiled"), p.get("rl")
    if p["fits"] and rl:
        return (
            f"verdict: fits ({_fmt(judged_bytes(p))} of {_fmt(p['device']['memory_bytes'])} on the mesh's first "
            "device, rollout engine and reference included)"
        )
    if p["fits"]:
        return f"verdict: fits ({_fmt((c or {}).get('peak_bytes') or b['total'])} of {_fmt(p['device']['memory_bytes'])} per device)"
    if rl:
        return (
            f"verdict: does NOT fit in {_fmt(p['device']['memory_bytes'])} on the mesh's first device "
            f"({_fmt(judged_bytes(p))}, rollout engine and reference included); " + "; ".join(p["advice"])
        )
    advice = "; ".join(p["advice"])
    return f"verdict: does NOT fit in {_fmt(p['device']['memory_bytes'])} per device; {advice}"


# ----------------------------------------------------------------------------- measured


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _measure_child(cfg_yaml: str) -> dict:
    """Peak memory of real train steps on one CPU device, from the process's resident set.

    XLA's CPU runtime allocates each execution's temporaries and outputs with
    malloc and frees them after; large blocks are mmap-ed, so they appear in
    and leave the resident set. After a warm-up step (compilation and
    first-touch costs), a thread samples RSS every 0.2 ms while three steps
    run; peak = the live train state + batch (resident before the step) +
    (highest sample - RSS before the steps).
    """
    import threading
    import time

    import jax
    import jax.numpy as jnp

    from shipyard.config import build_config, read_yaml
    from shipyard.model.params import init_params
    from shipyard.model.transformer import param_specs
    from shipyard.train.optim import build_optimizer
    from shipyard.train.step import init_state, make_train_step

    cfg = build_config(read_yaml(cfg_yaml, "plan config"))
    specs = param_specs(cfg.model)
    optimizer = build_optimizer(cfg.train, specs)
    state = init_state(cfg, init_params(specs, jax.random.key(0)), optimizer)
    B, S = cfg.train.global_batch_size, cfg.data.seq_len
    batch = {
        "tokens": jax.random.randint(jax.random.key(1), (B, S + 1), 0, cfg.model.vocab_size),
        "loss_mask": jnp.ones((B, S), jnp.float32),
    }
    step = jax.jit(make_train_step(cfg, optimizer), donate_argnums=0)
    state, m = step(state, batch)
    jax.block_until_ready((state, m))
    live = sum(x.nbytes for x in jax.tree.leaves((state, batch)))
    time.sleep(0.2)
    base, peak, running = _rss(), 0, True

    def sample():
        nonlocal peak
        while running:
            peak = max(peak, _rss())
            time.sleep(0.0002)

    t = threading.Thread(target=sample)
    t.start()
    for _ in range(3):
        state, m = step(state, batch)
        jax.block_until_ready((state, m))
    running = False
    t.join()
    return {"live_bytes": live, "step_bytes": max(peak - base, 0), "peak_bytes": live + max(peak - base, 0)}


def measured_peak(cfg: Config) -> dict:
    """Measured peak bytes of a real train step of `cfg` on one CPU device (see `_measure_child`)."""
    from shipyard.config import to_yaml

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = " ".join(
        f for f in env.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f
    )
    proc = subprocess.run(
        [sys.executable, "-m", "shipyard.plan", "--measure"],
        input=json.dumps({"config": to_yaml(cfg)}),
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        raise ConfigError(f"plan: measuring a train step failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        payload = json.loads(sys.stdin.read())
        print(json.dumps(_compiled_child(payload["config"], payload["mesh"])))
    elif sys.argv[1:] == ["--measure"]:
        payload = json.loads(sys.stdin.read())
        print(json.dumps(_measure_child(payload["config"])))
