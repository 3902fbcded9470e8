"""Log-probabilities of a given text under the model: what an `echo` request reports for its prompt.

Scored with the training forward (`transformer.hidden_states`, the function
the trainer differentiates), then the output head a chunk of positions at a
time, as the trainer's chunked loss does: a long prompt over a large
vocabulary never holds its [length, vocab] logits at once, only
[CHUNK, vocab] (2,048 positions of a 128k vocabulary: 1 GiB of logits
whole, 256 MiB per chunk).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from shipyard.config import ModelConfig
from shipyard.inference.engine import token_logprobs
from shipyard.model import layers
from shipyard.model.transformer import hidden_states, output_weights

CHUNK = 512
"""Positions whose logits are computed at once."""


@partial(jax.jit, static_argnames=("cfg", "chunk"))
def _scores(params, tokens, cfg: ModelConfig, chunk: int):
    """(chosen logprob [W], top logprobs [W, k], top ids [W, k]) of tokens[0, i + 1] after position i
    of tokens [1, W] (the last position's target is a placeholder)."""
    h = hidden_states(params, tokens, cfg)[0]
    targets = jnp.roll(tokens[0], -1)
    w = output_weights(params)

    def one(part):
        hc, tc = part
        return token_logprobs(layers.dense(hc, w).astype(jnp.float32), tc)

    width = tokens.shape[1]
    parts = (h.reshape(width // chunk, chunk, h.shape[-1]), targets.reshape(width // chunk, chunk))
    chosen, best, ids = jax.lax.map(one, parts)
    return chosen.reshape(width), best.reshape(width, -1), ids.reshape(width, -1)


def prompt_logprobs(params, cfg: ModelConfig, prompt: Sequence[int]) -> list[tuple[float, list]]:
    """log p(prompt[i] | prompt[:i]) with the top alternatives, for i = 1 .. len - 1 (an `echo` request).

    The prompt is right-padded to a power-of-two bucket (causal attention
    keeps the padding out of every scored position), so a server compiles
    few shapes.
    """
    n = len(prompt)
    if n < 2:
        return []
    width = max(16, 1 << (n - 1).bit_length())
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :n] = prompt
    out = _scores(params, jnp.asarray(tokens), cfg, min(width, CHUNK))
    chosen, best, ids = (np.asarray(x)[: n - 1] for x in out)
    return [(float(c), list(zip(i.tolist(), b.tolist()))) for c, b, i in zip(chosen, best, ids)]
