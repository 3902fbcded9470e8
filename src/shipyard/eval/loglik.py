"""Log-likelihoods of token sequences under a model: per-token log-probs, (context, continuation)
scores, and the UTF-8 bytes each token stands for (bits per byte compare models with different
tokenizers; with a byte-level BPE vocabulary a token's byte count is the length of its vocabulary
string, special tokens count zero)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from shipyard.model.transformer import logits as model_logits


@partial(jax.jit, static_argnames=("cfg",))
def token_logprobs(params, tokens, cfg):
    """log p(tokens[:, i+1] | tokens[:, :i+1]) and whether it was the argmax, for every position."""
    out = model_logits(params, tokens[:, :-1], cfg)
    logp = jax.nn.log_softmax(out, axis=-1)
    target = tokens[:, 1:]
    picked = jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
    return picked, jnp.argmax(out, axis=-1) == target


def loglikelihoods(
    params, cfg, pairs: Sequence[tuple[list[int], list[int]]], batch: int = 16
) -> list[tuple[float, bool]]:
    """(sum of log p(continuation | context), continuation is the greedy choice) per (context, continuation).

    Sequences are cut from the left to the model's context and right-padded to
    a multiple of 64 tokens (few distinct shapes: few compilations); causal
    attention makes the padding invisible to the scored positions.
    """
    out = []
    limit = cfg.max_seq_len + 1
    for i in range(0, len(pairs), batch):
        chunk = pairs[i : i + batch]
        seqs = [(ctx + cont)[-limit:] for ctx, cont in chunk]
        width = -(-max(len(s) for s in seqs) // 64) * 64
        tokens = np.zeros((batch, max(width, 2)), np.int32)
        for r, s in enumerate(seqs):
            tokens[r, : len(s)] = s
        logp, greedy = (np.asarray(x) for x in token_logprobs(params, jnp.asarray(tokens), cfg))
        for r, ((_, cont), s) in enumerate(zip(chunk, seqs)):
            n = min(len(cont), len(s) - 1)
            positions = slice(len(s) - 1 - n, len(s) - 1)  # logits at position j predict token j + 1
            out.append((float(logp[r, positions].sum()), bool(greedy[r, positions].all())))
    return out


def token_byte_lengths(tok) -> np.ndarray:
    """UTF-8 bytes each token id stands for (byte-level BPE: one vocabulary character per byte)."""
    vocab = tok.get_vocab(with_added_tokens=True)
    lengths = np.zeros(tok.get_vocab_size(with_added_tokens=True), np.int64)
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    for token, i in vocab.items():
        lengths[i] = 0 if token in special else len(token)
    return lengths
