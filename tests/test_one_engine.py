"""One generation engine: `shipyard generate`, `shipyard chat`, the lm-eval adapter and `shipyard serve`
are clients of the same `inference.engine.Engine` object, and for the same prompt they get the same
greedy tokens with the same chosen-token log-probabilities.

Every entry point builds its engine through `inference.engine.Engine`; the test hands each of them one
shared engine (fixed_shape: one decode program, so a row's arithmetic does not depend on what else
runs) and records, at that engine's `submit`, every request each entry point makes and what came back.
The recording asks the engine for log-probabilities too (an entry point that prints text does not
ask): they are computed beside the tokens and do not change them, which the printed texts confirm.
"""

from __future__ import annotations

import dataclasses
import io
import sys

import pytest
from hf_fixtures import write_bpe
from model_fixtures import noisy_params

import shipyard.inference.engine as engine_module
import shipyard.inference.service as service_module
from shipyard.cli.main import main
from shipyard.config import load_config
from shipyard.interop.hf import write_hf_dir
from shipyard.run.model_dir import open_model_dir

NEW = 6
TEXT = "the model reads"
USER = "def"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A small random Hugging Face directory with a BPE tokenizer and its chat template."""
    root = tmp_path_factory.mktemp("one_engine")
    cfg = load_config("tiny", ["model.vocab_size=320", "model.max_seq_len=64", "data.seq_len=64"]).model
    write_hf_dir(noisy_params(cfg, key=2, seed=1, scale=0.2), cfg, root / "hf", write_bpe(root / "tok"))
    return root / "hf"


class Recorded:
    """The shared engine, and every request it was given: (entry point, prompt, tokens, logprobs)."""

    def __init__(self, engine):
        self.engine, self.entry, self.requests = engine, None, []
        submit_groups = engine.submit_groups  # where every request is queued (`submit` too)

        def record(request):
            got = {"entry": self.entry, "prompt": tuple(request.prompt), "tokens": [], "logprobs": []}
            self.requests.append(got)
            client = request.on_tokens

            def on_tokens(tokens, logprobs, finish):
                got["tokens"] += tokens
                got["logprobs"] += [lp[0] for lp in logprobs]
                client(tokens, logprobs, finish)

            request.sampling = dataclasses.replace(request.sampling, logprobs=True)
            request.on_tokens = on_tokens

        def recording_submit_groups(groups):
            for group in groups:
                for request in group:
                    record(request)
            return submit_groups(groups)

        engine.submit_groups = recording_submit_groups

    def of(self, entry: str) -> list[dict]:
        return [r for r in self.requests if r["entry"] == entry]


@pytest.mark.slow
def test_generate_chat_lm_eval_and_serve_share_one_engine_and_its_tokens(hf_dir, monkeypatch, capsys):
    pytest.importorskip("lm_eval")
    from fastapi.testclient import TestClient
    from lm_eval.api.instance import Instance

    from shipyard.eval.lm_eval import ShipyardLM
    from shipyard.inference.server import create_app

    weights = open_model_dir(hf_dir, "test").load()
    shared = engine_module.Engine(
        weights.params, weights.config.model, max_batch=2, max_len=64, fixed_shape=True
    )
    rec = Recorded(shared)
    made = []

    def the_engine(*args, **kwargs):  # whatever an entry point asks for, it gets the shared engine
        made.append((rec.entry, kwargs))
        return shared

    monkeypatch.setattr(engine_module, "Engine", the_engine)
    monkeypatch.setattr(service_module, "Engine", the_engine)
    tok = open_model_dir(hf_dir, "test").config  # (the config the entry points read, for the vocab)
    assert tok.model.vocab_size == 320

    rec.entry = "generate"
    capsys.readouterr()
    assert main(["generate", str(hf_dir), "--prompt", TEXT, "--max-new-tokens", str(NEW)]) == 0
    printed = capsys.readouterr().out

    rec.entry = "chat"
    monkeypatch.setattr(sys, "stdin", io.StringIO(USER + "\n"))
    assert main(["chat", str(hf_dir), "--temperature", "0", "--max-new-tokens", str(NEW)]) == 0
    capsys.readouterr()

    rec.entry = "lm-eval"
    lm = ShipyardLM.from_params(weights.params, weights.config.model, hf_dir, max_length=64)
    gen_kwargs = {"until": [], "max_gen_toks": NEW, "do_sample": False}
    (lm_text,) = lm.generate_until([Instance("generate_until", {}, (TEXT, gen_kwargs), 0)])
    rec.entry = "serve"
    service = service_module.load_service(hf_dir, max_batch=2, max_len=64, fixed_shape=True)
    try:
        with TestClient(create_app(service)) as client:
            body = {"model": service.name, "prompt": TEXT, "max_tokens": NEW, "temperature": 0, "logprobs": 1}
            completion = client.post("/v1/completions", json=body).json()["choices"][0]
            messages = [{"role": "user", "content": USER}]
            body = {"model": service.name, "messages": messages, "max_tokens": NEW, "temperature": 0}
            chat_reply = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    finally:
        shared.stop()

    # every entry point built its engine through `Engine` and got the one object, and its requests
    # reached that object
    assert made and all(
        e in {r["entry"] for r in rec.requests} for e in ("generate", "chat", "lm-eval", "serve")
    )
    assert service.engine is shared and lm.engine() is not None
    # and each asked for the engine its own settings call for (the shared one stands in for it): generate
    # a row for its one prompt and a cache for the prompt and its new tokens (the prompt padded to its
    # prefill bucket of 16), chat one row over the whole context, lm-eval its max_length, serve its flags
    asked = dict(made)
    assert len(made) == len(asked) == 4
    prompt = len(rec.of("generate")[0]["prompt"])
    assert asked["generate"]["max_batch"] == 1 and prompt + NEW <= asked["generate"]["max_len"] <= 16 + NEW
    assert asked["chat"]["max_batch"] == 1 and asked["chat"].get("max_len") in (None, 64)
    assert asked["lm-eval"]["max_len"] == 64
    serve = {k: asked["serve"][k] for k in ("max_batch", "max_len", "fixed_shape", "speculate", "draft")}
    assert serve == {"max_batch": 2, "max_len": 64, "fixed_shape": True, "speculate": 0, "draft": None}

    text_runs = [r for r in rec.requests if r["prompt"] == rec.of("generate")[0]["prompt"]]
    # chat's prompt is the rendered conversation (special tokens by id): serve's chat endpoint renders it
    chat_runs = [r for r in rec.requests if r["prompt"] == rec.of("chat")[0]["prompt"]]
    assert {r["entry"] for r in text_runs} == {"generate", "lm-eval", "serve"}
    assert {r["entry"] for r in chat_runs} == {"chat", "serve"}
    for runs in (text_runs, chat_runs):
        first = runs[0]
        assert len(first["tokens"]) >= 1 and all(lp <= 0 for lp in first["logprobs"])
        for r in runs[1:]:  # bitwise: the same tokens and the same float32 log-probabilities
            assert (r["tokens"], r["logprobs"]) == (first["tokens"], first["logprobs"]), (first, r)

    # and what each client showed is those tokens
    decode = service.decode
    eos = set(service.eos_ids)
    text = decode([t for t in text_runs[0]["tokens"] if t not in eos])
    assert f"{TEXT}{text}" in printed and lm_text == text
    assert completion["text"] == text
    assert (
        completion["logprobs"]["token_logprobs"]
        == text_runs[0]["logprobs"][: len(completion["logprobs"]["token_logprobs"])]
    )
    end_ids = set(service.chat.end_ids) | eos
    reply = decode([t for t in chat_runs[0]["tokens"] if t not in end_ids])
    assert chat_reply["message"]["content"] == reply
