"""Prompt log-probs (echo): the training forward, the head in chunks, never [length, vocab] at once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from model_fixtures import noisy_params

from shipyard.config import load_config
from shipyard.inference.scoring import CHUNK, _scores, prompt_logprobs
from shipyard.model.transformer import logits


def test_chunked_prompt_logprobs_equal_the_whole_logits_log_softmax():
    cfg = load_config("tiny").model
    params = noisy_params(cfg, key=1, seed=4, scale=0.2)
    prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, 40).tolist()
    got = prompt_logprobs(params, cfg, prompt)
    whole = jax.nn.log_softmax(
        logits(jax.tree.map(jnp.asarray, params), jnp.asarray([prompt]), cfg)[0], axis=-1
    )
    want = np.asarray(whole)[np.arange(len(prompt) - 1), prompt[1:]]
    np.testing.assert_allclose([c for c, _ in got], want, rtol=0, atol=1e-5)
    # the chunks, 8 positions each here, give what one chunk of all of them gives
    tokens = jnp.zeros((1, 64), jnp.int32).at[0, :40].set(jnp.asarray(prompt))
    eight, one = (_scores(params, tokens, cfg, chunk) for chunk in (8, 64))
    for a, b in zip(eight, one):
        np.testing.assert_allclose(np.asarray(a)[:39], np.asarray(b)[:39], rtol=0, atol=1e-6)


def test_a_long_prompt_over_a_large_vocabulary_never_holds_its_whole_logits():
    """4,096 positions of a 32k vocabulary: 512 MiB of fp32 logits whole; the compiled scorer's
    temporaries stay under a quarter of that (the chunks are 8x smaller)."""
    cfg = load_config("tiny", ["model.vocab_size=32768", "model.max_seq_len=4096"]).model
    width = 4096
    params = jax.eval_shape(lambda: jax.tree.map(jnp.asarray, noisy_params(cfg, key=1, seed=4, scale=0.2)))
    tokens = jax.ShapeDtypeStruct((1, width), jnp.int32)
    compiled = _scores.lower(params, tokens, cfg, min(width, CHUNK)).compile()
    whole = width * cfg.vocab_size * 4
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < whole / 4, (temp / 2**20, whole / 2**20)
