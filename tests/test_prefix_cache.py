"""The prefix cache (inference/prefix_cache.py): a prompt that shares a prefix with one the engine
prefilled before computes only the rest, and gets the reply and log-probs it gets with the cache off."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest
from engine_fixtures import run_requests
from model_fixtures import noisy_params

from shipyard.config import load_config
from shipyard.inference.engine import Engine, Request, Sampling, prompt_bucket
from shipyard.inference.prefix_cache import PrefixIndex

CFG = load_config("tiny").model
MAX_LEN = 128
SAMPLING = Sampling(max_tokens=10, logprobs=True)


@pytest.fixture(scope="module")
def params():
    return noisy_params(CFG, key=3, seed=2, scale=0.2)


def _head(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, CFG.vocab_size, size=n).tolist()


def _replies(engine: Engine, prompts) -> list:
    """(tokens, log-probs) of each prompt, asked one after the other (each sees the cache the ones
    before it left)."""
    out = []
    for p in prompts:
        c = engine.generate([p], SAMPLING)[0]
        out.append((c.tokens, np.array(c.logprobs)))
    return out


def _expected_hits(prompts) -> list[int]:
    """Prompt tokens each prompt can take from the ones before it (an independent count: the longest
    common prefix with any earlier prompt, all but the last token, where the bucket shrinks)."""
    hits = []
    for i, p in enumerate(prompts):
        common = 0
        for q in prompts[:i]:
            n = 0
            while n < min(len(p), len(q)) and p[n] == q[n]:
                n += 1
            common = max(common, n)
        common = min(common, len(p) - 1)
        P = prompt_bucket(len(p), MAX_LEN - SAMPLING.max_tokens)
        hits.append(common if common and prompt_bucket(len(p) - common, P) < P else 0)
    return hits


def test_replies_and_logprobs_with_the_cache_equal_those_without(params):
    """A shared head with other tails, a prompt extending an earlier one (a conversation's next turn),
    one cut short inside another, the same prompt twice: greedy replies identical to an engine without
    the cache, log-probs within 1e-5 (the shorter prefill rounds differently, nothing more), and the
    cache reused exactly the tokens an independent count says it could."""
    head = _head(70, 0)
    prompts = [head + _head(n, 10 + n) for n in (5, 9, 1, 20, 3)]
    prompts += [prompts[1] + [7, 8, 9], prompts[3][:60], prompts[0], _head(40, 99)]
    off = _replies(Engine(params, CFG, max_batch=2, max_len=MAX_LEN), prompts)
    engine = Engine(params, CFG, max_batch=2, max_len=MAX_LEN, prefix_cache=8)
    on = _replies(engine, prompts)
    for (tokens, logprobs), (want, want_logprobs) in zip(on, off):
        assert tokens == want
        np.testing.assert_allclose(logprobs, want_logprobs, rtol=0, atol=1e-5)
    hits = _expected_hits(prompts)
    assert sum(h > 0 for h in hits) >= 6  # the shared cases above did share
    assert engine.prefix.hits == sum(h > 0 for h in hits) and engine.prefix.hit_tokens == sum(hits)
    assert engine.prefix.lookups == len(prompts)


def test_the_least_recently_used_prompt_is_evicted():
    """Two rows, three heads: the third prompt evicts the first one's row (used least recently), so
    its next prompt misses, while the third's hits."""
    index = PrefixIndex(2, 64)
    a, b, c = (_head(40, s) for s in (1, 2, 3))
    for p in (a, b, c):
        index.commit(p, index.plan(p), saved=0)
    assert index.plan(a + [5]).length == 0  # evicted
    reuse = index.plan(c + [5])
    assert reuse.length == 40 and reuse.put == reuse.entry  # an extension replaces its row
    index.commit(c + [5], reuse, saved=16)
    index.commit(a + [5], index.plan(a + [5]), saved=0)  # evicts b (c was used after it)
    assert index.plan(b + [5]).length == 0 and index.plan(c + [6]).length == 40
    same = index.plan(c + [5])  # the same prompt again: all but its last token, and no new row
    assert same.length == 40 and same.put == index.entries
    long = _head(100, 7)  # longer than a row: its first 64 tokens are kept, and reused
    index.commit(long, index.plan(long), saved=0)
    assert index.plan(long[:80] + [1]).length == 64 and index.held_tokens() <= 3 * 64


def test_a_serving_engine_compiles_the_shorter_prefill_aside_and_n_samples_share_it(params):
    """A started engine never waits for the shorter prefill's compilation (it prefills whole while a
    thread compiles it), then uses it: a group of 3 seeded samples and a greedy request beside it
    get exactly what an engine without the cache gives them."""
    head = _head(60, 4)
    seeded = [Sampling(max_tokens=10, temperature=0.9, top_k=20, seed=s, logprobs=True) for s in (1, 2, 3)]
    tails = [_head(n, 20 + n) for n in (5, 6, 9, 12)]  # one bucket (118 slots), one chunk (16)
    plain = Engine(params, CFG, max_batch=4, max_len=MAX_LEN)
    want = [plain.generate([head + t], SAMPLING)[0].tokens for t in tails]
    want_samples = [plain.generate([head + tails[0]], s)[0].tokens for s in seeded]

    engine = Engine(params, CFG, max_batch=4, max_len=MAX_LEN, prefix_cache=2)
    engine.compile()
    engine.start()
    try:
        first = run_requests(engine, [head + tails[1]], [SAMPLING])
        assert engine.prefix.hits == 0 and tuple(first[0][0]) == want[1]
        run_requests(engine, [head + tails[2]], [SAMPLING])  # a hit, but the program is compiling
        assert engine.prefix.hits == 0
        for _ in range(600):  # (the thread's compilation: about 2 s here)
            if engine.programs_ready():
                break
            threading.Event().wait(0.1)
        results: dict = {}
        done = threading.Event()

        def collect(key):
            acc = []

            def on_tokens(tokens, _lp, finish):
                acc.extend(tokens)
                if finish:
                    results[key] = tuple(acc)
                    if len(results) == 5:
                        done.set()

            return on_tokens

        engine.submit_group([Request(head + tails[0], s, collect(i)) for i, s in enumerate(seeded)])
        engine.submit(Request(head + tails[3], SAMPLING, collect("greedy")))
        engine.submit(Request(head + tails[2], SAMPLING, collect("again")))
        assert done.wait(120), results
    finally:
        engine.stop()
    assert [results[i] for i in range(3)] == want_samples
    assert results["greedy"] == want[3] and results["again"] == want[2]
    assert engine.prefix.hits == 3  # the group's one prefill, the greedy one, the repeated one


def test_new_weights_empty_the_cache(params):
    """After a swap no prompt reuses K/V the old weights computed: the reply is the new weights' own."""
    other = jax.tree.map(lambda x: x * 1.1, params)
    head = _head(70, 5)
    engine = Engine(params, CFG, max_batch=2, max_len=MAX_LEN, prefix_cache=2)
    engine.generate([head + [4]], SAMPLING)
    engine.swap(other)
    got = engine.generate([head + [9]], SAMPLING)[0].tokens
    assert engine.prefix.hits == 0 and engine.prefix.lookups == 2
    assert got == Engine(other, CFG, max_batch=2, max_len=MAX_LEN).generate([head + [9]], SAMPLING)[0].tokens
    engine.generate([head + [11]], SAMPLING)
    assert engine.prefix.hits == 1  # the new weights' prompt is reused


def test_fixed_shape_refuses_the_cache(params):
    with pytest.raises(ValueError, match="fixed_shape promises replies bitwise independent"):
        Engine(params, CFG, max_batch=2, max_len=MAX_LEN, fixed_shape=True, prefix_cache=2)
