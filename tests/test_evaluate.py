"""The evaluator's numbers, checked against direct computations."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from data_fixtures import prose, write_jsonl
from model_fixtures import noisy_params

from shipyard.config import load_config
from shipyard.data.configs import ReadConfig, TokenizerTrainConfig
from shipyard.data.tokenizer import load_tokenizer, run_tokenizer_train
from shipyard.errors import DataError
from shipyard.eval.loglik import loglikelihoods, token_byte_lengths
from shipyard.eval.tasks import cloze, multiple_choice
from shipyard.model.transformer import logits


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("ev")
    docs = write_jsonl(d / "docs.jsonl", [prose(s) for s in range(30)] + ["Ünïcödé — 日本語 🙂 text"])
    run_tokenizer_train([str(docs)], d / "tok", TokenizerTrainConfig(vocab_size=400), ReadConfig())
    cfg = load_config("tiny").model
    params = noisy_params(cfg, key=0, seed=0, scale=0.2)
    return d, cfg, params, load_tokenizer(d / "tok")


def _direct(params, cfg, ctx, cont):
    seq = jnp.asarray([ctx + cont])
    logp = jax.nn.log_softmax(logits(params, seq[:, :-1], cfg), axis=-1)[0]
    idx = range(len(ctx) - 1, len(ctx) + len(cont) - 1)
    return float(sum(logp[i, seq[0, i + 1]] for i in idx)), all(
        int(jnp.argmax(logp[i])) == int(seq[0, i + 1]) for i in idx
    )


def test_loglikelihoods_equal_a_direct_computation(setup):
    _, cfg, params, _ = setup
    pairs = [([5, 6, 7], [8, 9]), ([1], [2, 3, 4, 5]), ([10, 11, 12, 13, 14], [15])]
    for (ll, greedy), (ctx, cont) in zip(loglikelihoods(params, cfg, pairs, batch=2), pairs):
        want, want_greedy = _direct(params, cfg, ctx, cont)
        assert ll == pytest.approx(want, abs=1e-4) and greedy == want_greedy


def test_token_bytes_match_decoded_text(setup):
    _, _, _, tok = setup
    text = "Plain words, Ünïcödé — 日本語 🙂 and   spaces\n"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert int(token_byte_lengths(tok)[ids].sum()) == len(text.encode("utf-8"))
    assert token_byte_lengths(tok)[1] == 0  # <|eos|>


def test_multiple_choice_and_cloze_tasks(setup):
    d, cfg, params, tok = setup
    rows = [
        {
            "context": "Kabel lodor mifin",
            "choices": [" pegat.", " zumon tolis ravix kabel.", " x"],
            "label": 1,
        },
        {"context": "Simon", "choices": [" rasen", " tovel"], "label": 0},
    ]
    path = d / "mc.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = multiple_choice(params, cfg, tok, path)
    want = want_norm = 0
    for r in rows:
        ctx = tok.encode(r["context"], add_special_tokens=False).ids
        ll = [_direct(params, cfg, ctx, tok.encode(c, add_special_tokens=False).ids)[0] for c in r["choices"]]
        want += int(np.argmax(ll)) == r["label"]
        want_norm += int(np.argmax([s / len(c.encode()) for s, c in zip(ll, r["choices"])])) == r["label"]
    assert got == {"examples": 2, "accuracy": want / 2, "accuracy_norm": want_norm / 2}
    cz = d / "cloze.jsonl"
    cz.write_text(json.dumps({"text": "Mibel kamon kalis kafin"}) + "\n")
    result = cloze(params, cfg, tok, cz)
    assert result["examples"] == 1 and 0 <= result["accuracy"] <= 1 and result["perplexity"] > 1


def test_bad_task_file_is_one_line(setup):
    d, cfg, params, tok = setup
    path = d / "bad.jsonl"
    path.write_text('{"context": "a", "choices": ["b"]}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: missing field\(s\) label"):
        multiple_choice(params, cfg, tok, path)
