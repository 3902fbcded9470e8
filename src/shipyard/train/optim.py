"""Learning-rate schedules and the optimizer chain.

The schedule is applied outside optax, as a multiplier indexed by the trainer's
step: a skipped (non-finite) step leaves the optimizer state untouched but the
step counter still advances, so the learning rate always matches the data step.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from shipyard.config import ScheduleConfig, TrainConfig
from shipyard.model.params import ArraySpec, map_specs


def lr_schedule(sched: ScheduleConfig, peak: float, total_steps: int):
    """Learning rate as a pure function of the step (jnp-traceable).

    Warmup rises linearly from 0 at step 0 to `peak` at `warmup_steps`, where
    every main schedule starts at exactly `peak`: no jump at the join.
    """
    warm = sched.warmup_steps
    floor = peak * sched.min_lr_ratio

    def fn(step):
        step = jnp.asarray(step, jnp.float32)
        warmup = peak * step / max(warm, 1)
        if sched.kind == "constant":
            main = jnp.asarray(peak, jnp.float32)
        elif sched.kind == "cosine":
            frac = jnp.clip((step - warm) / max(total_steps - warm, 1), 0.0, 1.0)
            main = floor + (peak - floor) * 0.5 * (1 + jnp.cos(jnp.pi * frac))
        else:  # wsd: hold the peak, then decay linearly over the last decay_fraction of steps
            decay_steps = max(round(sched.decay_fraction * total_steps), 1)
            decay_start = total_steps - decay_steps
            frac = jnp.clip((step - decay_start) / decay_steps, 0.0, 1.0)
            main = peak + (floor - peak) * frac
        return jnp.where(step < warm, warmup, main)

    return fn


def decays(spec: ArraySpec, decay_embeddings: bool, decay_norms: bool) -> bool:
    """Whether weight decay applies: matrices and the head always; embeddings/norms by config."""
    return spec.role in ("weight", "head", "router", "adapter") or (
        (spec.role == "embedding" and decay_embeddings) or (spec.role == "norm" and decay_norms)
    )


def weight_decay_mask(specs, decay_embeddings: bool, decay_norms: bool):
    """Tree of bools matching the params: True where weight decay applies."""
    return map_specs(lambda s: decays(s, decay_embeddings, decay_norms), specs)


# Axes that stack independent matrices: Muon orthogonalises each slice on its own.
_STACKED = ("layers", "experts")


def _muon_factor(spec: ArraySpec) -> float:
    """Scale of an orthogonalised update: sqrt(max(1, fan_out / fan_in)).

    An orthogonal matrix has unit spectral norm; this keeps the RMS change of
    the layer's output comparable across matrix shapes (Keller Jordan's Muon).
    """
    fan_in = math.prod(spec.shape[i] for i in spec.fan_in_axes)
    fan_out = math.prod(n for n, a in zip(spec.shape, spec.logical_axes) if a not in _STACKED) // fan_in
    return math.sqrt(max(1.0, fan_out / fan_in))


def _muon(opt, specs) -> optax.GradientTransformation:
    """Muon for hidden matrices (role `weight`, experts included), AdamW for embeddings, head, norms and routers."""
    labels = map_specs(lambda s: "muon" if s.role == "weight" else "adam", specs)

    def only(label, fn):
        # optax.partition hands each branch a tree whose other leaves are MaskedNode.
        return map_specs(lambda s, lab: fn(s) if lab == label else optax.MaskedNode(), specs, labels)

    def dims(spec):
        batch = {i for i, a in enumerate(spec.logical_axes) if a in _STACKED}
        out = tuple(i for i in range(len(spec.shape)) if i not in batch and i not in spec.fan_in_axes)
        return optax.contrib.MuonDimensionNumbers(reduction_axis=spec.fan_in_axes, output_axis=out)

    factors = only("muon", _muon_factor)
    scale_by_shape = optax.GradientTransformation(
        lambda params: optax.EmptyState(),
        lambda updates, state, params=None: (
            jax.tree.map(lambda u, f: u * f, updates, factors),
            state,
        ),
    )
    adam_ratio = (opt.muon_adam_lr or opt.lr) / opt.lr
    muon_branch = optax.chain(
        optax.contrib.scale_by_muon(
            ns_steps=opt.muon_ns_steps,
            beta=opt.muon_momentum,
            weight_dimension_numbers=only("muon", dims),
        ),
        scale_by_shape,
        optax.add_decayed_weights(opt.weight_decay),
        optax.scale(-1.0),
    )
    adam_branch = optax.adamw(
        adam_ratio,
        b1=opt.b1,
        b2=opt.b2,
        eps=opt.eps,
        weight_decay=opt.weight_decay,
        mask=only("adam", lambda s: decays(s, opt.decay_embeddings, opt.decay_norms)),
    )
    return optax.partition({"muon": muon_branch, "adam": adam_branch}, labels)


def build_optimizer(train: TrainConfig, specs) -> optax.GradientTransformation:
    """clip → AdamW or Muon, producing updates at unit learning rate (see module doc)."""
    opt = train.optimizer
    parts = [optax.clip_by_global_norm(opt.clip_norm)] if opt.clip_norm is not None else []
    if opt.name == "adamw":
        parts.append(
            optax.adamw(
                1.0,
                b1=opt.b1,
                b2=opt.b2,
                eps=opt.eps,
                weight_decay=opt.weight_decay,
                mask=weight_decay_mask(specs, opt.decay_embeddings, opt.decay_norms),
            )
        )
    else:
        parts.append(_muon(opt, specs))
    return optax.chain(*parts)
