"""What trains and what stays frozen: full training, LoRA adapters, or only the last layers.

The train state holds only the *trainable* tree (so frozen params have no
optimizer state, no gradient, and are never written by a step); the frozen
tree is a separate, read-only argument of the step. `merge` builds the model's
params from the two for the forward pass. Checkpoints hold the train state,
so a fine-tuning checkpoint stores the adapters (or trained layers) alone;
the frozen part is re-read from `train.init_from` (or the seeded init), which
is what export, generate and resume do via `Partition.merge`.

QLoRA (`finetune.quantize_base`): `frozen(params)` quantizes the base's
attention and dense-MLP weights once (NF4 `model.nf4.NF4Matrix` or int8
`model.quant.QuantizedMatrix`), and the frozen part's specs, shardings and
abstract form describe that quantized tree, so the train step takes uint8 /
int8 codes as its frozen argument (and planning and XLA's memory analysis
count them). Each matmul dequantizes its weight inside the step; nothing is
re-quantized per step. The embedding, norms, output head and MoE layers stay
in fp32 as QLoRA leaves them. `merged_for_export` dequantizes before folding
the adapters in: export, generate, eval and chat see the model that trained.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp

from shipyard.config import FinetuneConfig, ModelConfig
from shipyard.errors import ConfigError
from shipyard.model import quant
from shipyard.model.lora import as_lora_params, lora_specs, merge_into_base
from shipyard.model.params import ArraySpec, abstract_params, init_params, is_spec, param_shardings
from shipyard.model.transformer import TransformerParams, param_specs


def _stack_sizes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """stack name -> (first layer index, number of layers)."""
    return {"blocks": (0, cfg.num_dense_layers), "moe_blocks": (cfg.num_dense_layers, cfg.num_moe_layers)}


def _spec_rows(spec: ArraySpec, lo: int, hi: int) -> ArraySpec:
    return replace(spec, shape=(hi - lo, *spec.shape[1:]))


def _array_rows(a: jax.Array, lo: int, hi: int) -> jax.Array:
    return a[lo:hi]


@dataclass(frozen=True)
class Partition:
    """The split of a model's params into a trainable and a frozen tree (see module doc)."""

    model: ModelConfig
    finetune: FinetuneConfig | None

    @property
    def kind(self) -> str:
        if self.finetune is None:
            return "full"
        return "lora" if self.finetune.lora is not None else "last_layers"

    @property
    def frozen_layers(self) -> int:
        """Leading layers whose backward pass is skipped (only when just later layers train)."""
        if self.kind != "last_layers":
            return 0
        return self.model.num_layers - self.finetune.train_last_layers

    @property
    def quantize_base(self) -> str | None:
        """How the frozen base is held: "nf4", "int8" (QLoRA) or None (as the params are)."""
        return self.finetune.quantize_base if self.kind == "lora" else None

    def _quantized_specs(self, full):
        ft = self.finetune

        def spec(_, s):
            try:
                return quant.quantized_spec(s, ft.quantize_base, ft.quant_block, ft.double_quant)
            except ValueError as e:
                raise ConfigError(
                    f"train.finetune.quant_block: {ft.quant_block} does not fit the weights of shape {s.shape} "
                    f"(input axes {s.fan_in_axes}): {e}; choose a block size that divides each weight's "
                    "input (e.g. 32 or 64 for hidden sizes and head dims that are multiples of it)"
                ) from None

        return quant.map_block_weights(spec, full, full)

    def _cut(self, name: str) -> int:
        """Index within stack `name` where its trainable layers start."""
        first, n = _stack_sizes(self.model)[name]
        return min(max(self.frozen_layers - first, 0), n)

    def _split_layers(self, tree, rows):
        """(trainable, frozen) dicts of a model tree (params or their specs) for train_last_layers:
        each stack cut where its trainable layers start; `rows(leaf, lo, hi)` cuts one leaf."""
        trainable: dict[str, Any] = {}
        frozen: dict[str, Any] = {"embed": tree.embed}
        for name, (_, n) in _stack_sizes(self.model).items():
            stack, cut = getattr(tree, name), self._cut(name)

            def part(lo, hi, stack=stack):
                return jax.tree.map(lambda x: rows(x, lo, hi), stack, is_leaf=is_spec)

            frozen[name] = None if stack is None else part(0, cut)
            trainable[name] = None if stack is None or cut == n else part(cut, n)
        head = self.finetune.train_head
        for name in ("final_norm", "lm_head"):
            (trainable if head else frozen)[name] = getattr(tree, name)
            (frozen if head else trainable)[name] = None
        return trainable, frozen

    def trainable_specs(self):
        """Spec tree of the trainable params (what the optimizer and the checkpoint see)."""
        full = param_specs(self.model)
        if self.kind == "full":
            return full
        if self.kind == "lora":
            lora = self.finetune.lora
            return {
                name: lora_specs(lora, self.model, n, name == "moe_blocks")
                for name, (_, n) in _stack_sizes(self.model).items()
            }
        return self._split_layers(full, _spec_rows)[0]

    def frozen_specs(self):
        """Spec tree of the frozen part (None for full training); mirrors `frozen(params)`."""
        if self.kind == "full":
            return None
        full = param_specs(self.model)
        if self.quantize_base is not None:
            return self._quantized_specs(full)
        return full if self.kind == "lora" else self._split_layers(full, _spec_rows)[1]

    def frozen_shardings(self, mesh, rules):
        """Shardings of the frozen part on `mesh` (None for full training)."""
        specs = self.frozen_specs()
        return None if specs is None else param_shardings(specs, mesh, rules)

    def abstract_frozen(self, shardings):
        """The frozen part's shapes, dtypes and shardings, as `frozen(params)` gives it (None for full
        training): what the train step is lowered with."""
        specs = self.frozen_specs()
        return None if specs is None else abstract_params(specs, shardings)

    def compute_params(self, trainable, frozen, dtype) -> TransformerParams:
        """The forward pass's params: both parts in the compute `dtype`, joined (`merge`). A quantized
        base's codes and scales stay as they are: each matmul dequantizes them to its input's dtype."""

        def cast(x):
            return x if quant.is_any_quantized(x) else x.astype(dtype)

        return self.merge(*jax.tree.map(cast, (trainable, frozen), is_leaf=quant.is_any_quantized))

    def initial(self, params: TransformerParams, key: jax.Array, shardings=None):
        """The trainable tree to start from: the model's own params (or its last layers), or fresh
        adapters (B = 0, so the adapted model starts equal to `params`)."""
        if self.kind == "full":
            return params
        if self.kind == "lora":
            return init_params(self.trainable_specs(), jax.random.fold_in(key, 1), shardings)
        trainable = self._split_layers(params, _array_rows)[0]
        if shardings is not None:  # slices of sharded arrays keep some layout; pin the intended one
            trainable = jax.device_put(trainable, shardings)
        return trainable

    def frozen(self, params: TransformerParams, shardings=None):
        """The part of `params` that does not train (None for full training). With `quantize_base`, the
        base with its block weights quantized (deterministic: the same codes bit for bit every time),
        placed on `shardings` (`frozen_shardings`) when given."""
        if self.kind == "full":
            return None
        if self.quantize_base is not None:
            ft, full = self.finetune, param_specs(self.model)
            self.frozen_specs()  # one clear line for a block size that does not fit, before any tracing

            def one(w, spec):
                return quant.quantize_weight(w, spec, ft.quantize_base, ft.quant_block, ft.double_quant)

            placed = {} if shardings is None else {"out_shardings": shardings}
            return jax.jit(lambda p: quant.map_block_weights(one, p, full), **placed)(params)
        return params if self.kind == "lora" else self._split_layers(params, _array_rows)[1]

    def merge(self, trainable, frozen) -> TransformerParams:
        """The model's params: frozen and trainable parts joined (adapters attached, not folded in)."""
        if self.kind == "full":
            return trainable
        if self.kind == "lora":
            lora = self.finetune.lora
            stacks = {}
            for name in _stack_sizes(self.model):
                stack = getattr(frozen, name)
                stacks[name] = (
                    None if stack is None else replace(stack, lora=as_lora_params(trainable[name], lora))
                )
            return replace(frozen, **stacks)
        stacks = {}
        for name in _stack_sizes(self.model):
            f, t = frozen[name], trainable[name]
            if t is None or f is None:
                stacks[name] = f if t is None else t
            elif jax.tree.leaves(f)[0].shape[0] == 0:
                stacks[name] = t
            else:
                stacks[name] = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), f, t)

        def pick(name):
            return trainable[name] if trainable[name] is not None else frozen[name]

        return TransformerParams(
            embed=frozen["embed"],
            blocks=stacks["blocks"],
            moe_blocks=stacks["moe_blocks"],
            final_norm=pick("final_norm"),
            lm_head=pick("lm_head"),
        )

    def base_for_export(self, frozen) -> TransformerParams:
        """A LoRA run's frozen base as plain params, as the run trained on it (a quantized base
        dequantized to fp32): what PEFT's adapters go on to compute the run's logits."""
        if self.kind != "lora":
            raise ValueError(f"base_for_export: a {self.kind} run's frozen part is not a whole model")
        return quant.dequantize_params(frozen) if self.quantize_base is not None else frozen

    def merged_for_export(self, trainable, frozen) -> TransformerParams:
        """Plain model params (LoRA folded into the weights, a quantized base dequantized to fp32 first):
        what export and generation use."""
        if self.quantize_base is not None:
            frozen = quant.dequantize_params(frozen)
        return merge_into_base(self.merge(trainable, frozen))
