"""Host offload of the train state (train.offload): optimizer state and master params in pinned host memory.

Each offloaded leaf keeps its sharding but has `memory_kind="pinned_host"`:
`init_state` places it there (so the shardings `program.abstract_state`
derives from compiling the init, what the train step's in/out shardings
and checkpoint restores use, say pinned_host), and inside the jitted step
`to_device` streams it to device memory where it is read and `to_host`
sends the new value back. Only arrays with at least one dimension move:
scalar counters (Adam's step count) stay on the device, where control flow
reads them. Whether the transfers overlap compute is XLA's scheduling; on
GPU/TPU the device then holds the offloaded state only while it is used.

A backend without a pinned_host memory is refused in one line (`check`).
JAX's CPU backend has one (its memories: device, pinned_host,
unpinned_host, all the same RAM), so CPU runs and tests offloaded steps;
it saves nothing there, and its compiled memory analysis counts host and
device bytes together.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax

from shipyard.config import OffloadConfig
from shipyard.errors import ConfigError

HOST = "pinned_host"
"""The memory kind offloaded state lives in."""


def check(offload: OffloadConfig, devices: Sequence[jax.Device]) -> None:
    """ConfigError when train.offload asks for host memory a device's backend does not have."""
    if not (offload.optimizer or offload.params):
        return
    for device in devices:
        kinds = sorted(m.kind for m in device.addressable_memories())
        if HOST not in kinds:
            raise ConfigError(
                f"train.offload: the {device.platform} backend's devices have no {HOST} memory "
                f"(they have {', '.join(kinds) or 'none'}); offload needs a backend with host memory "
                "kinds (GPU, TPU, or JAX's CPU backend); set train.offload.optimizer and params to false"
            )


def _movable(x) -> bool:
    return getattr(x, "ndim", 0) > 0


def to_host(tree):
    """Inside jit: every array leaf with a dimension moved to pinned host memory (same sharding)."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Host) if _movable(x) else x, tree)


def to_device(tree):
    """Inside jit: every array leaf with a dimension moved to device memory (a no-op where it is)."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device) if _movable(x) else x, tree)


def _local_bytes(a) -> float:
    sharding = getattr(a, "sharding", None)
    shape = sharding.shard_shape(a.shape) if sharding is not None else a.shape
    return float(math.prod(shape) * a.dtype.itemsize)


def _host_bytes(tree) -> float:
    return sum(
        _local_bytes(a)
        for a in jax.tree.leaves(tree)
        if getattr(getattr(a, "sharding", None), "memory_kind", None) == HOST
    )


def host_state_bytes(abstract_state) -> dict[str, float]:
    """Bytes per device of the train state held in pinned host memory, by part: {"params": ...,
    "optimizer": ...} (zeros without offload). `abstract_state` is `TrainProgram.abstract_state`
    (or real state arrays): what the planner moves off the device's budget."""
    return {"params": _host_bytes(abstract_state.params), "optimizer": _host_bytes(abstract_state.opt_state)}
