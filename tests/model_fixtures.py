"""Random models for tests that compare implementations."""

import jax
import numpy as np

from shipyard.model.params import init_params
from shipyard.model.transformer import param_specs


def noisy_params(cfg, key: int, seed: int, scale: float):
    """The init plus Gaussian noise on every tensor (norm scales too): a mapping mistake cannot hide, and
    larger weights give peaked distributions, so greedy choices are clear-cut."""
    params = init_params(param_specs(cfg), jax.random.key(key))
    leaves, tree = jax.tree.flatten(params)
    rng = np.random.default_rng(seed)
    return jax.tree.unflatten(
        tree, [np.asarray(x) + scale * rng.standard_normal(x.shape).astype(np.float32) for x in leaves]
    )
