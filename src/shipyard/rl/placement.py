"""Where an RL run's arrays live: one device, or a data x fsdp mesh for the trainer (rl.mesh).

On a mesh the trainable and frozen params are sharded by their specs' logical axes under the one
rules table (parallel/mesh.py: `embed` over fsdp), each batch's rows are split over data x fsdp, and
the forward pins the residual stream's layout (parallel/layout.py), as `shipyard train` does. The
rollout engine is not sharded: it runs on the mesh's first device with the merged weights gathered
there after each update (`engine_params`). Without a mesh everything stays on the default device and,
for full training, the engine reads the trainer's own buffers (no copy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
from jax.sharding import NamedSharding

from shipyard.config import ModelConfig, RLConfig
from shipyard.errors import ConfigError
from shipyard.model.params import param_shardings
from shipyard.model.partition import Partition
from shipyard.parallel.layout import Layout
from shipyard.parallel.mesh import logical_to_pspec, make_mesh, rules_for


@dataclass(frozen=True, eq=False)  # holds shardings: compared by identity
class Placement:
    """The trainer's placement; see the module doc. Built by `placement_for`."""

    partition: Partition
    """What trains (rl.finetune): the trainable / frozen split of the params."""
    layout: Layout | None
    """The trainer's layout on its mesh (None: one device, no constraints)."""
    trainable: object = None
    """Shardings of the trainable tree (None without a mesh)."""
    frozen: object = None
    """Shardings of the frozen tree (None without a mesh, or with full training)."""
    batch: NamedSharding | None = None
    """Sharding of a batch's [rows, ...] arrays: rows over data x fsdp (None without a mesh)."""
    merge: object = None
    """(trainable, frozen) -> plain params with the adapters folded in, jitted (None for full training)."""

    def put(self, trainable, frozen) -> tuple:
        """(trainable, frozen) on their shardings (as they are without a mesh)."""
        if self.layout is None:
            return trainable, frozen
        frozen = None if frozen is None else jax.device_put(frozen, self.frozen)
        return jax.device_put(trainable, self.trainable), frozen

    def put_batch(self, batch):
        """A batch dict (or one array) with its rows split over the mesh."""
        if self.layout is None:
            return jax.tree.map(jax.numpy.asarray, batch)
        return jax.tree.map(lambda x: jax.device_put(x, self._rows(x.ndim)), batch)

    def _rows(self, ndim: int) -> NamedSharding:
        spec = self.batch.spec
        return NamedSharding(self.batch.mesh, type(spec)(spec[0], *([None] * (ndim - 1))))

    def engine_params(self, trainable, frozen):
        """The weights the rollout engine decodes with: adapters folded in, on the engine's device."""
        merged = trainable if self.merge is None else self.merge(trainable, frozen)
        if self.layout is None:
            return merged
        return jax.device_put(merged, self.layout.mesh.devices.flat[0])


def placement_for(model: ModelConfig, rl: RLConfig, length: int, devices=None) -> Placement:
    """The placement of an RL run whose batches are prompts_per_step x group_size rows of `length`
    tokens, on `devices` (default: all of JAX's; a target's compile-only ones to lower the update
    for it, rl/target.py); ConfigError in one line when the mesh does not fit the devices or the rows."""
    partition = Partition(model, rl.finetune)
    merge = None if partition.kind == "full" else jax.jit(partition.merged_for_export)
    if rl.mesh is None:
        return Placement(partition, None, merge=merge)
    mesh = make_mesh(rl.mesh, devices)
    rules = rules_for(rl.mesh)
    rows = rl.prompts_per_step * rl.group_size
    split = math.prod(mesh.shape[a] for a in ("data", "fsdp"))
    if rows % split:
        raise ConfigError(
            f"rl: prompts_per_step x group_size = {rows} rows do not split over the mesh's data x fsdp = "
            f"{split} devices; choose a multiple"
        )
    layout = Layout(
        mesh=mesh, rules=rules, hidden_size=model.hidden_size, seq_len=length - 1, schedule=None, order=None
    )
    batch = NamedSharding(mesh, logical_to_pspec(("batch", "seq"), (rows, length), mesh, rules))
    return Placement(
        partition,
        layout,
        trainable=param_shardings(partition.trainable_specs(), mesh, rules),
        frozen=partition.frozen_shardings(mesh, rules),
        batch=batch,
        merge=merge,
    )
