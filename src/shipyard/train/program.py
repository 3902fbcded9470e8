"""The train program of a config on a mesh: shardings, abstract state and batch, the jitted steps.

One builder serves `shipyard train` (which then feeds real arrays to the
steps) and `shipyard plan` (which lowers the same train step with the
abstract inputs and reads XLA's memory and cost analysis), so what the plan
compiles is what training runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shipyard.config import Config
from shipyard.data.chat_format import BATCH_KEYS
from shipyard.data.preference import PREFERENCE_BATCH_KEYS, pair_slots
from shipyard.errors import ConfigError
from shipyard.model.attention import attention_impl
from shipyard.model.params import abstract_params, param_shardings
from shipyard.model.partition import Partition
from shipyard.parallel.context import check_config as check_context
from shipyard.parallel.layout import Layout, layout_for
from shipyard.parallel.mesh import logical_to_pspec, make_mesh
from shipyard.train import offload
from shipyard.train.optim import build_optimizer
from shipyard.train.step import (
    TrainState,
    init_state,
    make_eval_step,
    make_preference_eval_step,
    make_reference_step,
    make_train_step,
)

PRETRAIN_BATCH_KEYS = ("tokens", "loss_mask")
"""The arrays of a pretraining batch (a packed chat batch has chat_format.BATCH_KEYS)."""

_BATCH_DTYPES = {
    "tokens": jnp.int32,
    "loss_mask": jnp.float32,
    "segment_ids": jnp.int32,
    "positions": jnp.int32,
    "slots": jnp.int32,
    "pair_mask": jnp.float32,
    "ref_logps": jnp.float32,
}


@dataclass(frozen=True)
class TrainProgram:
    """Everything about a run that follows from its config and mesh, nothing that holds data."""

    cfg: Config
    layout: Layout
    """Mesh, rules, pipeline schedule, context order and activation shardings (parallel/layout.py)."""
    partition: Partition
    specs: Any
    """Spec tree of the trainable params (what the optimizer, shardings and checkpoint see)."""
    shardings: Any
    """Shardings of the trainable params."""
    frozen_specs: Any
    """Spec tree of the frozen params (None for full training)."""
    frozen_shardings: Any
    optimizer: optax.GradientTransformation
    abstract_state: TrainState
    """The train state's shapes, dtypes and shardings (what a checkpoint is restored into)."""
    batch_shardings: dict[str, NamedSharding]
    abstract_batch: dict[str, jax.ShapeDtypeStruct]
    eval_keys: tuple[str, ...]
    """Batch arrays the eval step reads."""
    eos_id: int | None
    """EOS id document masking splits at (None: off)."""
    train_step: Any
    """Jitted `(state, batch, frozen) -> (state, metrics)`, state donated; with a reference on the fly
    (train.preference.reference: on_the_fly) `(state, batch, frozen, reference)`."""
    eval_step: Any
    """Jitted `(params, frozen, batch) -> (sum of token losses, token count)`; preference tuning:
    `(params, frozen, batch[, reference]) -> PreferenceSums`."""
    reference_step: Any = None
    """Jitted `(trainable, frozen, batch) -> reply log-probs [B, 2P]` (replicated): the reference
    pass of train.preference.reference: cached (None otherwise)."""

    @property
    def mesh(self) -> Mesh:
        return self.layout.mesh

    @property
    def rules(self) -> dict:
        return self.layout.rules

    @property
    def state_shardings(self):
        return jax.tree.map(lambda a: a.sharding, self.abstract_state)

    @property
    def abstract_frozen(self):
        """The frozen params' shapes and shardings (None for full training)."""
        return self.partition.abstract_frozen(self.frozen_shardings)

    @property
    def abstract_reference(self):
        """The on-the-fly reference tree's shapes, dtypes and shardings: the trainable params in the
        compute dtype (None unless train.preference.reference is on_the_fly)."""
        if not reference_on_the_fly(self.cfg):
            return None
        compute = jnp.dtype(self.cfg.train.precision.compute_dtype)
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, compute, sharding=a.sharding), self.abstract_state.params
        )

    def lower_train_step(self):
        """The train step lowered with the abstract inputs (nothing allocated); `.compile()` it."""
        more = () if self.abstract_reference is None else (self.abstract_reference,)
        return self.train_step.lower(self.abstract_state, self.abstract_batch, self.abstract_frozen, *more)


def reference_on_the_fly(cfg: Config) -> bool:
    """Whether each train step runs the DPO reference forward (train.preference.reference: on_the_fly)."""
    pref = cfg.train.preference
    return pref is not None and pref.loss == "dpo" and pref.reference == "on_the_fly"


def reference_cached(cfg: Config) -> bool:
    """Whether the DPO reference log-probs are computed once before step 0 (reference: cached)."""
    pref = cfg.train.preference
    return pref is not None and pref.loss == "dpo" and pref.reference == "cached"


def document_eos_id(cfg: Config, data_eos_id: int | None) -> int | None:
    """The EOS id attention stops at with data.document_masking: data.eos_id, else the data's
    own (`data_eos_id`); None when masking is off or the batches are packed chats."""
    if cfg.data.preference is not None and cfg.data.document_masking:
        raise ConfigError(
            "data.document_masking: preference pairs are packed with their own segment ids (each reply "
            "attends to its own prompt only); set data.document_masking: false"
        )
    if cfg.data.chat is not None or cfg.data.preference is not None or not cfg.data.document_masking:
        return None
    eos_id = cfg.data.eos_id if cfg.data.eos_id is not None else data_eos_id
    if eos_id is None:
        raise ConfigError(
            "data.document_masking: no EOS id known for these sources (a .npy, or shard sets with "
            "different EOS ids); set data.eos_id"
        )
    return eos_id


def abstract_state(cfg: Config, specs, shardings, optimizer) -> TrainState:
    """The train state's shapes, dtypes and shardings on this mesh, without allocating it
    (what a checkpoint is restored into; the shardings are the ones a fresh init produces).

    Shapes from `eval_shape`, shardings from compiling (never running) `init_state` on the
    abstract params at their shardings, which is where `init_params` creates them; leaving the
    random draws out of the compiled function keeps this well under a second.
    """
    params = abstract_params(specs, shardings)

    def make(params):
        return init_state(cfg, params, optimizer, shardings)

    shapes = jax.eval_shape(make, params)
    out_shardings = jax.jit(make).lower(params).compile().output_shardings
    return jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), shapes, out_shardings
    )


def batch_keys(cfg: Config) -> tuple[str, ...]:
    """The arrays of the config's batches: pretraining, packed chats, or packed preference pairs
    (plus each row's cached reference log-probs with train.preference.reference: cached)."""
    if cfg.data.preference is not None:
        return PREFERENCE_BATCH_KEYS + (("ref_logps",) if reference_cached(cfg) else ())
    return BATCH_KEYS if cfg.data.chat is not None else PRETRAIN_BATCH_KEYS


def batch_layout(cfg: Config, mesh: Mesh, rules: dict) -> tuple[dict, dict]:
    """(shardings, abstract arrays) of the global batch, keyed by its arrays: tokens [B, L+1]
    split over the batch axes, the per-position arrays [B, L] (loss mask; packed chats' segment
    ids and positions; pairs' slots) and the per-row ones (pairs' pair_mask [B, P], ref_logps
    [B, 2P]) split the same way along the batch."""
    batch_size, seq_len = cfg.train.global_batch_size, cfg.data.seq_len
    batch_spec = logical_to_pspec(("batch", "seq"), (batch_size, seq_len + 1), mesh, rules)
    if math.prod(mesh.shape[a] for a in rules["batch"]) > 1 and batch_spec[0] is None:
        raise ConfigError(
            f"train.global_batch_size={batch_size} is not divisible by the {mesh.devices.size} "
            "data-parallel devices; choose a multiple"
        )
    keys = batch_keys(cfg)
    tokens = NamedSharding(mesh, batch_spec)
    per_row = NamedSharding(mesh, PartitionSpec(batch_spec[0], None))
    shardings = {k: tokens if k == "tokens" else per_row for k in keys}
    widths = {"tokens": seq_len + 1, "pair_mask": pair_slots(seq_len), "ref_logps": 2 * pair_slots(seq_len)}
    shapes = {k: (batch_size, widths.get(k, seq_len)) for k in keys}
    abstract = {k: jax.ShapeDtypeStruct(shapes[k], _BATCH_DTYPES[k], sharding=shardings[k]) for k in keys}
    return shardings, abstract


def check_offload(cfg: Config, mesh: Mesh) -> None:
    """ConfigError when train.offload cannot run: a backend without pinned host memory
    (`offload.check`), or master params offloaded for preference tuning, whose reference and
    evaluation passes read the state's params without streaming them in."""
    offload.check(cfg.train.offload, list(mesh.devices.flat))
    if cfg.train.offload.params and cfg.train.preference is not None:
        raise ConfigError(
            "train.offload.params: preference tuning (train.preference) reads the params outside the "
            "train step; set train.offload.params: false (train.offload.optimizer works)"
        )


def check_attention(cfg: Config, mesh: Mesh) -> None:
    """ConfigError, before anything is traced, when model.attention_impl names a kernel the mesh's
    backend cannot run for this run's dtype and masks (`attention.attention_impl` says why)."""
    d = cfg.data
    segments = d.document_masking or d.chat is not None or d.preference is not None
    dtype = jnp.dtype(cfg.train.precision.compute_dtype)
    attention_impl(cfg.model, mesh.devices.flat[0].platform, d.seq_len, dtype, segments)


def check_precision(cfg: Config, platform: str) -> None:
    """ConfigError when train.precision.matmul=fp8 is asked of a TPU: v4 to v6e multiply in bf16 and
    int8, not fp8 (on a CPU fp8 is emulated exactly, for tests; GPUs from H100 have fp8 units)."""
    if cfg.train.precision.matmul == "fp8" and platform == "tpu":
        raise ConfigError(
            "train.precision: fp8 matmuls need fp8 units (NVIDIA H100/H200/B200), which TPU v4-v6e do "
            "not have; use train.precision=bf16 on TPU"
        )


def build_program(cfg: Config, mesh: Mesh | None = None, *, eos_id: int | None = None) -> TrainProgram:
    """The train program of `cfg` on `mesh` (default: the config's mesh over all devices).

    `eos_id` is the data's EOS id, used only with data.document_masking (data.eos_id takes
    precedence; see `document_eos_id`). Raises ConfigError when the global batch does not
    split over the data-parallel devices, or context parallelism cannot split the
    sequences (`parallel.context.check_config`). Compiles the state's init (never runs it) for the
    state's shardings.
    """
    check_context(cfg)
    mesh = make_mesh(cfg.mesh) if mesh is None else mesh
    check_offload(cfg, mesh)
    check_attention(cfg, mesh)
    check_precision(cfg, mesh.devices.flat[0].platform)
    layout = layout_for(cfg, mesh)
    rules = layout.rules
    batch_shardings, abstract_batch = batch_layout(cfg, mesh, rules)
    eos_id = document_eos_id(cfg, eos_id)
    partition = Partition(cfg.model, cfg.train.finetune)
    specs, frozen_specs = partition.trainable_specs(), partition.frozen_specs()
    shardings = param_shardings(specs, mesh, rules)
    frozen_shardings = partition.frozen_shardings(mesh, rules)
    optimizer = build_optimizer(cfg.train, specs)
    state = abstract_state(cfg, specs, shardings, optimizer)
    state_shardings = jax.tree.map(lambda a: a.sharding, state)
    reference = state_shardings.params if reference_on_the_fly(cfg) else None
    more = () if reference is None else (reference,)
    train_step = jax.jit(
        make_train_step(cfg, optimizer, eos_id, layout, partition),
        in_shardings=(state_shardings, batch_shardings, frozen_shardings, *more),
        out_shardings=(state_shardings, None),
        donate_argnums=0,
    )
    eval_keys = tuple(batch_shardings) if cfg.data.chat or cfg.data.preference else ("tokens",)
    eval_shardings = (state_shardings.params, frozen_shardings, {k: batch_shardings[k] for k in eval_keys})
    if cfg.data.preference is None:
        eval_step = jax.jit(make_eval_step(cfg, eos_id, layout, partition), in_shardings=eval_shardings)
    else:
        eval_step = jax.jit(
            make_preference_eval_step(cfg, layout, partition), in_shardings=(*eval_shardings, *more)
        )
    reference_step = None
    if reference_cached(cfg):
        pairs = {k: batch_shardings[k] for k in PREFERENCE_BATCH_KEYS}
        reference_step = jax.jit(
            make_reference_step(cfg, layout, partition),
            in_shardings=(state_shardings.params, frozen_shardings, pairs),
            out_shardings=NamedSharding(mesh, PartitionSpec()),  # every process holds every row's
        )
    return TrainProgram(
        cfg=cfg,
        layout=layout,
        partition=partition,
        specs=specs,
        shardings=shardings,
        frozen_specs=frozen_specs,
        frozen_shardings=frozen_shardings,
        optimizer=optimizer,
        abstract_state=state,
        batch_shardings=batch_shardings,
        abstract_batch=abstract_batch,
        eval_keys=eval_keys,
        eos_id=eos_id,
        train_step=train_step,
        eval_step=eval_step,
        reference_step=reference_step,
    )
