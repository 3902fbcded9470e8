"""Speculative decoding (inference/speculation.py, inference/draft_model.py): prompt lookup's drafts,
the check, a draft model's drafts, and an engine that speculates giving the text an engine that does
not gives."""

from __future__ import annotations

import threading

import jax.numpy as jnp
import numpy as np
import pytest
from engine_fixtures import run_requests
from model_fixtures import noisy_params

from shipyard.config import load_config
from shipyard.inference import speculation
from shipyard.inference.engine import Engine, Sampling
from shipyard.inference.speculation import NO_DRAFT, lookup_draft, verify

CFG = load_config("tiny").model
MAX_LEN = 160


def test_the_draft_is_what_followed_the_latest_earlier_occurrence_of_the_tail():
    assert lookup_draft([1, 2, 3, 4, 1, 2], 3).tolist() == [3, 4, 1]  # no 3-gram match: the 2-gram [1, 2]
    assert lookup_draft([5, 6, 7, 9, 5, 6, 7, 8, 5, 6, 7], 2).tolist() == [8, 5]  # the latest one
    assert lookup_draft([7, 8, 9, 7, 8], 4).tolist() == [9, 7, 8, NO_DRAFT]  # cut by the context's end
    assert lookup_draft([1, 2, 3], 2).tolist() == [NO_DRAFT, NO_DRAFT]  # nothing repeats
    assert lookup_draft([1, 2, 3, 1], 2).tolist() == [NO_DRAFT, NO_DRAFT]  # one token alone is no match
    assert lookup_draft([4], 2).tolist() == [NO_DRAFT, NO_DRAFT]


def test_drafts_are_kept_up_to_the_first_the_model_disagrees_with():
    vocab = 6
    choices = np.array([[2, 3, 4, 5], [1, 1, 1, 1], [0, 5, 5, 5]])  # the model's argmax at each position
    logits = jnp.asarray(np.eye(vocab)[choices] * 3.0)
    drafts = jnp.asarray([[2, 3, 0], [1, 1, 1], [4, 5, 5]])
    greedy, kept = verify(logits, drafts)
    assert np.asarray(greedy).tolist() == choices.tolist()
    # row 0: 2, 3 agree, 0 does not (the model says 4): 2 drafts + the model's 4; row 1: all + 1; row 2: none
    assert np.asarray(kept).tolist() == [3, 4, 1]
    _, kept = verify(logits, jnp.asarray([[NO_DRAFT] * 3] * 3))
    assert np.asarray(kept).tolist() == [1, 1, 1]


def _prompts():
    rng = np.random.default_rng(5)
    loop = rng.integers(3, CFG.vocab_size, size=6).tolist()
    # repeated stretches (what prompt lookup finds) and plain random ones
    return [loop * 4, rng.integers(3, CFG.vocab_size, size=30).tolist(), loop[:3] * 5 + [9], [11, 12] * 9]


@pytest.fixture(scope="module")
def params():
    return noisy_params(CFG, key=3, seed=2, scale=0.2)


def _oracle(monkeypatch, prompts, replies):
    """Drafts from the known replies instead of prompt lookup (a random model rarely repeats its
    context, so real drafts would mostly be rejected and the check's keeping path go untested):
    the true next tokens, with one of them spoiled on every other call, so calls keep all, some
    or none of their drafts."""
    calls = [0]

    def draft(context, k, **_):
        context = list(context)
        for p, reply in zip(prompts, replies):
            if context[: len(p)] == list(p) and len(context) >= len(p):
                done = len(context) - len(p)
                guess = np.full(k, speculation.NO_DRAFT, np.int32)
                truth = list(reply[done : done + k])  # what follows the context
                guess[: len(truth)] = truth
                calls[0] += 1
                if calls[0] % 2:
                    guess[calls[0] % k] = (guess[calls[0] % k] + 1) % CFG.vocab_size
                return guess
        return np.full(k, speculation.NO_DRAFT, np.int32)

    monkeypatch.setattr(speculation, "lookup_draft", draft)


def _assert_same_replies(fast: Engine, prompts, s: Sampling, want) -> None:
    """`fast`'s replies to each prompt alone and to all at once are `want`'s tokens, log-probs within
    1e-5 (a forward over k+1 positions sums in another order than one over 1)."""
    alone = [fast.generate([p], s)[0] for p in prompts]
    together = fast.generate(prompts, s)
    for got in (alone, together):
        assert [c.tokens for c in got] == [c.tokens for c in want]
        for c, w in zip(got, want):
            np.testing.assert_allclose(c.logprobs, w.logprobs, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_greedy_text_is_the_same_with_speculation_on_and_off(params, monkeypatch):
    """Each prompt alone and all four together, in an engine that speculates 4 tokens a call and one
    that does not: the same tokens, log-probs within 1e-5 (a forward over 5 positions sums in another
    order than one over 1), and drafts were in fact kept."""
    s = Sampling(max_tokens=40, logprobs=True)
    plain = Engine(params, CFG, max_batch=4, max_len=MAX_LEN)
    want = [plain.generate([p], s)[0] for p in _prompts()]
    _oracle(monkeypatch, _prompts(), [w.tokens for w in want])
    fast = Engine(params, CFG, max_batch=4, max_len=MAX_LEN, speculate=4)
    _assert_same_replies(fast, _prompts(), s, want)
    assert fast.accepted > 100 and fast.drafted > fast.accepted


@pytest.mark.slow
def test_a_serving_engine_compiles_its_check_aside_and_gets_the_same_text(params, monkeypatch):
    """A started engine compiles its check on a thread and decodes plainly meanwhile, then speculates:
    every greedy reply, alone or four at once, equals the engine without speculation's."""
    greedy = Sampling(max_tokens=40)
    plain = Engine(params, CFG, max_batch=4, max_len=MAX_LEN)
    want = [plain.generate([p], greedy)[0].tokens for p in _prompts()]
    _oracle(monkeypatch, _prompts(), want)
    engine = Engine(params, CFG, max_batch=4, max_len=MAX_LEN, speculate=4).start()
    try:
        first = run_requests(engine, _prompts()[:1], [greedy])
        assert tuple(first[0][0]) == want[0]
        for _ in range(600):  # the check's compilation, on the engine's thread (seconds)
            if engine.programs_ready():
                break
            threading.Event().wait(0.1)
        before = engine.accepted
        alone = run_requests(engine, _prompts()[:1], [greedy])
        together = run_requests(engine, _prompts(), [greedy] * 4)
    finally:
        engine.stop()
    assert tuple(alone[0][0]) == want[0] and engine.accepted > before
    assert [tuple(t) for t, _ in together] == want


def _draft_prompts():
    """Three of `_prompts` and one longer than a draft model's catch-up call (`draft_model.FILL`)."""
    long = np.random.default_rng(8).integers(3, CFG.vocab_size, size=100).tolist()
    return [*_prompts()[:2], long, _prompts()[3]]


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["itself", "another model"])
def test_a_draft_model_leaves_greedy_text_as_it_is(params, drafter):
    """Drafts from a draft model (inference/draft_model.py), each prompt alone and four at once: the
    same tokens as without speculation, log-probs within 1e-5. The served model drafting for itself
    guesses every token right exactly when the draft's own cache holds the right keys and values at
    the right slots (a prompt fed in several catch-up calls, call shapes changing, rows at their own
    offsets), so nearly every draft is kept; another random model's drafts are mostly rejected
    (speculation pauses, plain calls run between checks, the draft cache catches up after them)."""
    s = Sampling(max_tokens=30, logprobs=True)
    plain = Engine(params, CFG, max_batch=4, max_len=MAX_LEN)
    want = [plain.generate([p], s)[0] for p in _draft_prompts()]
    draft = params if drafter == "itself" else noisy_params(CFG, key=4, seed=7, scale=0.2)
    fast = Engine(params, CFG, max_batch=4, max_len=MAX_LEN, speculate=4, draft=(draft, CFG))
    _assert_same_replies(fast, _draft_prompts(), s, want)
    if drafter == "itself":
        assert fast.drafted > 100 and fast.accepted >= 0.95 * fast.drafted
    else:
        assert fast.drafted > 0 and fast.accepted < 0.5 * fast.drafted


@pytest.mark.slow
def test_a_serving_engine_with_a_draft_model_compiles_it_aside(params):
    """A started engine with a draft model decodes plainly while the draft's programs and the check
    compile on its thread, then speculates: greedy replies equal the plain engine's, and a seeded
    sampled reply beside them runs to its length."""
    greedy = Sampling(max_tokens=30)
    plain = Engine(params, CFG, max_batch=4, max_len=MAX_LEN)
    want = [plain.generate([p], greedy)[0].tokens for p in _draft_prompts()]
    engine = Engine(params, CFG, max_batch=4, max_len=MAX_LEN, speculate=3, draft=(params, CFG)).start()
    try:
        first = run_requests(engine, _draft_prompts()[:1], [greedy])
        assert tuple(first[0][0]) == want[0]
        for _ in range(4):  # each call shape met compiles its check, then the draft's programs
            before = engine.accepted
            warm = run_requests(engine, _draft_prompts(), [greedy] * 4)
            assert [tuple(t) for t, _ in warm] == want
            if engine.accepted > before:
                break
            for _ in range(600):  # (on the engine's thread: seconds)
                if engine.programs_ready():
                    break
                threading.Event().wait(0.1)
        before = engine.accepted
        hot = Sampling(max_tokens=30, temperature=0.8, seed=4)
        together = run_requests(engine, _draft_prompts() + _draft_prompts()[:1], [greedy] * 4 + [hot])
    finally:
        engine.stop()
    assert [tuple(t) for t, _ in together[:4]] == want
    assert engine.accepted > before
    assert len(together[4][0]) == 30 and together[4][1] == "length"


@pytest.mark.slow
@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (4, 0.9)])
def test_sampled_tokens_kept_by_the_rejection_rule_have_the_sampling_distribution(top_k, top_p):
    """40,000 draws of the rule on fixed logits (3 positions, 2 drafts, temperature 0.9, with and
    without top-k/top-p): the first token is distributed as plain sampling draws it; given the first
    draft kept, so is the second; given both, the third. A rule that forgot to take the rejected
    draft out of the resampled distribution would give it p + (1 - p) p, about 0.1 too much here."""
    import jax

    from shipyard.inference.sampling import filter_logits
    from shipyard.inference.speculation import accept_sampled

    n, vocab, temperature = 40_000, 6, 0.9
    logits = np.random.default_rng(0).normal(size=(3, vocab)).astype(np.float32) * 1.5
    p = np.asarray(
        jax.nn.softmax(
            filter_logits(jnp.asarray(logits / temperature), jnp.asarray(top_k), jnp.asarray(top_p))
        )
    )
    drafts = [int(np.argsort(-p[0])[1]), int(np.argsort(-p[1])[0])]  # a likely-ish and a likely token
    tokens, kept, _ = accept_sampled(
        jnp.broadcast_to(jnp.asarray(logits), (n, 3, vocab)),
        jnp.broadcast_to(jnp.asarray(drafts, jnp.int32), (n, 2)),
        jax.random.split(jax.random.key(0), n),
        jnp.full(n, temperature),
        jnp.full(n, top_k, jnp.int32),
        jnp.full(n, top_p),
    )
    tokens, kept = np.asarray(tokens), np.asarray(kept)

    def frequencies(picked):
        return np.bincount(picked, minlength=vocab) / len(picked)

    tolerance = 4 * np.sqrt(0.25 / np.array([n, n * p[0, drafts[0]], n * p[0, drafts[0]] * p[1, drafts[1]]]))
    np.testing.assert_allclose(frequencies(tokens[:, 0]), p[0], atol=tolerance[0])
    first_kept = kept >= 2
    assert np.array_equal(first_kept, tokens[:, 0] == drafts[0])
    np.testing.assert_allclose(frequencies(tokens[first_kept, 1]), p[1], atol=tolerance[1])
    both = kept == 3
    np.testing.assert_allclose(frequencies(tokens[both, 2]), p[2], atol=tolerance[2])
    assert set(np.unique(kept)) == {1, 2, 3}


def _permutation_p(a: np.ndarray, b: np.ndarray, rounds: int = 20_000) -> float:
    """Two-sided p-value of a permutation test that samples `a` and `b` share one distribution, by the
    difference of their means (a fixed generator: the same value every run)."""
    rng = np.random.default_rng(0)
    both, observed = np.concatenate([a, b]), abs(a.mean() - b.mean())
    hits = 0
    for _ in range(rounds):
        rng.shuffle(both)
        hits += abs(both[: len(a)].mean() - both[len(a) :].mean()) >= observed - 1e-12
    return (hits + 1) / (rounds + 1)


def test_sampled_replies_with_a_draft_model_keep_plain_sampling_s_distribution(params):
    """24 seeded temperature-1.0 replies to one prompt from an engine that speculates (the served
    model drafting for itself: greedy drafts) and 24 from one that does not, compared by each reply's
    mean token log-prob: a permutation test (alpha 1e-3, the false-alarm rate were the sampling itself
    random) finds no difference, and the sampled rows did keep drafts (and rejected some). A sampled
    row checked as a greedy one keeps every greedy draft and so its reply drifts to the greedy
    continuation (measured: mean log-prob -2.6 against plain sampling's -4.8, p = 5e-5)."""
    n, prompt = 24, _prompts()[1]
    hot = [Sampling(max_tokens=16, temperature=1.0, seed=s, logprobs=True) for s in range(n)]
    plain = Engine(params, CFG, max_batch=4, max_len=MAX_LEN)
    fast = Engine(params, CFG, max_batch=4, max_len=MAX_LEN, speculate=4, draft=(params, CFG))
    a, b = (np.array([np.mean(c.logprobs) for c in e.generate([prompt] * n, hot)]) for e in (plain, fast))
    assert _permutation_p(a, b) > 1e-3, (a.mean(), b.mean())
    assert fast.accepted > 0 and fast.drafted > fast.accepted  # sampled rows kept some drafts, not all
