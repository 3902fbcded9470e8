"""Sampling does what its settings say, checked against sets and distributions computed here with numpy.

The sampler: `inference.sampling.filter_logits` (the one top-k / top-p rule) inside
`sampling.pick_tokens` (the one token picker: settings for the whole batch or per row), also end to
end through `Engine.generate` (every command's client) on a tiny random model. The references:
`allowed` (the top-k set and the top-p nucleus from float64 logits), a float64 softmax, and scipy's
chi-square test of the sampled frequencies (fixed seeds: the verdicts are the same on every run).
"""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_fixtures import complete, run_requests
from model_fixtures import noisy_params

from shipyard.cli.main import build_parser, main
from shipyard.config import load_config
from shipyard.errors import ConfigError
from shipyard.inference.engine import Engine, Sampling
from shipyard.inference.sampling import filter_logits, pick_tokens
from shipyard.model.transformer import logits as model_logits

stats = pytest.importorskip("scipy.stats")


def allowed(logits: np.ndarray, k: int, p: float, slack: float = 0.0) -> set[int]:
    """The tokens a top-k / top-p sampler may pick from one row of logits, in float64.

    Top-k: the k highest logits (k 0: all). Top-p: the smallest prefix of those, best first, whose
    softmax mass (renormalised over the top-k) reaches p: a token is in when the mass ranked before it
    is below p. `slack` widens both rules (logits within `slack` of the k-th, mass below p + slack) for
    logits that come from a differently rounded forward.
    """
    logits = np.asarray(logits, np.float64)
    order = np.argsort(-logits, kind="stable")
    if 0 < k < len(logits):
        kth = logits[order[k - 1]]
        order = order[logits[order] >= kth - slack]
    z = np.exp(logits[order] - logits[order[0]])
    probs = z / z.sum()
    before = np.cumsum(probs) - probs
    if p >= 1:
        return {int(t) for t in order}
    n = max(1, int(np.sum(before < p + slack)))
    return {int(t) for t in order[:n]}


def _boundary_gap(logits: np.ndarray, k: int, p: float) -> float:
    """How close a row's nucleus is to changing: the distance of the mass before any top-k token from p."""
    logits = np.sort(np.asarray(logits, np.float64))[::-1][: k if k > 0 else None]
    probs = np.exp(logits - logits[0])
    probs /= probs.sum()
    return float(np.min(np.abs(np.cumsum(probs) - probs - p)))


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(np.asarray(logits, np.float64) - np.max(logits))
    return z / z.sum()


def _truncated(logits: np.ndarray, k: int, p: float) -> np.ndarray:
    """The distribution a top-k / top-p sampler draws from: the softmax renormalised over `allowed`."""
    keep = np.zeros(len(logits), bool)
    keep[list(allowed(logits, k, p))] = True
    probs = np.where(keep, _softmax(logits), 0.0)
    return probs / probs.sum()


def chi_square_p(samples: np.ndarray, probs: np.ndarray) -> float:
    """p-value of samples (token ids) drawn from `probs`; tokens expected fewer than 5 times are pooled
    into one bin (the chi-square approximation needs expected counts of about 5 or more)."""
    counts = np.bincount(samples, minlength=len(probs)).astype(np.float64)
    expected = probs * len(samples)
    assert counts[probs == 0].sum() == 0, "sampled a token the distribution gives no mass"
    big = expected >= 5
    obs = np.append(counts[big], counts[~big & (probs > 0)].sum())
    exp = np.append(expected[big], expected[~big & (probs > 0)].sum())
    if exp[-1] < 5:  # pool the rare tokens with the least likely frequent one instead
        obs, exp = np.append(obs[:-2], obs[-2:].sum()), np.append(exp[:-2], exp[-2:].sum())
    assert len(obs) >= 10, "too few bins for the test to mean anything"
    return float(stats.chisquare(obs, exp).pvalue)


SETTINGS = [(0, 0.3), (0, 0.9), (0, 0.999), (0, 1.0), (1, 1.0), (5, 1.0), (5, 0.5), (20, 0.8), (64, 0.95)]


@pytest.mark.parametrize("scale", [0.5, 3.0])  # flat and peaked rows
def test_filter_keeps_exactly_the_top_k_set_and_the_nucleus(scale):
    rng = np.random.default_rng(int(scale * 10))
    rows = rng.normal(size=(200, 64)).astype(np.float32) * scale
    checked = 0
    for k, p in SETTINGS:
        kept = np.isfinite(np.asarray(filter_logits(jnp.asarray(rows), k, p)))
        for row, keep in zip(rows, kept):
            if p < 1 and _boundary_gap(row, k, p) < 1e-5:  # float32 and float64 sums may disagree here
                continue
            assert set(np.flatnonzero(keep).tolist()) == allowed(row, k, p), (k, p)
            checked += 1
    assert checked > 0.98 * len(SETTINGS) * len(rows)
    # per-row settings (the engine's): each row as if filtered alone
    ks = np.resize([k for k, _ in SETTINGS], len(rows))
    ps = np.resize(np.array([p for _, p in SETTINGS], np.float32), len(rows))
    kept = np.isfinite(np.asarray(filter_logits(jnp.asarray(rows), jnp.asarray(ks), jnp.asarray(ps))))
    for row, keep, k, p in zip(rows, kept, ks, ps):
        if p >= 1 or _boundary_gap(row, k, p) >= 1e-5:
            assert set(np.flatnonzero(keep).tolist()) == allowed(row, int(k), float(p))


def test_the_best_token_survives_any_top_p():
    rows = jnp.asarray(np.random.default_rng(1).normal(size=(8, 32)), jnp.float32)
    for p in (1e-9, 0.0):
        kept = np.isfinite(np.asarray(filter_logits(rows, 0, p)))
        assert (kept.sum(-1) == 1).all() and (kept.argmax(-1) == np.asarray(rows).argmax(-1)).all()


@pytest.mark.parametrize("temperature", [0.5, 1.7])
def test_every_sample_lies_in_the_top_k_set_and_the_nucleus(temperature):
    """The picker with settings for the whole batch and per row, 32 draws of each of 64 rows (one batch:
    each row draws on its own): every pick is in the set computed from logits / temperature."""
    rng = np.random.default_rng(7)
    rows = rng.normal(size=(64, 48)).astype(np.float32) * 2
    draws = jnp.asarray(np.tile(rows, (32, 1)))
    n = draws.shape[0]
    picker = jax.jit(pick_tokens)
    for k, p in [(5, 1.0), (0, 0.6), (12, 0.8), (1, 0.5)]:
        inside = np.zeros(rows.shape, bool)
        for r, row in enumerate(rows):
            inside[r, list(allowed(row / temperature, k, p, slack=1e-5))] = True
        inside = np.tile(inside, (32, 1))
        keys = jax.random.split(jax.random.key(k), n)
        picks, _ = picker(draws, keys, np.float32(temperature), np.int32(k), np.float32(p))
        assert inside[np.arange(n), np.asarray(picks)].all(), (k, p)
        keys = jax.random.split(jax.random.key(100 + k), n)
        t, kk, pp = jnp.full(n, temperature), jnp.full(n, k), jnp.full(n, p)
        picks, _ = picker(draws, keys, t, kk, pp)
        assert inside[np.arange(n), np.asarray(picks)].all(), (k, p)


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config("tiny").model
    params = noisy_params(cfg, key=2, seed=1, scale=0.2)
    return cfg, params, Engine(params, cfg, max_batch=NB, max_len=32, fixed_shape=True)


NB = 256  # engine rows: N first tokens come from N / NB grouped prefill calls
PROMPT = [5, 17, 99, 3]
N = 8192  # draws per chi-square test: a bias of a few percent in a token of 10% mass shows


def _first_tokens(engine, temperature, top_k, top_p, seed) -> list[list[int]]:
    """One new token for each of N copies of PROMPT, copy i seeded with seed * N + i."""
    settings = [
        Sampling(max_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed * N + i)
        for i in range(N)
    ]
    return [list(c.tokens) for c in engine.generate([PROMPT] * N, settings)]


def _last_logits(params, cfg, prompt) -> np.ndarray:
    return np.asarray(_forward(params, jnp.asarray([prompt]), cfg))[0, -1].astype(np.float64)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, None, None), (1.3, 40, 0.9)])
def test_generator_frequencies_match_the_models_distribution(tiny, temperature, top_k, top_p):
    """N identical prompts, each its own seed: the first tokens are N independent draws of one distribution."""
    cfg, params, engine = tiny
    logits = _last_logits(params, cfg, PROMPT) / temperature
    probs = _truncated(logits, top_k or 0, 1.0 if top_p is None else top_p)
    first = np.array([o[0] for o in _first_tokens(engine, temperature, top_k or 0, top_p or 1.0, 0)])
    assert chi_square_p(first, probs) > 1e-3


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 40, 0.9), (1.0, 0, 0.5)])
def test_engine_sampler_frequencies_match_the_models_distribution(tiny, temperature, top_k, top_p):
    """sampling.pick_tokens, N rows of the same logits with their own keys (as N requests would have),
    and greedy rows beside them that must stay the argmax."""
    cfg, params, _ = tiny
    logits = _last_logits(params, cfg, PROMPT)
    rows = jnp.asarray(np.broadcast_to(logits.astype(np.float32), (N, len(logits))))
    hot = np.arange(N) % 8 != 0  # every 8th row greedy
    picks, _ = pick_tokens(
        rows,
        jax.random.split(jax.random.key(11), N),
        jnp.asarray(np.where(hot, temperature, 0.0), jnp.float32),
        jnp.full(N, top_k),
        jnp.full(N, top_p, jnp.float32),
    )
    picks = np.asarray(picks)
    assert (picks[~hot] == np.argmax(logits)).all()
    assert chi_square_p(picks[hot], _truncated(logits / temperature, top_k, top_p)) > 1e-3


def test_chi_square_check_tells_a_wrong_temperature_apart(tiny):
    """The test above has the power to fail: T = 1 samples are not T = 0.8 samples."""
    cfg, params, engine = tiny
    logits = _last_logits(params, cfg, PROMPT)
    first = np.array([o[0] for o in _first_tokens(engine, 1.0, 0, 1.0, 3)])
    assert chi_square_p(first, _softmax(logits / 0.8)) < 1e-6


def _greedy_margin(params, cfg, prompts, out) -> float:
    """The smallest gap between the best and second-best logit along greedy replies."""
    lg = np.sort(_full_forward_logits(params, cfg, prompts, out), axis=-1)
    return float((lg[..., -1] - lg[..., -2]).min())


SAME_LENGTH = [[5, 17, 99, 3], [42, 7, 300, 11], [7, 8, 9, 10], [200, 201, 1, 90]]


@pytest.mark.slow
def test_top_k_one_and_tiny_temperatures_are_greedy(tiny):
    cfg, params, engine = tiny
    greedy = complete(engine, SAME_LENGTH, 12)
    # tokens within a logit of 1e-3 of the best could swap at T = 1e-4; none are that close
    assert _greedy_margin(params, cfg, SAME_LENGTH, greedy) > 4e-3
    for seed in (0, 1):
        assert complete(engine, SAME_LENGTH, 12, temperature=1.0, top_k=1, seed=seed) == greedy
    # the picker on every logit row of those replies, settings for the whole batch (sparing a run of
    # the engine per setting): T = 0 is the argmax whatever the filters; tiny T and a tiny nucleus are too
    # (1e-40 is a float32 subnormal, flushed to zero: logits / T were inf and nan; it divides by the floor)
    rows = jnp.asarray(_full_forward_logits(params, cfg, SAME_LENGTH, greedy).reshape(-1, cfg.vocab_size))
    want = np.asarray(greedy).reshape(-1)
    for t, k, p in [
        (0.0, 30, 0.5),
        (1e-4, 0, 1.0),
        (1e-9, 0, 1.0),
        (1e-40, 7, 0.9),
        (1.9, 1, 0.99),
        (1.0, 0, 1e-6),
    ]:
        for seed in range(3):
            keys = jax.random.split(jax.random.key(seed), rows.shape[0])
            got = np.asarray(pick_tokens(rows, keys, np.float32(t), np.int32(k), np.float32(p))[0])
            assert (got == want).all(), (t, k, p, seed)


def _full_forward_logits(params, cfg, prompts, out) -> np.ndarray:
    """[batch, new tokens, vocab]: the logits each generated token was drawn from."""
    seqs = jnp.asarray([p + o for p, o in zip(prompts, out)])
    return np.asarray(_forward(params, seqs, cfg))[:, len(prompts[0]) - 1 : -1]


_forward = jax.jit(model_logits, static_argnames="cfg")


def _assert_inside(params, cfg, prompts, out, settings):
    """Every token of `out` (replies to same-length `prompts`, row b sampled with settings[b] =
    (temperature, top_k, top_p)) is in the set of the logits it was drawn from."""
    lg = _full_forward_logits(params, cfg, prompts, out)
    outside = [
        (b, i, t)
        for b, (row, (temperature, k, p)) in enumerate(zip(out, settings))
        for i, t in enumerate(row)
        if t not in allowed(lg[b, i] / temperature, k, p, slack=1e-4)
    ]
    assert not outside, outside


def test_generator_samples_stay_inside_the_set_at_every_position(tiny):
    """Prefill and decode steps, many rows and seeds: each token is in the set of its own logits."""
    cfg, params, engine = tiny
    rng = np.random.default_rng(3)
    prompts = rng.integers(3, cfg.vocab_size, size=(24, 5)).tolist()
    t, k, p = 1.5, 15, 0.8  # one setting (the started engine's test below varies them per row)
    for seed in range(3):
        out = complete(engine, prompts, 10, temperature=t, top_k=k, top_p=p, seed=seed)
        _assert_inside(params, cfg, prompts, out, [(t, k, p)] * len(prompts))


def _engine_run(engine: Engine, prompts, sampling) -> list[list[int]]:
    return [tokens for tokens, _finish in run_requests(engine, prompts, sampling)]


def test_engine_greedy_equivalents_and_samples_inside_the_set(tiny):
    cfg, params, driven = tiny
    greedy = complete(driven, SAME_LENGTH, 12)
    # fixed_shape: one decode program to compile
    engine = Engine(params, cfg, max_batch=4, max_len=32, tokens_per_call=4, fixed_shape=True).start()
    try:
        like_greedy = [
            Sampling(max_tokens=12, temperature=1.0, top_k=1, seed=1),
            Sampling(max_tokens=12, temperature=1e-9, seed=2),
            Sampling(max_tokens=12, temperature=0.0, top_k=5, top_p=0.3, seed=3),
            Sampling(max_tokens=12, temperature=1.2, top_p=1e-6, seed=4),
        ]
        assert _engine_run(engine, SAME_LENGTH, like_greedy) == greedy
        rows = [(1.0, 6, 1.0), (0.8, 0, 0.6), (1.5, 15, 0.8), (1.0, 3, 0.9)]
        prompts = SAME_LENGTH * 3
        for seed in range(2):
            sampling = [
                Sampling(max_tokens=10, temperature=t, top_k=k, top_p=p, seed=seed * 100 + i)
                for i, (t, k, p) in enumerate(rows * 3)
            ]
            _assert_inside(params, cfg, prompts, _engine_run(engine, prompts, sampling), rows * 3)
    finally:
        engine.stop()


BAD_FLAGS = [
    (["--temperature", "-0.5"], "temperature must be between 0 (greedy) and 2, got -0.5"),
    (["--temperature", "2.5"], "temperature must be between 0 (greedy) and 2, got 2.5"),
    (["--temperature", "nan"], "got nan"),
    (["--temperature", "warm"], "argument --temperature: expected a number, got 'warm'"),
    (["--top-k", "-2"], "top-k must be a number of tokens >= 1, or 0 (or -1) for all of them; got -2"),
    (["--top-k", "2.5"], "argument --top-k: expected a whole number"),
    (["--top-p", "0"], "top-p must be a probability mass in (0, 1]"),
    (["--top-p", "1.2"], "got 1.2"),
    (["--max-new-tokens", "0"], "argument --max-new-tokens: must be at least 1, got 0"),
]


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("flags, words", BAD_FLAGS)
def test_bad_sampling_flags_are_one_line(tmp_path, capsys, command, flags, words):
    model = tmp_path / "no-model"  # refused while parsing, before the model directory is read
    prompt = ["--prompt", "hi"] if command == "generate" else []
    assert main([command, str(model), *prompt, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err and err.startswith(f"error: shipyard {command}: argument --")


def test_a_bad_flag_from_the_shell_has_no_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "shipyard.cli", "generate", str(tmp_path), "--prompt", "x", "--top-p", "-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr and "--top-p" in proc.stderr


def _cli_accepts(flag: str, value) -> bool:
    try:
        build_parser().parse_args(["generate", "m", "--prompt", "p", flag, str(value)])
    except ConfigError:
        return False
    return True


def _api_accepts(field: str, value) -> bool:
    from pydantic import ValidationError

    from shipyard.inference.openai_api import CompletionRequest

    try:
        CompletionRequest.model_validate({"model": "m", "prompt": "p", field: value})
    except ValidationError:
        return False
    return True


@pytest.mark.parametrize(
    "flag, field, values",
    [
        ("--temperature", "temperature", [-0.1, 0, 1e-9, 0.7, 2, 2.0001, float("inf"), float("nan")]),
        ("--top-k", "top_k", [-3, -2, -1, 0, 1, 50]),
        ("--top-p", "top_p", [-0.5, 0, 1e-9, 0.5, 1, 1.0001, float("nan")]),
        ("--max-new-tokens", "max_tokens", [-1, 0, 1, 64]),
    ],
)
def test_generate_chat_and_the_api_take_the_same_settings(flag, field, values):
    """One rule: a value the CLI accepts is one `shipyard serve` accepts in a request, and back."""
    cli = [_cli_accepts(flag, v) for v in values]
    assert cli == [_api_accepts(field, v) for v in values], list(zip(values, cli))
    assert any(cli) and not all(cli)
