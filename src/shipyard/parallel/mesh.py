"""The device mesh and the one table mapping logical axes to mesh axes.

Arrays name their dimensions with logical axes; this table says which mesh
axes each logical axis is split over. Changing the parallelism of a run means
changing the mesh shape (config) or this table, never model code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from shipyard.config import MESH_AXIS_NAMES, MeshConfig
from shipyard.errors import ConfigError

MESH_AXES = MESH_AXIS_NAMES

Rules = Mapping[str, tuple[str, ...]]

# Default rules: FSDP shards parameters along `embed`; tensor parallelism splits
# heads, MLP width and vocabulary; the batch is split over every axis that
# holds a different data slice; context parallelism splits the sequence.
DEFAULT_RULES: Rules = {
    "batch": ("data", "fsdp", "expert"),
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "experts": ("expert",),
    "expert_mlp": ("tensor",),
    "seq": ("context",),
    "head_dim": (),
    # Pipeline stages hold contiguous blocks of layers (parallel/pipeline.py regroups them per step).
    "layers": ("pipeline",),
    "lora_rank": (),
}


def rules_for(cfg: MeshConfig) -> Rules:
    """The default table with the config's overrides applied."""
    return {**DEFAULT_RULES, **{k: tuple(v) for k, v in cfg.rules.items()}}


def resolve_mesh_shape(cfg: MeshConfig, num_devices: int) -> dict[str, int]:
    sizes = {name: getattr(cfg, name) for name in MESH_AXES}
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if -1 in sizes.values():
        if num_devices % fixed:
            raise ConfigError(
                f"mesh: fixed axis sizes multiply to {fixed}, which does not divide the {num_devices} devices"
            )
        sizes = {k: (num_devices // fixed if v == -1 else v) for k, v in sizes.items()}
    elif fixed != num_devices:
        raise ConfigError(f"mesh: axis sizes multiply to {fixed} but {num_devices} devices are available")
    return sizes


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_mesh_shape(cfg, len(devices))
    grid = np.array(devices, dtype=object).reshape([sizes[a] for a in MESH_AXES])
    return Mesh(grid, MESH_AXES)


def logical_to_pspec(
    logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: Rules
) -> PartitionSpec:
    """PartitionSpec for an array with these logical axes.

    A mesh axis is used at most once per array (first dimension wins), size-1
    mesh axes are dropped, and a dimension whose size the mesh axes do not
    divide stays replicated rather than failing: e.g. 2 KV heads on tensor=4.
    """
    used: set[str] = set()
    out = []
    for name, dim in zip(logical_axes, shape):
        axes = tuple(a for a in rules.get(name, ()) if a not in used and mesh.shape[a] > 1) if name else ()
        if axes and dim % math.prod(mesh.shape[a] for a in axes) == 0:
            used.update(axes)
            out.append(axes[0] if len(axes) == 1 else axes)
        else:
            out.append(None)
    return PartitionSpec(*out)
