"""Training on a device mesh against one device: the runs the sharding tests compare.

`run_steps` trains a few real steps of a config's train program on a mesh and takes the
gradients of its real gradient function before and after; `assert_same_training` says the
losses, grad norms and every gradient match a reference run within 1e-5 (relative to each
tensor's norm). tests/test_parallel.py, test_pipeline_parallel.py and test_context_parallel.py
all compare layouts this way.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from shipyard.config import Config, MeshConfig
from shipyard.data.loader import build_loader
from shipyard.model.params import init_params
from shipyard.parallel.mesh import make_mesh
from shipyard.train.program import TrainProgram, build_program
from shipyard.train.step import TrainState, init_state, make_gradient_fn


@dataclass
class Run:
    """What a few real train steps on one mesh produced."""

    state: TrainState
    losses: list[float]
    grad_norms: list[float]
    gradients: list
    """The full-batch gradients (host arrays) at the initial params and at the final params."""
    program: TrainProgram


def run_steps(cfg: Config, mesh_cfg: MeshConfig, devices, tokens, steps: int = 5, loss_mask=None) -> Run:
    """`steps` steps of the train program of `cfg` on `mesh_cfg` over `devices`, plus the gradients of
    its gradient function (train/step.py, with the program's shardings and its per-microbatch
    activation layout) before and after. `loss_mask` [batch, seq] defaults to all ones."""
    cfg = cfg.model_copy(update={"mesh": mesh_cfg})
    program = build_program(cfg, make_mesh(mesh_cfg, devices))
    state = init_state(
        cfg, init_params(program.specs, jax.random.key(0), program.shardings), program.optimizer
    )
    B, L = cfg.train.global_batch_size, cfg.data.seq_len
    gradient_fn = make_gradient_fn(cfg, program.eos_id, program.layout, program.partition)
    gradients = jax.jit(
        lambda params, batch: gradient_fn(params, None, batch, 1.0)[0],
        in_shardings=(program.shardings, program.batch_shardings),
    )
    loader = build_loader([tokens], [1.0], 0, B, L, cfg.model.vocab_size)
    mask = np.ones((B, L), np.float32) if loss_mask is None else loss_mask

    def batch(s):
        return jax.device_put({"tokens": loader.global_batch(s), "loss_mask": mask}, program.batch_shardings)

    grads = [jax.device_get(gradients(state.params, batch(0)))]
    losses, grad_norms = [], []
    for s in range(steps):
        state, m = program.train_step(state, batch(s), None)
        losses.append(float(m["loss"]))
        grad_norms.append(float(m["grad_norm"]))
    grads.append(jax.device_get(gradients(state.params, batch(steps))))
    return Run(state, losses, grad_norms, grads, program)


def assert_trees_close(got_tree, want_tree, tol: float = 1e-5) -> None:
    """Every leaf within `tol` of the reference, relative to that leaf's norm."""
    for (path, got), want in zip(
        jax.tree_util.tree_flatten_with_path(got_tree)[0], jax.tree.leaves(want_tree)
    ):
        scale = np.linalg.norm(want)
        error = np.linalg.norm(np.asarray(got) - want) / max(scale, 1e-30)
        assert error < tol or (scale == 0 and np.linalg.norm(got) == 0), (jax.tree_util.keystr(path), error)


def assert_same_training(run: Run, ref: Run) -> None:
    """Losses and grad norms within 1e-5, and every gradient before and after (AdamW and clipping
    would hide a constant gradient scale, a sum over shards instead of a mean, from the losses)."""
    np.testing.assert_allclose(run.losses, ref.losses, rtol=1e-5)
    np.testing.assert_allclose(run.grad_norms, ref.grad_norms, rtol=1e-5)
    for got, want in zip(run.gradients, ref.gradients):
        assert_trees_close(got, want)
