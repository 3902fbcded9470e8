"""A program's layout: how its work lies on the devices, decided once from (config, mesh).

Everything the model, the train and eval steps, the start-up banner and the
planner need to know about parallelism travels as one `Layout` value: the
mesh, the logical -> mesh rules, the pipeline schedule, the context order of
sequence positions, and the residual stream's sharding. `layout_for` builds
it (and refuses, in one line, a pipeline the config cannot run); nothing
downstream derives any of these from (config, mesh) again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from shipyard.config import Config
from shipyard.errors import ConfigError
from shipyard.parallel.context import context_size, zigzag_order
from shipyard.parallel.mesh import logical_to_pspec, rules_for
from shipyard.parallel.pipeline import Schedule, check_schedule, schedule_for


@dataclass(frozen=True, eq=False)  # holds arrays: compared and hashed by identity
class Layout:
    """Where one program's arrays and work live. Built by `layout_for`."""

    mesh: Mesh
    """The device mesh (axes data, fsdp, tensor, expert, pipeline, context)."""
    rules: dict
    """Logical axis -> mesh axes (`parallel.mesh.rules_for`): what every spec's sharding follows."""
    hidden_size: int
    """The residual stream's width (the `embed` dimension of `activations`)."""
    seq_len: int
    """Positions per row (the `seq` dimension of `activations`)."""
    schedule: Schedule | None
    """The pipeline schedule (parallel/pipeline.py); None without pipeline parallelism."""
    order: np.ndarray | None
    """The slots the rows' positions come in: the zig-zag order under context parallelism
    (`parallel.context`), in which the train step permutes its batches so that every device of the
    ring gets an equal share of the causal work; None when rows come in their own order. Passes
    that read rows unpermuted (held-out eval, the preference reference) use `in_own_order()`."""

    def activations(self, rows: int) -> NamedSharding:
        """The residual stream's sharding, ("batch", "seq", "embed") under the rules, for a pass over
        `rows` sequences (under a pipeline: the rows of one pipeline microbatch)."""
        shape = (rows, self.seq_len, self.hidden_size)
        return NamedSharding(
            self.mesh, logical_to_pspec(("batch", "seq", "embed"), shape, self.mesh, self.rules)
        )

    def activations_of(self, rows: int) -> NamedSharding:
        """`activations` for a pass given `rows` sequences at once: a pipeline cuts them into its
        microbatches first, and the stream is laid out per microbatch."""
        return self.activations(rows // (self.schedule.microbatches if self.schedule is not None else 1))

    def constrain(self, x: jax.Array) -> jax.Array:
        """Pin `x` [rows, seq, embed] to the residual stream's layout (the partitioner only sees the
        shardings of inputs and outputs otherwise, and may drift into one that gathers the batch)."""
        return jax.lax.with_sharding_constraint(x, self.activations_of(x.shape[0]))

    @property
    def context(self) -> int:
        """How many devices each sequence is split over (1: no context parallelism)."""
        return context_size(self.mesh)

    def in_own_order(self) -> Layout:
        """This layout for rows given in their own order (no context permutation)."""
        return self if self.order is None else replace(self, order=None)


def layout_for(cfg: Config, mesh: Mesh) -> Layout:
    """The layout of `cfg` on `mesh`, checked: ConfigError when mesh.pipeline > 1 has no
    train.pipeline, the layers or the batch do not split as the schedule needs, or only part of the
    model trains (the schedule has no frozen layers or LoRA dropout)."""
    schedule = schedule_for(cfg, mesh)
    if schedule is not None:
        if cfg.train.finetune is not None:
            raise ConfigError(
                "train.pipeline: the pipeline schedule trains every parameter; set train.finetune: null "
                "(or train.pipeline: null and mesh.pipeline=1 to fine-tune)"
            )
        model = cfg.model
        layers = model.num_moe_layers if model.moe is not None else model.num_layers
        check_schedule(schedule, layers, cfg.train.global_batch_size // cfg.train.microbatches)
    context = context_size(mesh)
    return Layout(
        mesh=mesh,
        rules=rules_for(cfg.mesh),
        hidden_size=cfg.model.hidden_size,
        seq_len=cfg.data.seq_len,
        schedule=schedule,
        order=None if context == 1 else zigzag_order(cfg.data.seq_len, context),
    )
