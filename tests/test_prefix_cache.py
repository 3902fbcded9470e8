"""The prefix cache (inference/prefix_cache.py): a prompt that shares a prefix with ones the engine
prefilled before computes only the blocks after it, and gets the reply and log-probs it gets with
the cache off, bit for bit."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest
from engine_fixtures import run_requests
from model_fixtures import noisy_params

from shipyard.config import load_config
from shipyard.inference.engine import Engine, Request, Sampling
from shipyard.inference.prefix_cache import BlockIndex

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


def _expected_hits(prompts, chunk: int) -> list[int]:
    """Prompt tokens each prompt can take from the ones before it (an independent count, for a store
    that evicts nothing): the whole blocks of the longest common prefix with an earlier prompt's full
    blocks, never the block of its own last token."""
    hits = []
    for i, p in enumerate(prompts):
        common = 0
        for q in prompts[:i]:
            n = 0
            while n < min(len(p), len(q)) and p[n] == q[n]:
                n += 1
            common = max(common, min(n, len(q) // chunk * chunk))
        hits.append(min(common // chunk, (len(p) - 1) // chunk) * chunk)
    return hits


def _prompts() -> list[list[int]]:
    """A shared head with other tails, a prompt extending an earlier one (a conversation's next turn),
    one cut short inside another, one ending on a block's end, the same prompt twice, a stranger."""
    head = _head(70, 0)
    prompts = [head + _head(n, 10 + n) for n in (5, 9, 1, 20, 3)]
    return prompts + [prompts[1] + [7, 8, 9], prompts[3][:60], head[:64], prompts[0], _head(40, 99)]


def test_replies_and_logprobs_with_the_cache_are_those_without_it_bit_for_bit(params):
    """Greedy replies and their log-probs are identical (not close: equal) with the cache on and off,
    and the cache reused exactly the tokens an independent count says it could; a store too small
    for the prompts evicts blocks and still changes nothing; the same holds in fixed-shape mode."""
    prompts = _prompts()
    off = _replies(Engine(params, CFG, max_batch=2, max_len=MAX_LEN, prefill_chunk=16), prompts)
    engine = Engine(params, CFG, max_batch=2, max_len=MAX_LEN, prefix_cache=8, prefill_chunk=16)
    on = _replies(engine, prompts)
    small = Engine(params, CFG, max_batch=2, max_len=MAX_LEN, prefix_cache=1, prefill_chunk=16)
    strangers = [_head(n, 90 + n) for n in (40, 41, 50)]  # 7 blocks: the store's 8 overflow
    pressed = _replies(small, prompts[:1] + strangers + prompts[1:])
    pressed = pressed[:1] + pressed[4:]
    for i, ((tokens, logprobs), (want, want_logprobs)) in enumerate(zip(on, off)):
        assert tokens == want and np.array_equal(logprobs, want_logprobs), i
        assert pressed[i][0] == want and np.array_equal(pressed[i][1], want_logprobs), i
    hits = _expected_hits(prompts, 16)
    assert sum(h > 0 for h in hits) >= 7  # the shared cases above did share
    assert engine.prefix.hits == sum(h > 0 for h in hits) and engine.prefix.hit_tokens == sum(hits)
    assert engine.prefix.lookups == len(prompts) and engine.prefix.evicted == 0
    # A hit's blocks are read from the store, not computed again: with the store's keys and values
    # spoiled, a prompt that hits it answers otherwise (a prefill that recomputed them would not notice).
    hits = engine.prefix.hits
    engine._store = jax.tree.map(lambda x: x + 1, engine._store)
    tokens, logprobs = _replies(engine, prompts[1:2])[0]
    assert engine.prefix.hits == hits + 1
    assert not np.array_equal(logprobs, off[1][1]), "the cached blocks were recomputed, not read"
    # the strangers pushed out the head's deeper blocks: the next prompt took its first block only
    assert small.prefix.evicted >= 3 and small.prefix.hits > 0 and small.prefix.held_tokens() <= 8 * 16

    fixed = [
        Engine(params, CFG, max_batch=2, max_len=MAX_LEN, fixed_shape=True, prefix_cache=n, prefill_chunk=64)
        for n in (0, 2)
    ]
    want, got = (_replies(e, prompts[:3]) for e in fixed)
    assert all(a[0] == b[0] and np.array_equal(a[1], b[1]) for a, b in zip(got, want))
    assert fixed[1].prefix.hits == 2  # (64-token blocks: the head's first)


def test_blocks_are_shared_and_the_least_recently_used_deepest_go_first():
    """A block shared by two prompts is kept once; a full store gives the least recently used blocks
    to a new prompt, the deepest of equally recent ones first, so a prefix never loses its start
    while keeping its end; a prompt ending on a block's end computes that block again."""
    index = BlockIndex(blocks=4, chunk=16, entries=1)
    a, b, c = (_head(40, s) for s in (1, 2, 3))

    def admit(p):
        reuse = index.plan(p, most=8)
        index.commit(reuse)
        return reuse

    first = admit(a)
    assert first.ids == () and len(first.put) == 2 and index.held_tokens() == 32
    shared = admit(a[:32] + c[:20])  # a's two blocks, then one of its own
    assert shared.ids == first.put and shared.length == 32 and len(shared.put) == 1
    assert index.held_tokens() == 48  # a's blocks once
    admit(b)  # one free block, and the deepest of the three used last (the third)
    assert index.evicted == 1
    assert index.cached(a[:32] + c[:20]) == 32 and index.cached(a[:32] + c[:40]) == 32  # a look
    assert admit(a + [1]).length == 32  # a read: a's blocks are now the newest
    admit(c)  # b's two go (used least recently), deepest first
    assert index.evicted == 3 and index.cached(b + [1]) == 0
    assert index.cached(a + [1]) == 32 and index.cached(c + [1]) == 32
    again = index.plan(a[:32], most=8)  # its last token's block is held, but must be computed
    assert again.length == 16 and again.put == ()
    long = index.plan(_head(100, 7), most=2)  # a prefill covers 2 blocks: at most 2 kept
    assert len(long.put) == 2
    index.clear()
    assert index.held_tokens() == 0 and index.cached(a + [1]) == 0


@pytest.mark.slow
def test_a_serving_engine_reuses_blocks_at_once_and_n_samples_share_one_prefill(params):
    """A started engine reuses a cached prefix from the next prompt on (the same prefill program with
    fewer pieces: nothing to compile); a group of 3 seeded samples and greedy requests beside it get
    exactly what an engine without the cache gives them."""
    head = _head(60, 4)
    seeded = [Sampling(max_tokens=10, temperature=0.9, top_k=20, seed=s, logprobs=True) for s in (1, 2, 3)]
    tails = [_head(n, 20 + n) for n in (5, 6, 9, 12)]
    plain = Engine(params, CFG, max_batch=4, max_len=MAX_LEN, prefill_chunk=16)
    want = [plain.generate([head + t], SAMPLING)[0] for t in tails]
    want_samples = [plain.generate([head + tails[0]], s)[0].tokens for s in seeded]

    engine = Engine(params, CFG, max_batch=4, max_len=MAX_LEN, prefix_cache=2, prefill_chunk=16)
    engine.compile()
    engine.start()
    try:
        first = run_requests(engine, [head + tails[1]], [SAMPLING])
        assert engine.prefix.hits == 0 and tuple(first[0][0]) == want[1].tokens
        second = run_requests(engine, [head + tails[2]], [SAMPLING])
        assert engine.prefix.hits == 1 and engine.prefix.hit_tokens == 48
        assert tuple(second[0][0]) == want[2].tokens
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
    assert results["greedy"] == want[3].tokens and results["again"] == want[2].tokens
    assert engine.prefix.hits == 4  # the group's one prefill, the greedy one, the repeated one


def test_new_weights_empty_the_cache(params):
    """After a swap no prompt reuses K/V the old weights computed: the reply is the new weights' own."""
    other = jax.tree.map(lambda x: x * 1.1, params)
    head = _head(70, 5)
    engine = Engine(params, CFG, max_batch=2, max_len=MAX_LEN, prefix_cache=2, prefill_chunk=16)
    engine.generate([head + [4]], SAMPLING)
    engine.swap(other)
    got = engine.generate([head + [9]], SAMPLING)[0].tokens
    assert engine.prefix.hits == 0 and engine.prefix.lookups == 2
    fresh = Engine(other, CFG, max_batch=2, max_len=MAX_LEN, prefill_chunk=16)
    assert got == fresh.generate([head + [9]], SAMPLING)[0].tokens
    engine.generate([head + [11]], SAMPLING)
    assert engine.prefix.hits == 1  # the new weights' prompt is reused
