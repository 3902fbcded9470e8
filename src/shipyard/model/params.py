"""Parameters as spec trees.

A model describes its parameters once, as a pytree of `ArraySpec` leaves. From
that one tree come the abstract shapes (planning, checkpoint restore), the
shardings (logical axes through the mesh rules) and the initialised arrays,
which are created by a jitted function with sharded outputs so no parameter is
ever materialised whole on one device.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from shipyard.parallel.mesh import Rules, logical_to_pspec

# weight: hidden matrices; bias: additive vectors (never decayed); router: MoE router (AdamW even under Muon); buffer:
# state kept with the params but moved by a rule, not by gradients (MoE
# selection biases: their gradient is zero and they are never decayed).
# adapter: LoRA A/B matrices (AdamW, decayed like weights).
Role = Literal["weight", "embedding", "head", "norm", "bias", "router", "buffer", "adapter"]


@dataclass(frozen=True)
class ArraySpec:
    """Everything known about one parameter array before it exists."""

    shape: tuple[int, ...]
    """Array shape."""
    logical_axes: tuple[str | None, ...]
    """One logical axis name per dimension (`embed`, `heads`, ...), mapped to mesh axes by the rules."""
    init: Literal["normal", "zeros", "ones"]
    """Initialiser kind."""
    std: float = 0.0
    """Standard deviation for `normal`."""
    role: Role = "weight"
    """What the array is for; the optimizer uses it (weight decay mask, Muon vs AdamW)."""
    fan_in_axes: tuple[int, ...] = ()
    """Dimensions contracted with the input (Muon orthogonalises over fan-in x the rest)."""
    dtype: Any = jnp.float32
    """Storage dtype (master weights are fp32)."""

    def __post_init__(self):
        if len(self.shape) != len(self.logical_axes):
            raise ValueError(f"shape {self.shape} and logical axes {self.logical_axes} differ in rank")

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def is_spec(x: Any) -> bool:
    return isinstance(x, ArraySpec)


def map_specs(fn, specs, *rest):
    """tree_map over a spec tree, treating ArraySpec as leaves."""
    return jax.tree.map(fn, specs, *rest, is_leaf=is_spec)


def count_params(specs) -> int:
    """Exact number of scalars in the parameter tree."""
    return sum(s.size for s in jax.tree.leaves(specs, is_leaf=is_spec))


def param_shardings(specs, mesh: Mesh, rules: Rules):
    return map_specs(
        lambda s: NamedSharding(mesh, logical_to_pspec(s.logical_axes, s.shape, mesh, rules)),
        specs,
    )


def abstract_params(specs, shardings=None):
    """ShapeDtypeStruct tree (with shardings when given): no memory is touched."""
    if shardings is None:
        return map_specs(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), specs)
    return map_specs(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        specs,
        shardings,
    )


def _init_one(spec: ArraySpec, key: jax.Array) -> jax.Array:
    if spec.init == "zeros":
        return jnp.zeros(spec.shape, spec.dtype)
    if spec.init == "ones":
        return jnp.ones(spec.shape, spec.dtype)
    return (spec.std * jax.random.normal(key, spec.shape, jnp.float32)).astype(spec.dtype)


def init_params(specs, key: jax.Array, shardings=None):
    """Initialise every array, already laid out with `shardings` if given.

    Each array's key is derived from its tree path, not its position, so adding
    a parameter elsewhere never changes how the others are initialised.
    """
    paths_specs = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]
    treedef = jax.tree.structure(specs, is_leaf=is_spec)
    path_ids = [zlib.crc32(jax.tree_util.keystr(p).encode()) for p, _ in paths_specs]

    def build(key):
        leaves = [_init_one(s, jax.random.fold_in(key, pid)) for (_, s), pid in zip(paths_specs, path_ids)]
        return jax.tree.unflatten(treedef, leaves)

    return jax.jit(build, out_shardings=shardings)(key)
