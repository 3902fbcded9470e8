"""The continuous-batching engine: every request gets exactly what it would get alone."""

from __future__ import annotations

import threading

import jax.numpy as jnp
import numpy as np
import pytest
from engine_fixtures import complete, run_requests
from model_fixtures import noisy_params

from shipyard.config import load_config
from shipyard.inference.decode import forward_cached, init_cache
from shipyard.inference.engine import Engine, Request, Sampling, prompt_bucket
from shipyard.model.quantize import maybe_quantize

# Heavy compiles and end-to-end runs: the `make test-slow` tier (docs/testing.md: tiers).
pytestmark = pytest.mark.slow

RNG = np.random.default_rng(0)
LENS = (5, 17, 1, 30, 9, 12, 3, 40, 22, 8)
NEW = (12, 5, 20, 7, 16, 1, 9, 11, 14, 6)


def _prompts(vocab):
    return [RNG.integers(3, vocab, size=n).tolist() for n in LENS]


def _run(engine: Engine, prompts, sampling) -> list[tuple[list[int], str]]:
    return run_requests(engine, prompts, sampling)


@pytest.mark.parametrize(
    "config, quantize, kv_dtype",
    [("tiny", None, None), ("tiny", "int8", "bfloat16"), ("moe-tiny", None, None)],
)
def test_batched_requests_equal_each_alone(config, quantize, kv_dtype):
    cfg = load_config(config).model
    params = maybe_quantize(noisy_params(cfg, key=3, seed=2, scale=0.2), cfg, quantize)
    prompts = _prompts(cfg.vocab_size)
    # the reference: each request alone, one after the other, in a one-row engine driven by the caller
    alone = Engine(params, cfg, max_batch=1, max_len=128, tokens_per_call=3, kv_dtype=kv_dtype)
    want = [complete(alone, [p], n)[0] for p, n in zip(prompts, NEW)]
    engine = Engine(params, cfg, max_batch=4, max_len=128, tokens_per_call=3, kv_dtype=kv_dtype).start()
    try:
        got = _run(engine, prompts, [Sampling(max_tokens=n) for n in NEW])
    finally:
        engine.stop()
    assert all(f == "length" for _, f in got)
    if quantize is None:
        assert [t for t, _ in got] == want
    else:
        # int8 decode steps run their dots through YNNPACK (the fp32 attention ones too), whose fp32
        # reductions may be split differently from call to call: a near-tie of this noisy random model can
        # flip late in a reply, so int8 is held to most replies equal and every reply's start.
        same = sum(t == w for (t, _), w in zip(got, want))
        assert same >= 8 and all(t[:3] == w[:3] for (t, _), w in zip(got, want)), (same, got, want)


def test_stop_ids_seeds_and_cancel():
    cfg = load_config("tiny").model
    params = noisy_params(cfg, key=3, seed=2, scale=0.2)
    prompts = _prompts(cfg.vocab_size)[:4]
    engine = Engine(params, cfg, max_batch=2, max_len=96).start()
    try:
        greedy = _run(engine, prompts, [Sampling(max_tokens=20)] * 4)
        stop_at = greedy[0][0][4]
        stopped = _run(engine, prompts[:1], [Sampling(max_tokens=20, stop_ids=(stop_at,))])[0]
        assert stopped == (greedy[0][0][: greedy[0][0].index(stop_at) + 1], "stop")
        hot = [Sampling(max_tokens=15, temperature=1.0, top_k=40, top_p=0.9, seed=s) for s in (1, 1, 2, 1)]
        a = _run(engine, prompts[:1] * 4, hot)  # same seed, same reply, whichever slot and neighbours
        assert a[0] == a[1] == a[3] and a[2] != a[0]
        # a cancelled request frees its slot: with both slots held by endless requests cancelled,
        # a third still runs
        holders = [Request(prompts[0], Sampling(max_tokens=90), lambda *_: None) for _ in range(2)]
        for r in holders:
            engine.submit(r)
        for r in holders:
            r.cancel()
        assert _run(engine, prompts[1:2], [Sampling(max_tokens=3)])[0][1] == "length"
        assert all(r.finished for r in holders) and engine.active() == 0
    finally:
        engine.stop()


def test_per_row_positions_equal_one_position_per_call():
    """forward_cached with a [batch] of cache slots computes what each row computes at its own slot."""
    cfg = load_config("tiny").model
    params = noisy_params(cfg, key=1, seed=4, scale=0.2)
    cache = init_cache(cfg, 2, 32)
    tokens = jnp.asarray([[5, 6, 7, 8], [9, 10, 11, 12]])
    _, cache = forward_cached(params, tokens, cache, jnp.int32(0), jnp.asarray([0, 2]), cfg)
    step = jnp.asarray([[3], [4]])
    got, _ = forward_cached(params, step, cache, jnp.asarray([4, 6]), jnp.asarray([0, 2]), cfg)
    for row, pos in ((0, 4), (1, 6)):
        one = jnp.asarray([pos])
        want, _ = forward_cached(
            params, step[row : row + 1], _row(cache, row), one, jnp.asarray([(0, 2)[row]]), cfg
        )
        np.testing.assert_allclose(np.asarray(got[row]), np.asarray(want[0]), atol=1e-5)


def _row(cache, b):
    return type(cache)(cache.k[:, b : b + 1], cache.v[:, b : b + 1])


def test_refusals_and_buckets():
    cfg = load_config("tiny").model
    engine = Engine(noisy_params(cfg, key=0, seed=0, scale=0.1), cfg, max_batch=1, max_len=64)
    with pytest.raises(ValueError, match="exceeds the context of 64"):
        engine.submit(Request([1] * 60, Sampling(max_tokens=5), lambda *_: None))
    with pytest.raises(ValueError, match="max_len"):
        Engine(noisy_params(cfg, key=0, seed=0, scale=0.1), cfg, max_len=cfg.max_seq_len + 1)
    assert [prompt_bucket(n, 100) for n in (1, 16, 17, 33, 90)] == [16, 16, 32, 64, 100]


def test_fixed_shape_compiles_one_decode_program_and_changes_no_output():
    cfg = load_config("tiny").model
    params = noisy_params(cfg, key=3, seed=2, scale=0.2)
    prompts = _prompts(cfg.vocab_size)[:6]
    sampling = [Sampling(max_tokens=n) for n in NEW[:6]]
    engine = Engine(params, cfg, max_batch=4, max_len=128, fixed_shape=True)
    assert engine.shapes() == [(4, 128)]
    engine.start()
    try:
        together = _run(engine, prompts, sampling)
        alone = [_run(engine, [p], [s])[0] for p, s in zip(prompts, sampling)]
    finally:
        engine.stop()
    assert together == alone
    assert engine._decode._cache_size() == 1


def test_n_samples_of_a_prompt_share_one_prefill_and_equal_each_alone():
    """A group of 4 samples of one prompt (submit_group, what the server does for n=4) is prefilled as
    one row, beside a request already decoding; each sample (its own seed) equals that request sent
    alone, and greedy samples are all the greedy reply."""
    import threading

    cfg = load_config("tiny").model
    params = noisy_params(cfg, key=3, seed=2, scale=0.2)
    prompt, other = _prompts(cfg.vocab_size)[1:3]
    hot = [Sampling(max_tokens=9, temperature=0.9, top_k=20, seed=7 + j) for j in range(4)]
    alone = Engine(params, cfg, max_batch=1, max_len=96, tokens_per_call=3)
    want = [complete(alone, [prompt], 9, temperature=0.9, top_k=20, seed=7 + j)[0] for j in range(4)]
    greedy = complete(alone, [prompt], 9)[0]
    assert len({tuple(w) for w in want}) > 1  # the samples differ, so sharing cannot hide a mix-up

    # 5 slots: the lone request and one group run, the second group waits for the first to end
    engine = Engine(params, cfg, max_batch=5, max_len=96, tokens_per_call=3)
    rows_prefilled = []
    admit = engine._admit

    def counting(params, rows, caches, tokens, *rest, **kw):
        rows_prefilled.append(tokens.shape[0])
        return admit(params, rows, caches, tokens, *rest, **kw)

    engine._admit = counting
    engine.start()
    try:
        results: dict = {}
        done = threading.Event()

        def collect(key, total):
            acc = []

            def on_tokens(tokens, _lp, finish):
                acc.extend(tokens)
                if finish:
                    results[key] = acc
                    if len(results) == total:
                        done.set()

            return on_tokens

        engine.submit(Request(other, Sampling(max_tokens=30), collect("other", 9)))
        engine.submit_group([Request(prompt, s, collect(j, 9)) for j, s in enumerate(hot)])
        engine.submit_group([Request(prompt, Sampling(max_tokens=9), collect(f"g{j}", 9)) for j in range(4)])
        assert done.wait(120), results.keys()
    finally:
        engine.stop()
    assert [results[j] for j in range(4)] == want
    assert all(results[f"g{j}"] == greedy for j in range(4))
    assert rows_prefilled == [1, 1, 1]  # the lone request, then each group of 4: one prompt row each
    with pytest.raises(ValueError, match="does not fit 5 slots"):
        engine.submit_group([Request(prompt, Sampling(max_tokens=2), lambda *a: None)] * 6)


def test_replies_crossing_a_decode_shape_boundary_equal_the_full_forward():
    """A reply whose decode call ends exactly at a decode shape's last slot (a prompt in the 32-slot
    bucket, 8 steps a call: 32 + 4 x 8 = 64) goes on in the next shape with nothing lost. The
    regression: that row's position was held at 63, so the next call wrote over its last token,
    and every reply of a short prompt past 32 tokens went wrong there (greedy equal to a sized
    engine's own, wrong against the model). The reference is the full forward, greedy, one token at
    a time (right-padded to one length: causal, so the padding changes nothing before it)."""
    import jax

    from shipyard.model.transformer import logits

    cfg = load_config("tiny").model
    params = noisy_params(cfg, key=3, seed=2, scale=0.2)
    prompt, new = RNG.integers(3, cfg.vocab_size, size=20).tolist(), 60
    full = jax.jit(lambda ids: logits(params, ids, cfg))
    ids = list(prompt)
    for _ in range(new):
        padded = np.zeros((1, 128), np.int32)
        padded[0, : len(ids)] = ids
        ids.append(int(np.argmax(np.asarray(full(jnp.asarray(padded)))[0, len(ids) - 1])))
    for per_call in (8, 1):
        engine = Engine(params, cfg, max_batch=2, max_len=128, tokens_per_call=per_call)
        assert complete(engine, [prompt], new)[0] == ids[len(prompt) :], per_call


def test_a_server_compiling_only_the_first_programs_answers_before_the_rest_are_ready():
    """`compile(first_only=True)` prepares the one-row shape, the whole cache and the small buckets;
    a started engine answers at once, a call that needs a shape not compiled yet running on the
    whole cache meanwhile (the same replies as an engine that compiled everything), while
    `compile_rest` compiles the others on a thread; then they are used."""
    cfg = load_config("tiny").model
    params = noisy_params(cfg, key=3, seed=2, scale=0.2)
    prompts = _prompts(cfg.vocab_size)[:3]
    reference = Engine(params, cfg, max_batch=4, max_len=256)
    want = [complete(reference, [p], 100)[0] for p in prompts]
    engine = Engine(params, cfg, max_batch=4, max_len=256)
    engine.compile(first_only=True)
    assert engine.first_programs()[0] == [(1, 256), (4, 256)]
    engine.start()
    try:
        assert engine.compile_rest() == engine.compilations() - sum(map(len, engine.first_programs()))
        # three at once: (4, 64) first, not compiled yet (the whole cache's shape runs them meanwhile)
        first = _run(engine, prompts, [Sampling(max_tokens=100)] * 3)
        for _ in range(600):
            if engine.programs_ready():
                break
            threading.Event().wait(0.1)
        assert engine._aside[("decode", 4, 64)] is not None
        rest = _run(engine, prompts, [Sampling(max_tokens=100)] * 3)
    finally:
        engine.stop()
    assert [t for t, _ in first] == want and [t for t, _ in rest] == want
