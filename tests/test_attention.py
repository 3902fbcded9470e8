"""One attention, three callers: the training forward, the KV-cache forward (prefill + decode, left
padding) and the CPU decode step give the same next-token logits for every attention-related config field.

Each case combines several fields (GQA ratio, qk_norm, qkv_bias, sliding windows with interleaved global
layers, tied embeddings, Llama-3 RoPE scaling) rather than sweeping the full cross product. All three paths
see the same tokens (teacher forcing), so a difference anywhere in the caches shows in later logits too.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_fixtures import noisy_params

from shipyard.config import load_config
from shipyard.inference import cpu_decode
from shipyard.inference.decode import forward_cached, init_cache
from shipyard.model.transformer import logits

PROMPTS = [[5, 17, 99, 3, 8, 2], [42], [7, 8, 9, 10, 11, 12, 13, 14, 15]]
NEW = 6  # decode steps; prompts + steps run past every window below
ROPE = "model.rope_scaling={factor: 8.0, original_max_position: 16}"
ATOL = RTOL = 1e-5

CASES = {
    "mha-bias-tied": ["model.num_kv_heads=4", "model.qkv_bias=true", "model.tie_embeddings=true"],
    "gqa-qknorm-rope-window": ["model.qk_norm=true", ROPE, "model.sliding_window=3"],
    "mqa-window-global-bias-qknorm": [
        "model.num_kv_heads=1",
        "model.sliding_window=4",
        "model.global_attention_every=2",
        "model.qkv_bias=true",
        "model.qk_norm=true",
    ],
    "gqa8-3layers-global-every-3-rope-tied": [
        "model.num_heads=8",
        "model.num_kv_heads=2",
        "model.num_layers=3",
        "model.sliding_window=5",
        "model.global_attention_every=3",
        "model.tie_embeddings=true",
        ROPE,
    ],
}


def _case(overrides):
    cfg = load_config("tiny", ["model.scan_unroll=1", *overrides]).model
    params = noisy_params(cfg, key=4, seed=len(overrides), scale=0.2)
    rng = np.random.default_rng(7)
    follow = rng.integers(0, cfg.vocab_size, size=(len(PROMPTS), NEW)).astype(np.int32)
    return cfg, params, follow


def _full_forward(params, cfg, follow):
    """Per row, the training forward's logits over its prompt + following tokens alone: rows right-padded
    to one shape (causal attention makes position i blind to the padding after it), cut back to length."""
    seqs = [list(p) + f.tolist() for p, f in zip(PROMPTS, follow)]
    width = max(map(len, seqs))
    batch = jnp.asarray([s + [0] * (width - len(s)) for s in seqs], jnp.int32)
    out = np.asarray(jax.jit(partial(logits, cfg=cfg))(params, batch))
    return [row[: len(s)] for row, s in zip(out, seqs)]


def _prefill(params, cfg):
    B, P = len(PROMPTS), max(map(len, PROMPTS))
    tokens = np.zeros((B, P), np.int32)
    start = np.array([P - len(p) for p in PROMPTS], np.int32)
    for b, p in enumerate(PROMPTS):
        tokens[b, start[b] :] = p
    prefill = jax.jit(partial(forward_cached, cfg=cfg))
    got, cache = prefill(
        params, jnp.asarray(tokens), init_cache(cfg, B, P + NEW), jnp.int32(0), jnp.asarray(start)
    )
    return np.asarray(got), cache, jnp.asarray(start), P


def _close(got, want, what):
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL, err_msg=what)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", list(CASES.values()), ids=list(CASES))
def test_training_forward_cached_decode_and_cpu_decode_agree(overrides):
    cfg, params, follow = _case(overrides)
    if jax.default_backend() == "cpu":  # the CPU step implements every case here (and runs anywhere)
        assert cpu_decode.supported(params, cfg)
    want = _full_forward(params, cfg, follow)
    prefill, cache, start, P = _prefill(params, cfg)
    for b, prompt in enumerate(PROMPTS):  # every real prompt position, not just the last
        _close(prefill[b, P - len(prompt) :], want[b][: len(prompt)], f"prefill row {b}")
    cached = jax.jit(partial(forward_cached, cfg=cfg))
    step_cpu = jax.jit(partial(cpu_decode.decode_step, cfg=cfg))
    weights = jax.jit(partial(cpu_decode.prepare_weights, cfg=cfg))(params)
    layer_caches = cpu_decode.to_layer_caches(cache)
    for i in range(NEW):
        tok = jnp.asarray(follow[:, i : i + 1])
        got, cache = cached(params, tok, cache, jnp.int32(P + i), start)
        got_cpu, layer_caches = step_cpu(weights, tok, layer_caches, jnp.int32(P + i), start)
        for b, prompt in enumerate(PROMPTS):
            _close(np.asarray(got)[b, 0], want[b][len(prompt) + i], f"forward_cached step {i} row {b}")
            _close(np.asarray(got_cpu)[b, 0], want[b][len(prompt) + i], f"cpu decode step {i} row {b}")


@pytest.mark.parametrize("overrides", [[], CASES["mqa-window-global-bias-qknorm"]], ids=["causal", "windows"])
def test_packed_documents_see_only_themselves(overrides):
    """Segment ids (document masking) with positions restarting per document: each document's logits in a
    packed row equal the training forward of that document alone (and so the cached paths above)."""
    cfg, params, follow = _case(overrides)
    docs = [list(p) + f.tolist() for p, f in zip(PROMPTS, follow)]
    tokens = jnp.asarray([sum(docs, [])], jnp.int32)
    segments = jnp.asarray([sum(([i] * len(d) for i, d in enumerate(docs)), [])], jnp.int32)
    positions = jnp.asarray([sum((list(range(len(d))) for d in docs), [])], jnp.int32)
    forward = jax.jit(partial(logits, cfg=cfg))
    packed = np.asarray(forward(params, tokens, positions=positions, segment_ids=segments))[0]
    at = 0
    for doc, alone in zip(docs, _full_forward(params, cfg, follow)):
        _close(packed[at : at + len(doc)], alone, f"document at {at}")
        at += len(doc)


def test_the_ordered_core_is_the_softmax_and_gives_a_cached_query_the_full_forward_s_bits():
    """`attend(..., ordered=True)` (`model.attention_impl: ordered`) over 150 keys (three key blocks,
    the last padded), GQA, a window and packed documents: the reference softmax's values and
    gradients within 1e-5. And one query over a longer cache holding its keys from slot 0 (the
    slots after them masked), in either cache layout, gets bitwise the full forward's row for it at
    every length (the property RL's on-policy rollouts rest on; tests/test_rl.py)."""
    from shipyard.inference.engine import decode_compiler_options
    from shipyard.model import attention

    B, T, K, G, D, S = 2, 150, 2, 2, 16, 200
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in
               ((B, T, K, G, D), (B, T, K, D), (B, T, K, D)))  # fmt: skip
    slots = jnp.arange(T)
    segments = jnp.asarray(np.repeat([[0, 1]], B, 0).repeat([90, 60], axis=1))
    seen = attention.mask(slots, slots, 37, segments)
    weight = jnp.asarray(rng.normal(size=(B, T, K, G, D)), jnp.float32)

    def loss(q, k, v, ordered):
        return jnp.sum(attention.attend(q, k, v, seen, ordered=ordered) * weight)

    grads = [jax.jit(jax.value_and_grad(partial(loss, ordered=o), (0, 1, 2)))(q, k, v) for o in (False, True)]
    (ref_value, ref_grads), (value, got) = grads
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for a, b in zip(got, ref_grads):
        np.testing.assert_allclose(a, b, atol=1e-5)

    # no YNNPACK fusions on either side, as `shipyard rl` compiles them
    jit = partial(jax.jit, compiler_options=decode_compiler_options())
    full = np.asarray(jit(partial(attention.attend, ordered=True))(q, k, v, attention.mask(slots, slots)))
    cache_k, cache_v = (jnp.pad(x, ((0, 0), (0, S - T), (0, 0), (0, 0))) for x in (k, v))
    layouts = {
        "seq-major": (attention.SEQ_MAJOR, cache_k, cache_v),
        "head-major": (attention.HEAD_MAJOR, cache_k.transpose(0, 2, 3, 1), cache_v.transpose(0, 2, 1, 3)),
    }
    for name, (layout, ck, cv) in layouts.items():
        step = jit(partial(attention.attend, layout=layout, ordered=True))
        for n in (1, 30, 64, 65, 99, 128, 129, 150):
            seen_n = (jnp.arange(S) < n)[None, None, :]
            row = np.asarray(step(q[:, n - 1 : n], ck, cv, seen_n))[:, 0]
            assert np.array_equal(row, full[:, n - 1]), (name, n)
