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


@pytest.mark.slow
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


def _greedy_word(params, cfg, tok) -> str:
    """A context + last word the model predicts greedily: the context's greedy next token is a whole
    word (a space and letters, encoded as itself alone)."""
    import re

    for seed in range(60):
        ctx = " ".join(prose(seed).split()[:6])
        ids = tok.encode(ctx, add_special_tokens=False).ids
        nxt = int(jnp.argmax(logits(params, jnp.asarray([ids]), cfg)[0, -1]))
        word = tok.decode([nxt])
        if re.fullmatch(r" [a-z]+", word) and tok.encode(word, add_special_tokens=False).ids == [nxt]:
            return ctx + word
    raise AssertionError("no context whose greedy next token is a word")


def test_cloze_accuracy_and_perplexity_equal_a_direct_computation(setup):
    d, cfg, params, tok = setup
    texts = [_greedy_word(params, cfg, tok), "Mibel kamon kalis kafin", "Simon tovel rasen  pegat zumon."]
    cz = d / "cloze.jsonl"
    cz.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    nats = tokens = 0
    hits = []
    for t in texts:  # the last word is the target: everything after the last space
        t = t.rstrip()
        ctx, word = t[: t.rfind(" ")], t[t.rfind(" ") :]
        cont = tok.encode(word, add_special_tokens=False).ids
        ll, greedy = _direct(params, cfg, tok.encode(ctx, add_special_tokens=False).ids, cont)
        nats, tokens = nats - ll, tokens + len(cont)
        hits.append(greedy)
    assert hits[0] and not all(hits)  # one example the model gets, and one it does not
    result = cloze(params, cfg, tok, cz)
    assert result["examples"] == 3 and result["accuracy"] == sum(hits) / 3
    assert result["perplexity"] == pytest.approx(np.exp(nats / tokens), rel=1e-4)


def test_bad_task_file_is_one_line(setup):
    d, cfg, params, tok = setup
    path = d / "bad.jsonl"
    path.write_text('{"context": "a", "choices": ["b"]}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: missing field\(s\) label"):
        multiple_choice(params, cfg, tok, path)


def _shard_tokens(shard_dir) -> np.ndarray:
    """A shard directory's tokens, read here with numpy in the manifest's order (not through the loader)."""
    manifest = json.loads((shard_dir / "manifest.json").read_text())
    return np.concatenate([np.load(shard_dir / s["file"]) for s in manifest["shards"]]).astype(np.int64)


@pytest.fixture(scope="module")
def heldout(setup):
    """Held-out and training token shards of ASCII prose (several shards each), tokenized by the real stage."""
    from shipyard.data.configs import TokenizeConfig
    from shipyard.data.tokenize import run_tokenize

    d = setup[0]
    for name, seeds in (("held", range(100, 107)), ("train", range(200, 206))):
        docs = write_jsonl(d / f"{name}.jsonl", [prose(s) for s in seeds])
        run_tokenize(
            [str(docs)], d / name, d / "tok", TokenizeConfig(shard_tokens=700), ReadConfig(), workers=1
        )
    return d / "held", d / "train"


_forward = jax.jit(logits, static_argnames="cfg")


def _by_hand(params, cfg, tok, held_ids, train_ids, n):
    """(nats of the model, nats of the add-one unigram, bytes, targets) over the first n sequences of
    L + 1 tokens (L = 256, the tiny model's context), sequence i starting at token i L: an independent
    float64 log-softmax of the model's logits, and the text the targets decode to for the bytes."""
    L = cfg.max_seq_len
    seqs = np.stack([held_ids[i * L : i * L + L + 1] for i in range(n)])
    lg = np.asarray(_forward(params, jnp.asarray(seqs[:, :-1]), cfg)).astype(np.float64)
    top = lg.max(-1, keepdims=True)
    logp = lg - top - np.log(np.exp(lg - top).sum(-1, keepdims=True))
    nats = -np.take_along_axis(logp, seqs[:, 1:, None], axis=-1).sum()
    targets = held_ids[1 : n * L + 1]
    counts = np.bincount(train_ids, minlength=cfg.vocab_size) + 1.0
    unigram = -np.log(counts / counts.sum())[targets].sum()
    text = tok.decode(targets.tolist(), skip_special_tokens=True)  # ASCII: a byte per character
    assert text.isascii()
    return nats, unigram, len(text.encode("utf-8")), targets


def test_domain_bits_per_byte_and_the_unigram_baseline_equal_hand_computations(setup, heldout):
    from shipyard.eval.heldout import domain_metrics, unigram_metrics

    _, cfg, params, tok = setup
    held, train = heldout
    held_ids, train_ids = _shard_tokens(held), _shard_tokens(train)
    assert len(json.loads((held / "manifest.json").read_text())["shards"]) > 2  # sequences cross shards
    available = (held_ids.size - 1) // cfg.max_seq_len
    assert available > 4
    for n in (3, available):  # a cut (the quickstart's max_sequences) and every sequence
        nats, unigram_nats, nbytes, targets = _by_hand(params, cfg, tok, held_ids, train_ids, n)
        got = domain_metrics(params, cfg, held, tok, max_sequences=n if n == 3 else 10_000, batch=2)
        assert (got.sequences, got.tokens, got.bytes) == (n, targets.size, nbytes)
        assert got.loss == pytest.approx(nats / targets.size, rel=1e-5)
        assert got.bits_per_byte == pytest.approx(nats / np.log(2) / nbytes, rel=1e-5)
        base = unigram_metrics(train, cfg, held, tok, max_sequences=n if n == 3 else 10_000)
        # the same tokens and bytes as the model's, not the whole held-out set
        assert (base.sequences, base.tokens, base.bytes) == (n, targets.size, nbytes)
        assert base.loss == pytest.approx(unigram_nats / targets.size, rel=1e-9)
        assert base.bits_per_byte == pytest.approx(unigram_nats / np.log(2) / nbytes, rel=1e-9)


def test_unigram_baseline_and_model_bits_per_byte_on_the_same_tokens(setup, heldout, tmp_path):
    """The quickstart's eval step: model and unigram bits/byte over the same first max_sequences."""
    from model_fixtures import save_run

    from shipyard.experiment.steps import STEPS

    _, model_cfg, params, tok = setup
    held, train = heldout
    cfg = load_config("tiny", [f"data.train_tokens={train}"])
    assert cfg.model == model_cfg
    save_run(tmp_path / "run", cfg, params)
    report = STEPS["eval"](tmp_path / "eval", {"run": tmp_path / "run", "tokens": held}, {"max_sequences": 3})
    nats, unigram_nats, nbytes, targets = _by_hand(
        params, model_cfg, tok, _shard_tokens(held), _shard_tokens(train), 3
    )
    model, base = report["domains"]["heldout"], report["unigram_baseline"]
    assert model["tokens"] == base["tokens"] == targets.size and model["bytes"] == base["bytes"] == nbytes
    assert model["bits_per_byte"] == pytest.approx(nats / np.log(2) / nbytes, rel=1e-5)
    assert base["bits_per_byte"] == pytest.approx(unigram_nats / np.log(2) / nbytes, rel=1e-9)
    assert report["bits_per_byte_vs_unigram"] == pytest.approx(nats / unigram_nats, rel=1e-5)
    assert json.loads((tmp_path / "eval" / "eval.json").read_text()) == report
