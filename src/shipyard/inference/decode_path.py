"""Which decode step a model runs, and running it on the busy corner of a batch cache.

Dense models on CPU decode with `cpu_decode.decode_step` (fused, unrolled weights; per-layer
head-major caches), everything else with `decode.forward_cached` (the stacked `KVCache`). Both
take tokens [batch, T], the caches, each row's slot and first real slot, and give logits
[batch, T, vocab]. The engine and its draft model (inference/draft_model.py) pick theirs here.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax

from shipyard.config import ModelConfig
from shipyard.inference import cpu_decode
from shipyard.inference.decode import forward_cached


class DecodePath(NamedTuple):
    """How one model decodes (`decode_path`)."""

    prepare: Callable
    """params -> the weights `forward` reads (jitted; the params themselves for forward_cached)."""
    forward: Callable
    """(weights, tokens [B, T], caches, pos [B], start [B]) -> (logits [B, T, vocab], caches)."""
    to_decode: Callable
    """A prefilled `KVCache` -> the caches `forward` takes."""
    axes: dict[str, tuple[int, int]]
    """Each cache array's (row, slot) axes by its field name ("k", "v")."""
    cpu: bool
    """Whether it is `cpu_decode.decode_step`."""


def decode_path(params, cfg: ModelConfig) -> DecodePath:
    """The decode step for `params` of model `cfg` on this backend."""
    if cpu_decode.supported(params, cfg):  # (dense models on CPU)
        return DecodePath(
            jax.jit(partial(cpu_decode.prepare_weights, cfg=cfg)),
            partial(cpu_decode.decode_step, cfg=cfg),
            cpu_decode.to_layer_caches,
            {"k": (0, 3), "v": (0, 2)},  # per-layer head-major caches: k [b, k, d, s], v [b, k, s, d]
            True,
        )
    return DecodePath(
        lambda params: params,
        partial(forward_cached, cfg=cfg),
        lambda cache: cache,
        {"k": (1, 2), "v": (1, 2)},  # KVCache [layers, batch, slots, kv_heads, head_dim]
        False,
    )


def in_corner(fn, rows, caches, n_rows: int, span: int, axes):
    """fn(rows, caches) -> (out, rows, caches) run on the first `n_rows` rows and `span` cache slots
    only (a copy of that corner, written back in place afterwards): (out, all rows, all caches).
    `rows` is any tree of [max_batch, ...] arrays."""
    full_rows, full_caches = rows, caches
    rows = jax.tree.map(lambda x: x[:n_rows], rows)
    caches = map_cache(lambda name, a: _corner(a, *axes[name], n_rows, span), caches)
    out, rows, caches = fn(rows, caches)
    rows = jax.tree.map(lambda full, part: full.at[:n_rows].set(part), full_rows, rows)
    caches = map_cache(
        lambda name, full, part: jax.lax.dynamic_update_slice(full, part, [0] * full.ndim),
        full_caches,
        caches,
    )
    return out, rows, caches


def _corner(a, row_axis: int, slot_axis: int, n_rows: int, span: int):
    a = jax.lax.slice_in_dim(a, 0, n_rows, axis=row_axis)
    return jax.lax.slice_in_dim(a, 0, span, axis=slot_axis)


def map_cache(fn, caches, *others):
    """fn(field name "k" / "v", array, *matching arrays of `others`) over a KVCache or per-layer caches."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(caches)
    rest = [jax.tree.leaves(o) for o in others]
    out = [fn(path[-1].name, a, *(r[i] for r in rest)) for i, (path, a) in enumerate(paths)]
    return jax.tree.unflatten(treedef, out)
