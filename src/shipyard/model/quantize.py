"""int8 weights for a whole model: which of a transformer's params `--quantize int8` / `int8-g128` converts.

The int8 leaf (`quant.QuantizedMatrix`) and its matmul live in `model/quant.py`, below the model
code that calls them; this module walks the model's params, so it sits above `model/transformer.py`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from shipyard.model import quant
from shipyard.model.transformer import param_specs


def quantize_params(params, cfg, *, head: bool = True, embed: bool = False, group: int | None = None):
    """The params of model `cfg` (a ModelConfig) with int8 weights (`quant.QuantizedMatrix`): attention and
    dense-MLP matrices, the output head (`head`), the token embedding (`embed`, one scale per row).

    `group` None: one scale per output channel (`--quantize int8`); a size: one per group of that
    many consecutive inputs of each output channel (`int8-g128`; `quant.group_factors` says what a
    weight whose input it does not divide gets).

    Norms, biases, LoRA adapters and MoE layers (router and experts) stay as
    they are. A tied model quantized with `head` and not `embed` gets a
    quantized copy of the embedding as its head (`lm_head`), so the lookup
    stays exact while the largest matrix of a small model still shrinks 4x.
    Each weight's contracted axes are its spec's `fan_in_axes`.
    """
    specs = param_specs(cfg)

    def stack(blocks, block_specs):
        if blocks is None:
            return None
        new = {}
        for name in quant.BLOCK_WEIGHTS:
            w, spec = getattr(blocks, name), getattr(block_specs, name)
            if w is not None and not quant.is_quantized(w):
                new[name] = _quantize_jit(w, spec.fan_in_axes, group)
        return dataclasses.replace(blocks, **new)

    out = dataclasses.replace(
        params,
        blocks=stack(params.blocks, specs.blocks),
        moe_blocks=stack(params.moe_blocks, specs.moe_blocks),
    )
    table = out.embed
    if embed and not quant.is_quantized(table):
        out = dataclasses.replace(out, embed=_quantize_jit(table, (1,), group))
    if head and out.lm_head is None and not embed:
        out = dataclasses.replace(out, lm_head=_quantize_jit(jnp.asarray(table).T, (0,), group))
    elif head and out.lm_head is not None and not quant.is_quantized(out.lm_head):
        out = dataclasses.replace(out, lm_head=_quantize_jit(out.lm_head, specs.lm_head.fan_in_axes, group))
    return out


_quantize_jit = jax.jit(quant.quantize, static_argnums=(1, 2))


MODE_GROUPS: dict[str, int | None] = {"int8": None, "int8-g128": 128}
"""Each `--quantize` mode's group size along the contracted axis (None: one scale per output channel).
128 is the group llama.cpp-style and GPTQ/AWQ int4/int8 formats settled on: its fp32 scales add 1/32 to
the int8 bytes, and the common model widths (multiples of 64 or 128) divide into it."""

QUANTIZE_MODES = tuple(MODE_GROUPS)
"""What `--quantize` accepts (`maybe_quantize`)."""


def maybe_quantize(params, cfg, quantize: str | None):
    """`params` as the inference commands' `--quantize` asks: unchanged for None, `quantize_params` with
    the mode's group size (`MODE_GROUPS`) otherwise."""
    if quantize is None:
        return params
    if quantize not in MODE_GROUPS:
        raise ValueError(f"quantize must be one of {QUANTIZE_MODES} or None, got {quantize!r}")
    return quantize_params(params, cfg, group=MODE_GROUPS[quantize])
