"""train.offload: optimizer state and master params in pinned host memory, streamed for the step."""

import jax
import numpy as np
import pytest

from shipyard.config import CheckpointConfig, OffloadConfig, load_config
from shipyard.errors import ConfigError
from shipyard.model.params import init_params
from shipyard.parallel.mesh import make_mesh
from shipyard.run.checkpoint import Checkpointer, checkpoint_dir, restore
from shipyard.train import offload
from shipyard.train.program import build_program
from shipyard.train.step import init_state

# Heavy compiles and end-to-end runs: the `make test-slow` tier (docs/testing.md: tiers).
pytestmark = pytest.mark.slow

OVER = ["train.global_batch_size=8", "data.seq_len=16", "mesh.data=1", "mesh.fsdp=2"]


def _memory_kinds(tree) -> set:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree) if x.ndim > 0}


def _steps(cfg, steps=3):
    """(program, state after `steps` train steps, their metrics) from the same init and batches."""
    program = build_program(cfg, make_mesh(cfg.mesh, jax.devices()[:2]))
    state = init_state(
        cfg, init_params(program.specs, jax.random.key(0), program.shardings), program.optimizer
    )
    rng = np.random.default_rng(0)
    metrics = []
    for _ in range(steps):
        tokens = rng.integers(0, cfg.model.vocab_size, (8, 17)).astype(np.int32)
        batch = jax.device_put(
            {"tokens": tokens, "loss_mask": np.ones((8, 16), np.float32)}, program.batch_shardings
        )
        state, m = program.train_step(state, batch, None)
        metrics.append(jax.device_get(m))
    return program, state, metrics


@pytest.fixture(scope="module")
def plain():
    return _steps(load_config("tiny", OVER))


@pytest.fixture(scope="module")
def offloaded():
    over = [*OVER, "train.offload.optimizer=true", "train.offload.params=true"]
    return _steps(load_config("tiny", over))


def test_offloaded_steps_equal_plain_ones_and_state_stays_on_the_host(plain, offloaded):
    (_, p_state, p_metrics), (program, o_state, o_metrics) = plain, offloaded
    assert _memory_kinds(o_state.opt_state) == _memory_kinds(o_state.params) == {"pinned_host"}
    assert _memory_kinds(program.abstract_state.opt_state) == {"pinned_host"}  # what the step's shardings say
    assert _memory_kinds(p_state.opt_state) == {"device"}
    for a, b in zip(p_metrics, o_metrics):
        for key in ("loss", "grad_norm", "update_norm", "param_norm"):
            assert a[key] == b[key], key  # bitwise: the same computation, only where the state waits
    for a, b in zip(jax.tree.leaves(jax.device_get(p_state)), jax.tree.leaves(jax.device_get(o_state))):
        np.testing.assert_array_equal(a, b)
    # The planner's view: what stays off the device, per device (fsdp=2: half of each).
    host = offload.host_state_bytes(program.abstract_state)
    params = sum(x.size * 4 for x in jax.tree.leaves(p_state.params))
    assert host["params"] == params / 2
    assert host["optimizer"] == 2 * params / 2  # AdamW's two moments; the scalar count stays
    assert offload.host_state_bytes(plain[0].abstract_state) == {"params": 0.0, "optimizer": 0.0}


def test_offloaded_state_checkpoints_and_restores_onto_the_host(offloaded, tmp_path):
    program, state, _ = offloaded
    saver = Checkpointer(tmp_path, CheckpointConfig(every=1), total_steps=3)
    saver.save(3, state, wait=True)
    saver.close()
    back = restore(checkpoint_dir(tmp_path), 3, program.abstract_state)
    assert _memory_kinds(back.opt_state) == {"pinned_host"}
    for a, b in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(jax.device_get(back))):
        np.testing.assert_array_equal(a, b)
    ce, tokens = program.eval_step(back.params, None, {"tokens": np.zeros((8, 17), np.int32)})
    assert np.isfinite(float(ce)) and float(tokens) == 8 * 16


class _Memory:
    def __init__(self, kind):
        self.kind = kind


class _GpuWithoutHost:
    platform = "gpu"

    def addressable_memories(self):
        return [_Memory("device")]


def test_a_backend_without_host_memory_is_refused_in_one_line():
    with pytest.raises(ConfigError) as e:
        offload.check(OffloadConfig(optimizer=True), [_GpuWithoutHost()])
    assert str(e.value).count("\n") == 0
    assert "gpu backend's devices have no pinned_host memory (they have device)" in str(e.value)
    offload.check(OffloadConfig(), [_GpuWithoutHost()])  # nothing asked: nothing to refuse
    offload.check(OffloadConfig(optimizer=True, params=True), jax.devices())  # CPU has pinned_host
