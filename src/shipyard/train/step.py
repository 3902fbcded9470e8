"""The pure training step: `train_step(state, batch) -> (state, metrics)`.

Everything the step needs is in `state` (params, optimizer state, counters,
loss scale) or `batch`; configuration is closed over when the step is built.
It is jitted once by the trainer with explicit shardings and donated state.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from shipyard.config import Config
from shipyard.data.preference import pair_slots
from shipyard.model import fp8, transformer
from shipyard.model.moe import MoEStats
from shipyard.model.partition import Partition
from shipyard.model.transformer import TransformerParams, output_weights
from shipyard.parallel.layout import Layout
from shipyard.train import offload
from shipyard.train.chunked_loss import head_loss_sums, head_token_stats, num_chunks
from shipyard.train.loss import LossSums
from shipyard.train.optim import lr_schedule
from shipyard.train.preference_loss import (
    PreferenceSums,
    preference_metrics,
    preference_sums,
    reply_logps_from_stats,
)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TrainState:
    step: jax.Array
    """int32 data step; advances on skipped steps too, so batch and schedule stay aligned."""
    params: Any
    """fp32 master copy of the trainable parameters: the whole TransformerParams, or with
    train.finetune only the adapters / trained layers (see model/partition.py)."""
    opt_state: Any
    """optax state; left untouched by a skipped step."""
    loss_scale: jax.Array
    """float32 dynamic loss scale (fp16 only; 1.0 otherwise)."""
    good_steps: jax.Array
    """int32 finite steps since the loss scale last changed."""
    nonfinite: jax.Array
    """int32 total steps skipped for a non-finite loss or gradient."""
    nonfinite_run: jax.Array
    """int32 current run of consecutive skipped steps."""


def _pin_like_params(opt_state, params, shardings):
    """Constrain each optimizer leaf that mirrors a parameter (same key-path suffix and shape) to its sharding.

    Matching by path suffix rather than tree structure also covers
    partitioned optimizers (Muon + AdamW), whose states hold masked nodes.
    """
    keyed = [
        (jax.tree_util.keystr(path), leaf.shape, sh)
        for (path, leaf), sh in zip(
            jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(shardings)
        )
    ]

    def pin(path, leaf):
        name = jax.tree_util.keystr(path)
        match = max(
            ((k, sh) for k, shape, sh in keyed if name.endswith(k) and getattr(leaf, "shape", None) == shape),
            key=lambda m: len(m[0]),
            default=None,
        )
        return leaf if match is None else jax.lax.with_sharding_constraint(leaf, match[1])

    return jax.tree_util.tree_map_with_path(pin, opt_state)


def init_state(
    cfg: Config, params: TransformerParams, optimizer: optax.GradientTransformation, shardings=None
) -> TrainState:
    """Fresh state around `params`, built in one jit so every leaf lands on the params' devices.

    Each optimizer moment is pinned to its parameter's sharding (`shardings`,
    default: the params' own): XLA would otherwise replicate zeros that do
    not depend on any input, and FSDP would shard only half the state. The
    scalar counters are replicated. With train.offload the optimizer state
    (and the params) are placed in pinned host memory (train/offload.py).
    """
    fp16 = cfg.train.precision.compute_dtype == "float16"
    scale = cfg.train.precision.loss_scale_init if fp16 else 1.0
    if shardings is None:
        shardings = jax.tree.map(lambda x: x.sharding, params)

    def build(params):
        opt_state = _pin_like_params(optimizer.init(params), params, shardings)
        state = TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=opt_state,
            loss_scale=jnp.full((), scale, jnp.float32),
            good_steps=jnp.zeros((), jnp.int32),
            nonfinite=jnp.zeros((), jnp.int32),
            nonfinite_run=jnp.zeros((), jnp.int32),
        )
        return _offloaded(state, cfg.train.offload)

    return jax.jit(build)(params)


def matmul_params(p, precision):
    """The compute-dtype params as the forward multiplies them: with train.precision.matmul=fp8 the
    block matmul weights marked for fp8 (model/fp8.py), else unchanged."""
    return fp8.wrap(p) if precision.matmul == "fp8" else p


def _split_microbatches(x: jax.Array, n: int) -> jax.Array:
    # Strided split (row i goes to microbatch i % n): with the batch sharded in
    # contiguous blocks over devices, every device then contributes equally to
    # every microbatch and no rows move between devices.
    return jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1)


def segment_ids(tokens: jax.Array, eos_id: int | None) -> jax.Array | None:
    """Document index of each position: a token after an EOS starts a new document (the EOS itself
    belongs to the document it ends). None when document masking is off."""
    if eos_id is None:
        return None
    is_eos = (tokens == eos_id).astype(jnp.int32)
    return jnp.cumsum(is_eos, axis=-1) - is_eos


def _model_inputs(batch: dict, eos_id: int | None) -> dict:
    """Forward-pass keyword arguments for a batch: segment ids and positions when the batch
    carries them (packed chats), else segment ids from EOS positions (document masking); for a
    batch in the context order (`_context_view`) its own (the layout's order gives the slots)."""
    if "inputs" in batch:
        return {"segment_ids": batch.get("segment_ids"), "positions": batch["positions"]}
    if "segment_ids" in batch:
        return {"segment_ids": batch["segment_ids"], "positions": batch["positions"]}
    return {"segment_ids": segment_ids(batch["tokens"][:, :-1], eos_id)}


def _inputs(batch: dict) -> jax.Array:
    """The model's input tokens [B, L] of a batch (or of its context-ordered view)."""
    return batch["inputs"] if "inputs" in batch else batch["tokens"][:, :-1]


def _targets(batch: dict) -> jax.Array:
    """The next-token targets [B, L] of a batch (or of its context-ordered view)."""
    return batch["targets"] if "targets" in batch else batch["tokens"][:, 1:]


def chunk_count(cfg: Config, targets: jax.Array, layout: Layout | None) -> int:
    """How many chunks the head and loss run in for `targets` [rows, seq] of one pass: at most
    train.loss_chunk_tokens tokens per device each, by the residual stream's layout."""
    sharding = None if layout is None else layout.activations_of(targets.shape[0])
    return num_chunks(targets.shape, cfg.train.loss_chunk_tokens, sharding)


def _context_view(batch: dict, eos_id: int | None, order: np.ndarray) -> dict:
    """The batch with every position in the context `order`: inputs and targets [B, L], loss mask,
    segment ids and RoPE positions permuted together. Segment ids (from EOS or the batch) and
    positions are taken before permuting, so each token keeps its document and position; the
    summed loss does not depend on the order."""
    tokens = batch["tokens"]
    kw = _model_inputs(batch, eos_id)
    positions = kw.get("positions")
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1] - 1), (tokens.shape[0], tokens.shape[1] - 1))
    view = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": positions}
    if kw["segment_ids"] is not None:
        view["segment_ids"] = kw["segment_ids"]
    view.update({k: v for k, v in batch.items() if k not in ("tokens", "segment_ids", "positions")})
    return {k: v[:, order] for k, v in view.items()}


@dataclass(frozen=True, eq=False)  # hashed by identity, as jit needs
class GradientFn:
    """`gradients(params, frozen, batch, loss_scale, key) -> (grads, LossSums, MoEStats | None)`: full-batch
    gradient of the mean loss with respect to the trainable `params` (frozen: the rest, see
    model/partition.py; key: LoRA dropout, or None). Built by `make_gradient_fn`."""

    cfg: Config
    eos_id: int | None
    layout: Layout | None
    """Where the step's work lies (parallel/layout.py); None: no mesh."""
    partition: Partition

    def chunks(self, targets) -> int:
        """How many chunks the head and loss run in for `targets` [batch, seq]: at most
        train.loss_chunk_tokens tokens per device each (see train/chunked_loss.py)."""
        return chunk_count(self.cfg, targets, self.layout)

    def token_sums(self, p, h, mb) -> LossSums:
        """Next-token LossSums of final hidden states `h` through `p`'s head, in `chunks`."""
        targets = _targets(mb)
        return head_loss_sums(h, output_weights(p), targets, mb["loss_mask"], self.chunks(targets))

    def hidden(self, p, mb, key):
        """(final hidden states [batch, seq, embed], MoEStats | None) of the model `p` on `mb`."""
        return transformer.forward(
            p,
            _inputs(mb),
            self.cfg.model,
            layout=self.layout,
            dropout_key=key,
            frozen_layers=self.partition.frozen_layers,
            **_model_inputs(mb, self.eos_id),
        )

    def context_view(self, batch: dict) -> dict:
        """The batch as the model sees it: in the layout's context order under context parallelism."""
        order = None if self.layout is None else self.layout.order
        return batch if order is None else _context_view(batch, self.eos_id, order)

    def with_moe_losses(self, loss, stats):
        """(loss plus the MoE balance losses, the stats averaged over microbatches)."""
        if stats is None:
            return loss, stats
        moe = self.cfg.model.moe
        stats = jax.tree.map(lambda v: v / self.cfg.train.microbatches, stats)
        loss = loss + moe.aux_loss * jnp.sum(stats.aux_loss) + moe.router_z_loss * jnp.sum(stats.z_loss)
        return loss, stats

    def normaliser(self, batch) -> jax.Array:
        """What the summed loss is divided by: the whole batch's trained token count."""
        return jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)

    def objective(self, params, frozen, mb, key, total_tokens, loss_scale):
        """(loss of microbatch `mb` over the whole batch's `total_tokens`, (LossSums, MoEStats))."""
        train = self.cfg.train
        compute = jnp.dtype(train.precision.compute_dtype)
        p = matmul_params(self.partition.compute_params(params, frozen, compute), train.precision)
        h, stats = self.hidden(p, mb, key)
        sums = self.token_sums(p, h, mb)
        # Normalise by the whole batch's token count so microbatch
        # gradients add up to exactly the full-batch gradient.
        loss, stats = self.with_moe_losses((sums.ce + train.z_loss * sums.z) / total_tokens, stats)
        return loss * loss_scale if compute == jnp.float16 else loss, (sums, stats)

    def microbatch(self, params, frozen, mb, key, total_tokens, loss_scale):
        """(grads, LossSums, MoEStats | None) of one microbatch."""
        grad = jax.grad(self.objective, has_aux=True)
        grads, (sums, stats) = grad(params, frozen, mb, key, total_tokens, loss_scale)
        return grads, sums, stats

    def accumulate(self, params, frozen, key, total_tokens, loss_scale, carry, xs):
        """One scan step over microbatches: add microbatch i's gradients and sums to `carry`."""
        i, mb = xs
        mkey = None if key is None else jax.random.fold_in(key, i)
        out = self.microbatch(params, frozen, mb, mkey, total_tokens, loss_scale)
        return jax.tree.map(jnp.add, carry, out), None

    def zeros(self, params) -> tuple:
        """The accumulator's start: zero gradients, sums and (for MoE) stats."""
        model, zero_stats = self.cfg.model, None
        if model.moe is not None:
            Lm, X = model.num_moe_layers, model.moe.num_experts
            z = jnp.zeros((Lm,), jnp.float32)
            zero_stats = MoEStats(load=jnp.zeros((Lm, X), jnp.float32), aux_loss=z, z_loss=z, dropped=z)
        return jax.tree.map(jnp.zeros_like, params), self.zero_sums(), zero_stats

    def zero_sums(self) -> LossSums:
        return LossSums(*(jnp.zeros((), jnp.float32) for _ in range(4)))

    def __call__(self, params, frozen, batch, loss_scale, key=None):
        batch = self.context_view(batch)
        total_tokens = self.normaliser(batch)
        n_micro = self.cfg.train.microbatches
        if n_micro == 1:
            return self.microbatch(params, frozen, batch, key, total_tokens, loss_scale)
        step = partial(self.accumulate, params, frozen, key, total_tokens, loss_scale)
        mbs = {k: _split_microbatches(v, n_micro) for k, v in batch.items()}
        return jax.lax.scan(step, self.zeros(params), (jnp.arange(n_micro), mbs))[0]


@dataclass(frozen=True, eq=False)
class PreferenceGradientFn(GradientFn):
    """GradientFn of the preference loss (train.preference: DPO / SimPO / ORPO) on packed pairs.

    `gradients(params, frozen, batch, loss_scale, key, reference=None)`: the loss is the sum over the
    batch's pairs divided by the whole batch's pair count, so microbatches add up exactly as tokens
    do for next-token loss. The reference log-probs come from the batch (`ref_logps`, reference:
    cached) or from a forward of `reference` (the starting trainable tree, in the compute dtype)
    with the frozen params under stop_gradient (reference: on_the_fly); SimPO and ORPO use none. The
    frozen and reference trees travel through the microbatch machinery as one `context` pair.
    """

    def normaliser(self, batch) -> jax.Array:
        return jnp.maximum(jnp.sum(batch["pair_mask"].astype(jnp.float32)), 1.0)

    def context_view(self, batch: dict) -> dict:
        # Pairs stay in their order (pair slots and per-row arrays would need the permutation too):
        # the ring attention is exact in any order, only less balanced.
        return batch

    def zero_sums(self) -> PreferenceSums:
        return PreferenceSums(**{f.name: jnp.zeros((), jnp.float32) for f in fields(PreferenceSums)})

    def num_slots(self) -> int:
        return 2 * pair_slots(self.cfg.data.seq_len)

    def policy_logps(self, p, mb, key):
        """(reply log-probs [B, 2P], token counts [B, 2P], MoEStats | None) of the model `p` on `mb`."""
        h, stats = self.hidden(p, mb, key)
        lse, target, _ = head_token_stats(h, output_weights(p), _targets(mb), self.chunks(_targets(mb)))
        logps, counts = reply_logps_from_stats(lse, target, mb["slots"], self.num_slots())
        return logps, counts, stats

    def reference_logps(self, frozen, reference, mb):
        """The reference model's reply log-probs [B, 2P] for `mb` (None for SimPO and ORPO)."""
        pref = self.cfg.train.preference
        if pref.loss != "dpo":
            return None
        if pref.reference == "cached":
            return mb["ref_logps"]
        compute = jnp.dtype(self.cfg.train.precision.compute_dtype)
        logps, _, _ = self.policy_logps(self.partition.compute_params(reference, frozen, compute), mb, None)
        return jax.lax.stop_gradient(logps)

    def objective(self, params, context, mb, key, total_pairs, loss_scale):
        """(loss of microbatch `mb` over the whole batch's `total_pairs`, (PreferenceSums, MoEStats))."""
        frozen, reference = context
        train = self.cfg.train
        compute = jnp.dtype(train.precision.compute_dtype)
        logps, counts, stats = self.policy_logps(
            matmul_params(self.partition.compute_params(params, frozen, compute), train.precision), mb, key
        )
        ref = self.reference_logps(frozen, reference, mb)
        sums = preference_sums(logps, ref, counts, mb["pair_mask"], train.preference)
        loss, stats = self.with_moe_losses(sums.loss / total_pairs, stats)
        return loss * loss_scale if compute == jnp.float16 else loss, (sums, stats)

    def __call__(self, params, frozen, batch, loss_scale, key=None, reference=None):
        return super().__call__(params, (frozen, reference), batch, loss_scale, key)

    def sums(self, params, frozen, batch, reference=None) -> PreferenceSums:
        """The batch's PreferenceSums, forward only (held-out evaluation)."""
        return self.objective(params, (frozen, reference), batch, None, 1.0, 1.0)[1][0]


def make_gradient_fn(
    cfg: Config, eos_id: int | None = None, layout: Layout | None = None, partition: Partition | None = None
) -> GradientFn:
    """The gradient function of `cfg` (see GradientFn).

    With `train.microbatches > 1` the batch is processed in sequential slices
    whose gradients add up to the same full-batch gradient (the MoE balance
    losses, which are per-slice means, are averaged over slices). For fp16 the
    returned gradients are still multiplied by `loss_scale`. The MoE stats
    have a leading axis over MoE layers.
    """
    partition = partition or Partition(cfg.model, None)
    if cfg.train.preference is None:
        return GradientFn(cfg, eos_id, layout, partition)
    # pairs stay in their own order (PreferenceGradientFn.context_view)
    return PreferenceGradientFn(cfg, eos_id, None if layout is None else layout.in_own_order(), partition)


def _balance_router_bias(params: TransformerParams, stats: MoEStats, rate: float) -> TransformerParams:
    """Aux-loss-free balancing (DeepSeek-V3): raise the selection bias of under-loaded experts, lower over-loaded."""
    moe = params.moe_blocks.moe
    bias = moe.router_bias + rate * jnp.sign(jnp.mean(stats.load, axis=-1, keepdims=True) - stats.load)
    return replace(params, moe_blocks=replace(params.moe_blocks, moe=replace(moe, router_bias=bias)))


def moe_metrics(stats: MoEStats) -> dict[str, jax.Array]:
    """Per-step MoE metrics: per-layer expert load (fraction per expert), max/mean load, losses, drops."""
    max_over_mean = jnp.max(stats.load, axis=-1) / jnp.mean(stats.load, axis=-1)
    return {
        "moe_aux_loss": jnp.mean(stats.aux_loss),
        "moe_z_loss": jnp.mean(stats.z_loss),
        "moe_dropped": jnp.mean(stats.dropped),
        "moe_load_max_over_mean": jnp.max(max_over_mean),
        "moe_layer_load_max_over_mean": max_over_mean,
        "moe_expert_load": stats.load,
    }


def _optimizer_update(optimizer, state: TrainState, grads, lr, finite, stats, bias_rate: float):
    """(params, opt_state, update norm): the optimizer's step scaled by `lr` when `finite`, else
    the state's own params and optimizer state (and a zero norm)."""

    def apply(_):
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        updates = jax.tree.map(lambda u: lr * u, updates)
        params = optax.apply_updates(state.params, updates)
        if bias_rate > 0:
            params = _balance_router_bias(params, stats, bias_rate)
        return params, opt_state, optax.tree.norm(updates)

    def skip(_):
        return state.params, state.opt_state, jnp.zeros((), jnp.float32)

    # A cond, not a select: a skipped step costs nothing and a normal step
    # does not pay for an extra pass over params and optimizer state.
    return jax.lax.cond(finite, apply, skip, None)


def _offloaded(state: TrainState, where) -> TrainState:
    """`state` with the parts train.offload (`where`) keeps in host memory moved there."""
    params = offload.to_host(state.params) if where.params else state.params
    opt_state = offload.to_host(state.opt_state) if where.optimizer else state.opt_state
    return replace(state, params=params, opt_state=opt_state)


def _next_loss_scale(precision, state: TrainState, finite) -> tuple[jax.Array, jax.Array]:
    """(loss_scale, good_steps) after this step: fp16 halves the scale on overflow and doubles it
    after `loss_scale_growth_interval` good steps; other dtypes keep 1.0."""
    if precision.compute_dtype != "float16":
        return state.loss_scale, state.good_steps
    grown = state.good_steps + 1 >= precision.loss_scale_growth_interval
    loss_scale = jnp.where(
        finite,
        jnp.where(grown, state.loss_scale * 2, state.loss_scale),
        jnp.maximum(state.loss_scale / 2, 1.0),
    )
    good_steps = jnp.where(finite & ~grown, state.good_steps + 1, 0)
    return loss_scale, good_steps


def _loss_metrics(sums: LossSums | PreferenceSums) -> dict:
    """The step's loss metrics: per trained token (next-token loss), or per pair (preference loss:
    loss, pref_accuracy, reward_margin, chosen/rejected log-probs and rewards)."""
    if isinstance(sums, PreferenceSums):
        return preference_metrics(sums)
    total_tokens = jnp.maximum(sums.tokens, 1.0)
    return {
        "loss": sums.ce / total_tokens,
        "z_loss": sums.z / total_tokens,
        "entropy": sums.entropy / total_tokens,
    }


def _finite_loss(sums: LossSums | PreferenceSums) -> jax.Array:
    if isinstance(sums, PreferenceSums):
        return jnp.isfinite(sums.loss)
    return jnp.isfinite(sums.ce) & jnp.isfinite(sums.z)


def _step_metrics(state: TrainState, new_state: TrainState, sums, stats, values: dict) -> dict:
    """The per-step metrics (the fields of metrics.jsonl): the loss metrics, norms, counters;
    `values` holds the step's lr, grad_norm, update_norm and skipped."""
    metrics = {
        **_loss_metrics(sums),
        "lr": values["lr"],
        "grad_norm": values["grad_norm"],
        "param_norm": optax.tree.norm(new_state.params),
        "update_norm": values["update_norm"],
        "loss_scale": state.loss_scale,
        "skipped": values["skipped"],
        "nonfinite_total": new_state.nonfinite,
        "nonfinite_run": new_state.nonfinite_run,
    }
    if stats is not None:
        metrics.update(moe_metrics(stats))
    return metrics


def make_train_step(
    cfg: Config,
    optimizer: optax.GradientTransformation,
    eos_id: int | None = None,
    layout: Layout | None = None,
    partition: Partition | None = None,
):
    """Build the (unjitted) step function `step(state, batch, frozen=None, reference=None)` for this config.

    With `eos_id`, attention stops at documents' ends; `layout` lays the
    work over the mesh (parallel/layout.py, see transformer.forward). With a
    fine-tuning `partition`, state.params is the trainable tree and `frozen`
    the rest, which the step reads and never returns. A batch may carry
    segment_ids and positions (packed chats) next to tokens and loss_mask. With train.preference the
    batch holds packed pairs and the loss is the preference loss (PreferenceGradientFn; `reference`:
    the starting trainable tree, for train.preference.reference: on_the_fly).
    """
    train = cfg.train
    fp16 = train.precision.compute_dtype == "float16"
    schedule = lr_schedule(train.schedule, train.optimizer.lr, train.steps)
    partition = partition or Partition(cfg.model, None)
    gradients = make_gradient_fn(cfg, eos_id, layout, partition)
    # Selection-bias balancing moves a param outside the optimizer: only when every param trains.
    bias_rate = (
        cfg.model.moe.bias_update_rate if cfg.model.moe is not None and partition.kind == "full" else 0.0
    )
    lora = train.finetune.lora if train.finetune is not None else None
    dropout = lora is not None and lora.dropout > 0

    def step(
        state: TrainState, batch: dict[str, jax.Array], frozen=None, reference=None
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        if train.offload.params:  # streamed in from host memory (train/offload.py)
            state = replace(state, params=offload.to_device(state.params))
        # Dropout masks are a pure function of (seed, step): a resumed run draws the same ones.
        key = jax.random.fold_in(jax.random.key(train.seed + 1), state.step) if dropout else None
        more = () if reference is None else (reference,)
        grads, sums, stats = gradients(state.params, frozen, batch, state.loss_scale, key, *more)
        if fp16:
            grads = jax.tree.map(lambda g: g / state.loss_scale, grads)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm) & _finite_loss(sums)
        lr = schedule(state.step)
        if train.offload.optimizer:  # fetched where the update reads it, stored back below
            state = replace(state, opt_state=offload.to_device(state.opt_state))
        params, opt_state, update_norm = _optimizer_update(
            optimizer, state, grads, lr, finite, stats, bias_rate
        )
        loss_scale, good_steps = _next_loss_scale(train.precision, state, finite)
        skipped = (~finite).astype(jnp.int32)
        new_state = TrainState(
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            loss_scale=loss_scale,
            good_steps=good_steps,
            nonfinite=state.nonfinite + skipped,
            nonfinite_run=jnp.where(finite, 0, state.nonfinite_run + 1),
        )
        values = {"lr": lr, "grad_norm": grad_norm, "update_norm": update_norm, "skipped": skipped}
        metrics = _step_metrics(state, new_state, sums, stats, values)
        return _offloaded(new_state, train.offload), metrics

    return step


def make_eval_step(
    cfg: Config, eos_id: int | None = None, layout: Layout | None = None, partition: Partition | None = None
):
    """`eval_step(params, frozen, batch) -> (sum of token losses, token count)`: forward only, compute
    dtype; the batch's loss_mask (and packed-chat segments) apply when present. Rows are read in
    their own order (no context permutation)."""
    compute = jnp.dtype(cfg.train.precision.compute_dtype)
    partition = partition or Partition(cfg.model, None)
    layout = None if layout is None else layout.in_own_order()

    def eval_step(params, frozen, batch):
        if cfg.train.offload.params:  # the state's params, in host memory
            params = offload.to_device(params)
        p = matmul_params(partition.compute_params(params, frozen, compute), cfg.train.precision)
        tokens = batch["tokens"]
        h, _ = transformer.forward(
            p,
            tokens[:, :-1],
            cfg.model,
            layout=layout,
            **_model_inputs(batch, eos_id),
        )
        targets = tokens[:, 1:]
        mask = batch.get("loss_mask", jnp.ones(targets.shape))
        sums = head_loss_sums(h, output_weights(p), targets, mask, chunk_count(cfg, targets, layout))
        return sums.ce, sums.tokens

    return eval_step


def make_preference_eval_step(cfg: Config, layout: Layout | None = None, partition: Partition | None = None):
    """`eval_step(params, frozen, batch, reference=None) -> PreferenceSums`: the preference loss and
    metrics' sums of a batch of packed pairs, forward only."""
    gradients = make_gradient_fn(cfg, None, layout, partition)
    return gradients.sums


def make_reference_step(cfg: Config, layout: Layout | None = None, partition: Partition | None = None):
    """`reference_step(trainable, frozen, batch) -> reply log-probs [B, 2P]` (fp32) of the model the
    trainable and frozen trees make, in the compute dtype (the reference pass of train.preference's
    reference: cached; the step's on_the_fly reference forward computes the same)."""
    gradients = make_gradient_fn(cfg, None, layout, partition)
    compute = jnp.dtype(cfg.train.precision.compute_dtype)

    def reference_step(trainable, frozen, batch):
        p = gradients.partition.compute_params(trainable, frozen, compute)
        return gradients.policy_logps(p, batch, None)[0]

    return reference_step
