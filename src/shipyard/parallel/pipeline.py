"""Pipeline parallelism: a microbatched, circular schedule over the mesh's `pipeline` axis.

The layers of a stack are cut into `stages x repeats` equal chunks. Chunk `c`
runs on stage `c % stages` in round `c // stages`: with one round this is
GPipe (stage p holds layers p*L/P .. (p+1)*L/P - 1); with several, every stage
holds `repeats` non-contiguous chunks and each microbatch circles the ring of
stages `repeats` times (the circular / interleaved schedule of MaxText and
Megatron's virtual stages), which shrinks the bubble by that factor.

The schedule is one `jax.shard_map` manual over `pipeline` only, so the other
mesh axes (data, fsdp, tensor, expert, context) stay automatic inside a stage
and compose with it. Each tick every stage runs one chunk on one microbatch
and hands its output to the next stage with `ppermute`; the last stage's
output wraps around to stage 0, which keeps one slot per microbatch and feeds
it back for the next round (or, after the last round, returns it). Timing:
stage p works on item i = t - p at tick t (microbatch i mod M, round i // M),
so a run takes M*R + P - 1 ticks of which P - 1 are fill/drain on each stage:
the bubble (P - 1) / (M*R + P - 1). Gradients come from autodiff through the
schedule (the backward is the same pipeline run in reverse by XLA), and the
microbatches' weight gradients add up inside it.

The stored parameters keep their layer order (`[layers, ...]`, the `layers`
axis split over `pipeline` in contiguous blocks); `to_stages` reshapes them to
the schedule's [stages, repeats, layers per chunk] inside the step (free for
one round, one all-to-all of the stack for more), so a checkpoint of one
layout restores on any other.

Generic over the stage function; nothing here knows the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shipyard.config import Config
from shipyard.errors import ConfigError
from shipyard.parallel import backend

AXIS = "pipeline"

StageFn = Callable[[Any, Any, jax.Array, Any, jax.Array], tuple[jax.Array, Any]]
"""`stage_fn(chunk, shared, x, extras, chunk_index) -> (y, aux)`: one chunk of layers (`chunk`: the
stage params sliced to [layers per chunk, ...]) applied to one microbatch `x`; `shared`: what every
stage gets whole; `extras`: this microbatch's side inputs; `chunk_index`: which of the stages x repeats
chunks this is (0 is the first chunk in layer order); `aux`: a pytree with a leading [layers per
chunk] axis (per-layer statistics) or None."""


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: `stages` (the mesh's pipeline axis), `microbatches` per batch, `repeats` rounds."""

    stages: int
    microbatches: int
    repeats: int = 1

    @property
    def ticks(self) -> int:
        """Steps of the schedule: every stage runs one chunk on one microbatch per tick."""
        return self.microbatches * self.repeats + self.stages - 1

    @property
    def chunks(self) -> int:
        return self.stages * self.repeats


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The fraction of stage time spent idle in fill and drain: (P - 1) / (M*R + P - 1).

    GPipe (repeats 1) is (P - 1) / (M + P - 1); the circular schedule's rounds
    make each tick R times shorter (a chunk is 1/R of a stage's layers) while
    fill and drain stay P - 1 ticks, hence the M*R. 0 for one stage.
    """
    return (stages - 1) / (microbatches * repeats + stages - 1)


def describe(schedule: Schedule) -> str:
    """One line on the schedule and its bubble, for the start of a run."""
    P, M, R = schedule.stages, schedule.microbatches, schedule.repeats
    kind = "GPipe" if R == 1 else f"circular, {R} rounds"
    return (
        f"pipeline {P} stage(s) ({kind}), {M} microbatches: bubble "
        f"{bubble_fraction(P, M, R):.1%} of stage time, (P-1)/(M*R+P-1) = {P - 1}/{M * R + P - 1}"
    )


def check_schedule(schedule: Schedule, layers: int, rows: int, where: str = "train.pipeline") -> None:
    """Refuse a schedule that cannot run `layers` layers on batches of `rows` sequences (ConfigError)."""
    P, M, R = schedule.stages, schedule.microbatches, schedule.repeats
    if layers % (P * R):
        raise ConfigError(
            f"{where}: {layers} layers do not split into mesh.pipeline={P} x repeats={R} equal chunks; "
            f"choose stages x repeats dividing {layers}"
        )
    if rows % M:
        raise ConfigError(
            f"{where}.microbatches={M} does not divide the {rows} sequences of each step's batch "
            "(train.global_batch_size / train.microbatches); choose a divisor"
        )
    if R > 1 and M < P:
        raise ConfigError(
            f"{where}: repeats={R} needs microbatches >= mesh.pipeline={P} (got {M}): a microbatch "
            "re-enters stage 0 only after passing every stage"
        )


def split_microbatches(x: jax.Array, n: int) -> jax.Array:
    """[B, ...] -> [n, B/n, ...], row i in microbatch i % n (strided: with the batch split in blocks
    over devices, every device holds an equal part of every microbatch and no row moves)."""
    return jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1)


def merge_microbatches(x: jax.Array) -> jax.Array:
    """The inverse of `split_microbatches`: [n, B/n, ...] -> [B, ...]."""
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def to_stages(tree: Any, schedule: Schedule) -> Any:
    """Leaves [layers, ...] in layer order -> [stages, repeats, layers per chunk, ...] (chunk r*P + p at [p, r])."""
    P, R = schedule.stages, schedule.repeats

    def one(a):
        a = a.reshape(R, P, a.shape[0] // (P * R), *a.shape[1:])
        return jnp.swapaxes(a, 0, 1)

    return jax.tree.map(one, tree)


def to_layers(tree: Any) -> Any:
    """The inverse of `to_stages`: [stages, repeats, layers per chunk, ...] -> [layers, ...]."""

    def one(a):
        a = jnp.swapaxes(a, 0, 1)
        return a.reshape(a.shape[0] * a.shape[1] * a.shape[2], *a.shape[3:])

    return jax.tree.map(one, tree)


def nested_mesh(mesh: Mesh) -> tuple[Any, frozenset[str]]:
    """(mesh, axis names) for a `shard_map` that may run inside a stage: inside the schedule the
    context mesh has `pipeline` manual already, and a nested shard_map must use that abstract mesh and
    leave its manual axes out; elsewhere the given mesh and all its axes."""
    context = jax.sharding.get_abstract_mesh()
    manual = frozenset(getattr(context, "manual_axes", ()) or ()) if not context.empty else frozenset()
    if not manual:
        return mesh, frozenset(mesh.axis_names)
    return context, frozenset(a for a in mesh.axis_names if a not in manual)


def stage_constraint(sharding: NamedSharding | None) -> Callable[[jax.Array], jax.Array]:
    """A sharding constraint to `sharding`'s spec that works inside a stage (the concrete mesh's
    NamedSharding does not: there `pipeline` is manual, so the spec goes on the context mesh)."""
    if sharding is None:
        return lambda x: x

    def constrain(x):
        context = jax.sharding.get_abstract_mesh()
        here = sharding if context.empty else NamedSharding(context, sharding.spec)
        return jax.lax.with_sharding_constraint(x, here)

    return constrain


def _index(tree: Any, i) -> Any:
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _ticks(stage_fn: StageFn, schedule: Schedule, chunks, shared, x, extras, aux_zeros):
    """The schedule on one stage (inside shard_map): (stage 0's slots after the last tick, summed aux)."""
    P, M = schedule.stages, schedule.microbatches
    p = jax.lax.axis_index(AXIS) if P > 1 else 0
    ring = [(i, (i + 1) % P) for i in range(P)]

    def tick(carry, t):
        state, slots, aux_sum = carry
        item = t - p
        valid = (item >= 0) & (item < M * schedule.repeats)
        r = jnp.clip(item // M, 0, schedule.repeats - 1)
        # Stage 0 starts each item from its slot (fresh input in round 0, the last stage's output after);
        # the others from what their predecessor handed over last tick.
        x_in = jnp.where(p == 0, _index(slots, t % M), state)
        y, aux = stage_fn(_index(chunks, r), shared, x_in, _index(extras, item % M), r * P + p)
        if aux is not None:
            kept = jax.tree.map(lambda a: jnp.where(valid, a, jnp.zeros_like(a)), aux)
            aux_sum = jax.tree.map(lambda s, a: s.at[r].add(a), aux_sum, kept)
        received = jax.lax.ppermute(y, AXIS, ring) if P > 1 else y
        # What stage 0 receives is the last stage's item t - (P - 1): keep it in that microbatch's slot.
        done = (t - (P - 1)) % M
        keep = (p == 0) & (t >= P - 1)
        slots = jax.lax.dynamic_update_index_in_dim(
            slots, jnp.where(keep, received, _index(slots, done)), done, 0
        )
        return (received, slots, aux_sum), None

    start = (jnp.zeros_like(x[0]), x, aux_zeros)
    (_, slots, aux_sum), _ = jax.lax.scan(tick, start, jnp.arange(schedule.ticks))
    return slots, aux_sum


def _widen_on_cpu(body: Callable, whole: tuple) -> tuple[Callable, tuple]:
    """On the CPU backend: (body taking the `whole` inputs with their bf16 leaves widened to f32, the
    widened inputs); elsewhere (body, whole) unchanged.

    Why: the transpose of an input given whole to every stage is a psum over `pipeline` in the
    input's dtype, and XLA CPU aborts compiling a bf16 all-reduce inside a shard_map manual over only
    some mesh axes (its AllReducePromotion pass rebuilds the reducer from its root, which the SPMD
    partitioner has made a `copy`: "Invalid binary instruction opcode copy"). Widening at the
    boundary makes that psum f32; the body narrows back, so the stages compute as before.
    """
    if not backend.on_cpu():
        return body, whole
    dtypes = jax.tree.map(lambda a: a.dtype, whole)
    wide = jax.tree.map(lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a, whole)

    def narrowed(staged, *args):
        return body(staged, *jax.tree.map(lambda a, d: a.astype(d), args, dtypes))

    return narrowed, wide


def run(
    stage_fn: StageFn,
    stage_params: Any,
    shared: Any,
    x: jax.Array,
    extras: Any,
    mesh: Mesh,
    schedule: Schedule,
) -> tuple[jax.Array, Any]:
    """Run microbatches x [M, rows, ...] through the stages: (outputs [M, rows, ...], aux).

    `stage_params` leaves are [layers, ...] in layer order (split over the `pipeline` mesh axis or
    not: they are resharded as the schedule needs); `extras` leaves are [M, ...] (microbatch m's side
    inputs); `shared` goes to every stage whole. `aux` is the stage function's per-layer pytree
    summed over microbatches, [layers, ...] in layer order (None when the stage function gives none).
    """
    if mesh.shape[AXIS] != schedule.stages:
        raise ValueError(f"schedule of {schedule.stages} stages on a mesh with pipeline={mesh.shape[AXIS]}")
    staged = to_stages(stage_params, schedule)
    chunk0 = jax.tree.map(lambda a: a[0, 0], staged)
    aux_shape = jax.eval_shape(
        lambda: stage_fn(chunk0, shared, x[0], _index(extras, 0), jnp.zeros((), jnp.int32))[1]
    )

    def body(staged, shared, x, extras):
        aux_zeros = jax.tree.map(lambda s: jnp.zeros((schedule.repeats, *s.shape), s.dtype), aux_shape)
        chunks = jax.tree.map(lambda a: a[0], staged)  # this stage's [repeats, layers per chunk, ...]
        slots, aux_sum = _ticks(stage_fn, schedule, chunks, shared, x, extras, aux_zeros)
        return slots[None], jax.tree.map(lambda a: a[None], aux_sum)

    if schedule.stages == 1:  # the same ticks without a shard_map: nothing to hand over
        slots, aux = body(staged, shared, x, extras)
        return slots[0], (None if aux is None else to_layers(aux))
    on_stages = jax.tree.map(lambda _: PartitionSpec(AXIS), staged)
    whole = PartitionSpec()
    body, (shared, x, extras) = _widen_on_cpu(body, (shared, x, extras))
    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(
            on_stages,
            jax.tree.map(lambda _: whole, shared),
            whole,
            jax.tree.map(lambda _: whole, extras),
        ),
        out_specs=(PartitionSpec(AXIS), jax.tree.map(lambda _: PartitionSpec(AXIS), aux_shape)),
        axis_names=frozenset({AXIS}),
        # Without the varying-axes checks: JAX 0.10.2 cannot differentiate a shard_map nested in a
        # checked one (MoE's expert parallelism inside a stage): the inner computation's residuals are
        # named with the outer manual axis and Shardy rejects them. Unchecked, transposes follow the
        # specs: an input given whole to every stage gets the sum of the stages' cotangents.
        check_vma=False,
    )
    slots, aux = fn(staged, shared, x, extras)
    # Stage 0's slots hold the outputs after the last tick; the others' are scratch.
    return slots[0], (None if aux is None else to_layers(aux))


def stages_of(mesh: Mesh | None) -> int:
    """The mesh's pipeline stages (1 without a mesh or a pipeline axis)."""
    return 1 if mesh is None else int(dict(mesh.shape).get(AXIS, 1))


def schedule_for(cfg: Config, mesh: Mesh | None) -> Schedule | None:
    """The config's schedule on `mesh` (None: train.pipeline is null, or there is no mesh to run on).

    Raises ConfigError when mesh.pipeline > 1 has no train.pipeline to say how to feed its stages.
    """
    stages = stages_of(mesh)
    pipe = cfg.train.pipeline
    if pipe is None:
        if stages > 1:
            raise ConfigError(
                f"mesh.pipeline={stages} needs train.pipeline.microbatches (how many microbatches flow "
                f"through the stages, e.g. train.pipeline.microbatches={2 * stages})"
            )
        return None
    if mesh is None:
        return None
    return Schedule(stages=stages, microbatches=pipe.microbatches, repeats=pipe.repeats)
