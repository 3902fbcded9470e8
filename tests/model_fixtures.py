"""Random models for tests that compare implementations."""

import jax
import numpy as np

from shipyard.model.params import is_spec
from shipyard.model.transformer import param_specs


def noisy_params(cfg, key: int, seed: int, scale: float):
    """The init's distribution (normal with each spec's std, ones, zeros) plus Gaussian noise on every
    tensor (norm scales too): a mapping mistake cannot hide, and larger weights give peaked distributions,
    so greedy choices are clear-cut. Drawn with numpy: compiling a jitted init costs ~0.5 s per tensor
    on CPU, which dominated these tests."""
    rng = np.random.default_rng([key, seed])

    def draw(spec):
        base = {"ones": 1.0, "zeros": 0.0}.get(spec.init)
        x = (
            np.full(spec.shape, base, np.float32)
            if base is not None
            else spec.std * rng.standard_normal(spec.shape)
        )
        return (x + scale * rng.standard_normal(spec.shape)).astype(np.float32)

    return jax.tree.map(draw, param_specs(cfg), is_leaf=is_spec)


def save_run(run_dir, cfg, params, step: int = 1) -> None:
    """A run directory shipyard can load: config.yaml and checkpoint `step` holding `params` (into an
    existing run: one more checkpoint)."""
    import jax.numpy as jnp

    from shipyard.config import to_yaml
    from shipyard.run.checkpoint import Checkpointer
    from shipyard.train.optim import build_optimizer
    from shipyard.train.step import init_state

    optimizer = build_optimizer(cfg.train, param_specs(cfg.model))
    state = init_state(cfg, jax.tree.map(jnp.asarray, params), optimizer)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    ckpt = Checkpointer(run_dir, cfg.train.checkpoint, cfg.train.steps)
    ckpt.save(step, state, wait=True)
    ckpt.close()
