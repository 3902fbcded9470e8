"""Context (sequence) parallelism, mesh side: which device holds which sequence positions.

With `mesh.context` = C > 1 every sequence is split along `seq` over the
`context` mesh axis and attention runs as a ring (`model.ring_attention`).
Under a causal mask a plain contiguous split would leave device 0 with one
block of work and device C-1 with C of them; the zig-zag order balances it:
the sequence is cut into 2C chunks and device i holds chunks i and 2C-1-i
(an early and a late one), so every device's queries see about the same
number of keys. The order is a permutation of positions the train step
applies to inputs, targets, loss mask, segment ids and RoPE positions
together; attention masks by each position's original slot (the permutation
itself), so the model computes exactly what it would on the unpermuted row.
"""

from __future__ import annotations

import numpy as np
from jax.sharding import Mesh

from shipyard.config import Config
from shipyard.errors import ConfigError

AXIS = "context"
"""The mesh axis sequences are split over."""


def context_size(mesh: Mesh | None) -> int:
    """How many devices each sequence is split over (1: no context parallelism)."""
    if mesh is None or AXIS not in mesh.shape:
        return 1
    return int(mesh.shape[AXIS])


def zigzag_order(seq_len: int, context: int) -> np.ndarray:
    """The zig-zag permutation of `seq_len` positions for `context` devices: int32 [seq_len], entry j
    the original slot of position j of the permuted row. Split contiguously over the devices, device
    i's share is chunks i and 2*context-1-i of the row cut into 2*context equal chunks."""
    if seq_len % (2 * context):
        raise ConfigError(
            f"data.seq_len={seq_len} with mesh.context={context}: context parallelism cuts each sequence "
            f"into 2 x context = {2 * context} equal chunks; choose a seq_len divisible by {2 * context}"
        )
    chunks = np.arange(seq_len, dtype=np.int32).reshape(2 * context, seq_len // (2 * context))
    order = [c for i in range(context) for c in (i, 2 * context - 1 - i)]
    return chunks[order].reshape(-1)


def check_config(cfg: Config) -> None:
    """Refuse, in one ConfigError line, what context parallelism does not support with this config."""
    context = cfg.mesh.context
    if context == 1:
        return
    if context == -1:
        raise ConfigError(
            "mesh.context=-1: give the context axis an explicit size (the sequence split must be known "
            "before the devices are counted); put -1 on data instead"
        )
    zigzag_order(cfg.data.seq_len, context)  # raises for a seq_len that does not split
    rules = cfg.mesh.rules
    if "seq" in rules and tuple(rules["seq"]) != (AXIS,):
        raise ConfigError(
            f"mesh.rules.seq={list(rules['seq'])} with mesh.context={context}: the ring attention splits "
            f"seq over the context axis only; drop the seq rule or set it to [{AXIS}]"
        )
