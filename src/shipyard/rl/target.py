"""`shipyard rl`'s trainer update lowered for a target's compile-only devices (parallel/targets.py).

The program an RL run compiles on a TPU slice or on GPUs, built by the functions the run itself uses
(`step.on_policy_model`, `placement.placement_for`, `step.make_update`) and traced for the target's
platform (`backend.compiling_for`: the CPU-only paths and XLA:CPU options stay out), with abstract
arrays on the run's placement, so nothing is allocated. tests/test_targets.py compiles it for a TPU
and a GPU target.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from shipyard.config import MeshConfig, ModelConfig, RLConfig
from shipyard.model.params import abstract_params, param_shardings
from shipyard.parallel import backend
from shipyard.parallel.mesh import logical_to_pspec, make_mesh, rules_for
from shipyard.rl.placement import placement_for
from shipyard.rl.step import build_optimizer, make_update, on_policy_model, sequence_length


def lower_update(model: ModelConfig, rl: RLConfig, longest: int, devices: Sequence[jax.Device]):
    """(the lowered update of an RL run with `rl`'s settings and prompts of up to `longest` tokens,
    its rows' length, the mesh it is lowered on): rl.mesh over `devices`, or the first of them
    without one (as the run places it)."""
    with backend.compiling_for(devices):
        length = sequence_length(longest, rl.max_tokens)  # the platform's, as the run sizes it
        model = on_policy_model(model, length)
        place = placement_for(model, rl, length, devices)
        if place.layout is not None:
            mesh, rules = place.layout.mesh, place.layout.rules
        else:  # one device: every array whole on it
            mesh, rules = make_mesh(MeshConfig(), devices[:1]), rules_for(MeshConfig())
        specs = place.partition.trainable_specs()
        trainable = abstract_params(specs, param_shardings(specs, mesh, rules))
        frozen = place.partition.abstract_frozen(place.partition.frozen_shardings(mesh, rules))
        optimizer = build_optimizer(rl)
        # The optimizer state where its own initialisation puts it (moments sharded as their params);
        # what depends on no input (the step count) XLA leaves on the host's default device: the run
        # holds it on the mesh, replicated.
        init = jax.jit(optimizer.init).lower(trainable).compile()
        everywhere = NamedSharding(mesh, PartitionSpec())

        def on_mesh(a, sharding):
            inside = sharding.device_set <= set(mesh.devices.flat)
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding if inside else everywhere)

        opt_state = jax.tree.map(on_mesh, jax.eval_shape(optimizer.init, trainable), init.output_shardings)
        update = make_update(model, rl, optimizer, place.partition, place.layout)
        lowered = update.lower(
            trainable, opt_state, _batch(rl, length, mesh, rules), frozen, trainable if rl.beta else None
        )
    return lowered, length, mesh


def _batch(rl: RLConfig, length: int, mesh, rules) -> dict:
    """The abstract trainer batch (rollout.build_batch's arrays), rows split as the placement splits them."""
    rows = rl.prompts_per_step * rl.group_size
    split = logical_to_pspec(("batch", "seq"), (rows, length), mesh, rules)[0]

    def array(shape, dtype):
        spec = PartitionSpec(split, *([None] * (len(shape) - 1)))
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    return {
        "tokens": array((rows, length), jax.numpy.int32),
        "mask": array((rows, length - 1), jax.numpy.float32),
        "old_logp": array((rows, length - 1), jax.numpy.float32),
        "advantages": array((rows,), jax.numpy.float32),
    }
