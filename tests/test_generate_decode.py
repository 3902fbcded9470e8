"""The engine's CPU decode step (fused weights, per-layer caches) against inference.decode.forward_cached."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_fixtures import noisy_params

from shipyard.config import load_config
from shipyard.inference import cpu_decode
from shipyard.inference.decode import forward_cached, init_cache
from shipyard.inference.engine import Engine

PROMPTS = [[5, 17, 99, 3, 8, 2], [42], [7, 8, 9, 10, 11, 12, 13, 14, 15]]


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model.tie_embeddings=true", "model.qk_norm=true"],
        ["model.rope_scaling={factor: 8.0, original_max_position: 64}", "model.num_heads=8"],
        ["model.qkv_bias=true"],
        ["model.sliding_window=4", "model.global_attention_every=2"],  # prompts run past the window
    ],
)
def test_cpu_decode_step_equals_forward_cached(overrides):
    cfg = load_config("tiny", overrides).model
    params = noisy_params(cfg, key=3, seed=2, scale=0.2)
    assert cpu_decode.supported(params, cfg)
    B, P = len(PROMPTS), max(map(len, PROMPTS))
    tokens = np.zeros((B, P), np.int32)
    start = np.array([P - len(p) for p in PROMPTS], np.int32)
    for b, p in enumerate(PROMPTS):
        tokens[b, start[b] :] = p
    _, cache = forward_cached(
        params, jnp.asarray(tokens), init_cache(cfg, B, P + 4), 0, jnp.asarray(start), cfg
    )
    ours = jax.jit(partial(cpu_decode.decode_step, cfg=cfg))
    reference = jax.jit(partial(forward_cached, cfg=cfg))
    weights = cpu_decode.prepare_weights(params, cfg)
    theirs, cache = cache, cpu_decode.to_layer_caches(cache)
    assert jax.tree.all(jax.tree.map(jnp.array_equal, cpu_decode.from_layer_caches(cache), theirs))
    step = jnp.asarray([[3], [77], [300]], jnp.int32)
    for i in range(4):  # feeding the same tokens to both, so any difference in the caches shows too
        got, cache = ours(weights, step, cache, np.int32(P + i), jnp.asarray(start))
        want, theirs = reference(params, step, theirs, np.int32(P + i), jnp.asarray(start))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-4, rtol=1e-4)
        ours_kv = cpu_decode.from_layer_caches(cache)
        np.testing.assert_allclose(np.asarray(ours_kv.k), np.asarray(theirs.k), atol=1e-5)
        np.testing.assert_allclose(np.asarray(ours_kv.v), np.asarray(theirs.v), atol=1e-5)
        step = jnp.argmax(want[:, -1], axis=-1)[:, None].astype(jnp.int32)


@pytest.mark.parametrize(
    "config, overrides",
    [("moe-tiny", [])],
)
def test_models_it_does_not_implement_decode_with_forward_cached(config, overrides):
    cfg = load_config(config, overrides).model
    params = noisy_params(cfg, key=3, seed=2, scale=0.2)
    assert not cpu_decode.supported(params, cfg)
    engine = Engine(params, cfg, max_batch=1, max_len=16)
    assert not engine.uses_cpu_decode and engine.decode_weights is engine.params
