"""Hot swap: new weights while requests run; nothing dropped, each reply on one set of weights."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from model_fixtures import noisy_params

from shipyard.config import load_config
from shipyard.inference.engine import Engine, Request, Sampling
from shipyard.inference.hot_swap import fingerprint

# Heavy compiles and end-to-end runs: the `make test-slow` tier (docs/testing.md: tiers).
pytestmark = pytest.mark.slow


def test_requests_queued_before_a_swap_finish_on_the_old_weights_and_later_ones_run_on_the_new():
    """The swap is queued from the first request's first tokens (in the engine thread, so the order is
    exact): that request, and one queued before the swap but admitted after it was queued, end on
    the old weights; one queued after runs on the new. Each equals the same request alone on its
    weights, and records that weights' fingerprint."""
    cfg = load_config("tiny").model
    old, new = (noisy_params(cfg, key=3, seed=s, scale=0.2) for s in (2, 5))
    fp_old, fp_new = fingerprint(old), fingerprint(new)
    assert fp_old != fp_new and fingerprint(noisy_params(cfg, key=3, seed=2, scale=0.2)) == fp_old
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, cfg.vocab_size, size=n).tolist() for n in (7, 12, 9)]
    lengths = (30, 8, 10)
    # one shape for every call (fixed_shape): the comparisons below are bitwise
    engine = Engine(
        old, cfg, max_batch=2, max_len=64, tokens_per_call=4, fixed_shape=True, fingerprint=fp_old
    )
    engine.start()
    try:
        results: dict = {}
        done = threading.Event()

        def collect(key, total=3):
            acc = []

            def on_tokens(tokens, _lp, finish):
                acc.extend(tokens)
                if key == "first" and not queued.is_set():  # mid-reply: queue the rest and the swap
                    queued.set()
                    engine.submit(before)
                    engine.swap(new, fp_new, wait=False)
                    engine.submit(after)
                if finish:
                    results[key] = (acc, finish)
                    if len(results) == total:
                        done.set()

            return on_tokens

        def alone(params, fp, prompt, n):
            engine.swap(params, fp)
            return _one(engine, prompt, n)

        # the references, on this engine (the same compiled programs), alone
        want = [alone(old, fp_old, prompts[0], lengths[0]), _one(engine, prompts[1], lengths[1])]
        want.append(alone(new, fp_new, prompts[2], lengths[2]))
        assert want[2] != alone(old, fp_old, prompts[2], lengths[2])  # the weights change the reply
        queued = threading.Event()
        first = Request(prompts[0], Sampling(max_tokens=lengths[0]), collect("first"))
        before = Request(prompts[1], Sampling(max_tokens=lengths[1]), collect("before"))
        after = Request(prompts[2], Sampling(max_tokens=lengths[2]), collect("after"))
        engine.submit(first)
        assert done.wait(120)
        assert [results[k] for k in ("first", "before", "after")] == [(w, "length") for w in want]
        assert (first.weights, before.weights, after.weights) == (fp_old, fp_old, fp_new)
        assert engine.fingerprint == fp_new

        # weights of another shape are refused, naming where they differ; the engine keeps serving
        other = noisy_params(load_config("tiny", ["model.hidden_size=32"]).model, key=3, seed=2, scale=0.2)
        with pytest.raises(ValueError, match=r"differ at .*float32\[.*32.*where the served model has"):
            engine.swap(other, "other")
        assert engine.fingerprint == fp_new and _one(engine, prompts[2], lengths[2]) == want[2]
    finally:
        engine.stop()


def _one(engine: Engine, prompt, n) -> list[int]:
    return list(engine.generate([prompt], Sampling(max_tokens=n))[0].tokens)


# -- over HTTP: `shipyard serve --admin-key ... --watch` --------------------------------------------

ADMIN = "admin-secret"
PROMPTS = ["the quick", "a river of", "once upon", "in the"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from serve_fixtures import swap_runs

    return swap_runs(tmp_path_factory.mktemp("swap"))


def test_a_quantized_server_quantizes_what_it_swaps_in_as_it_did_at_start_up(runs):
    """(Before the tests below move the runs' checkpoints.) A server started with --quantize int8 (its Swapper given the setting) swapping in "other": the
    engine then holds other's weights in int8 (the fingerprint of maybe_quantize(other, int8)) and
    answers as a fresh engine on those weights; fp32 weights would not even fit the engine's int8
    layout (the swap refused)."""
    from shipyard.inference.hot_swap import Swapper
    from shipyard.model.quantize import maybe_quantize
    from shipyard.run.model_dir import open_model_dir

    def int8(name):
        cfg, step, params = open_model_dir(runs[name], "test").load()
        return cfg.model, step, maybe_quantize(params, cfg.model, "int8")

    cfg, step, served = int8("served")
    _, _, other = int8("other")
    prompt = list(range(5, 13))
    want = _one(Engine(other, cfg, max_batch=1, max_len=32, fingerprint=fingerprint(other)), prompt, 8)
    engine = Engine(served, cfg, max_batch=1, max_len=32, fingerprint=fingerprint(served)).start()
    try:
        swapper = Swapper(engine, str(runs["served"]), step, quantize="int8")
        assert swapper.swap_to(runs["other"])["fingerprint"] == fingerprint(other)
        assert engine.fingerprint == fingerprint(other) and _one(engine, prompt, 8) == want
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def server(runs, tmp_path_factory):
    from serve_fixtures import running_server

    log = tmp_path_factory.mktemp("swap-log") / "serve.log"
    flags = ["--admin-key", ADMIN, "--watch", "--watch-every", "0.3", "--max-batch", "4", "--max-len", "128"]
    with running_server(runs["served"], log, *flags) as server:
        yield server


def _reference(run, prompts, max_tokens) -> list[str]:
    """Greedy replies of a model directory in this process (its weights alone on a fresh engine)."""
    from shipyard.data.tokenizer import load_tokenizer, special_token_ids
    from shipyard.inference.engine import engine_for
    from shipyard.run.model_dir import open_model_dir

    model_dir = open_model_dir(run, "test")
    tok = load_tokenizer(model_dir.require_tokenizer("test"))
    eos = special_token_ids(model_dir.require_tokenizer("test"), tok)["eos_token"]
    cfg, _, params = model_dir.load()
    ids = [tok.encode(p, add_special_tokens=False).ids for p in prompts]
    engine = engine_for(params, cfg.model, ids, max_tokens)
    replies = engine.generate(ids, Sampling(max_tokens=max_tokens, stop_ids=(eos,)))
    return [tok.decode(list(c.tokens), skip_special_tokens=False) for c in replies]


def _admin(server, method, path, body=None, key=ADMIN):
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, server.url + path, json=body, headers=headers, timeout=120)


def _fingerprint(run) -> str:
    from shipyard.run.model_dir import open_model_dir

    return fingerprint(open_model_dir(run, "test").load().params)


@pytest.mark.parametrize(
    "what, body, key, status, words",
    [
        ("no admin key", {"path": "x"}, None, 401, "no admin key"),
        ("a wrong admin key", {"path": "x"}, "guess", 401, "a wrong admin key"),
        ("no path", {}, ADMIN, 400, "path"),
        ("an unknown field", {"path": "x", "force": True}, ADMIN, 400, "force"),
        ("a negative step", {"path": "x", "step": -1}, ADMIN, 400, "step"),
        ("a missing directory", {"path": "/nowhere/run"}, ADMIN, 409, "/nowhere/run"),
        ("a step the run lacks", {"path": "RUN:served", "step": 99}, ADMIN, 409, "no checkpoint 99"),
        ("another hidden size", {"path": "RUN:shape"}, ADMIN, 409, "model.hidden_size is 32"),
        ("another tokenizer", {"path": "RUN:tokenizer"}, ADMIN, 409, "another tokenizer"),
    ],
)
def test_bad_swaps_are_refused_and_the_old_weights_keep_serving(server, runs, what, body, key, status, words):
    before, refused = server.health()["fingerprint"], _swaps(server)["refused"]
    if str(body.get("path", "")).startswith("RUN:"):
        body = {**body, "path": str(runs[body["path"][4:]])}
    reply = _admin(server, "POST", "/admin/swap", body, key)
    assert reply.status_code == status, (what, reply.text)
    error = reply.json()["error"]
    assert words in error["message"] and "\n" not in error["message"], (what, error)
    assert server.health()["fingerprint"] == before
    assert _swaps(server)["refused"] == refused + (status == 409)  # a refused model, counted
    ok = _admin(
        server, "POST", "/v1/completions", {"model": "served", "prompt": "the", "max_tokens": 3}, None
    )
    assert ok.status_code == 200 and ok.json()["system_fingerprint"] == before


def test_a_swap_under_load_drops_nothing_and_each_reply_names_the_weights_that_made_it(server, runs):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    want = {_fingerprint(r): _reference(r, PROMPTS, 24) for r in (runs["served"], runs["other"])}
    fp_old, fp_new = list(want)
    assert server.health()["fingerprint"] == fp_old
    assert want[fp_old] != want[fp_new]  # the swap shows in the replies
    replies, errors, stop = [], [], threading.Event()
    swapped_at = [float("inf")]

    def client_loop(i):
        import time

        while not stop.is_set():
            sent = time.monotonic()
            try:
                chunks = list(
                    client.completions.create(
                        model="served", prompt=PROMPTS[i], max_tokens=24, temperature=0, stream=True
                    )
                )
            except Exception as e:  # every failure is counted, none may happen
                errors.append(repr(e))
                continue
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            replies.append((i, sent, {c.system_fingerprint for c in chunks}, text))

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    try:
        import time

        time.sleep(1.0)
        result = _admin(server, "POST", "/admin/swap", {"path": str(runs["other"])})
        swapped_at[0] = time.monotonic()
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert result.status_code == 200, result.text
    assert result.json()["fingerprint"] == fp_new and server.health()["fingerprint"] == fp_new
    assert errors == []
    for i, sent, fps, text in replies:
        assert len(fps) == 1, fps  # one set of weights for the whole reply
        (fp,) = fps
        assert text == want[fp][i], (i, fp, text)
        if sent > swapped_at[0]:
            assert fp == fp_new
    seen = {fp for _, _, (fp,), _ in replies}
    assert seen == {fp_old, fp_new}, (len(replies), seen)
    weights = _admin(server, "GET", "/admin/weights").json()
    assert weights == {"fingerprint": fp_new, "model": str(runs["other"].resolve()), "step": 1}


def test_watch_swaps_in_the_newest_verified_checkpoint_of_the_run(server, runs):
    """A new checkpoint moved into the watched run (as Orbax finalises one: the step directory renamed
    into place, then its sha256 sidecar) is served within a few polls; a newer one with no sidecar
    yet is not."""
    import os
    import time

    import httpx

    served, staging = runs["served"] / "checkpoints", runs["staging"] / "checkpoints"
    fp_next, swaps = _fingerprint(runs["staging"]), _swaps(server)["ok"]
    want = _reference(runs["staging"], PROMPTS[:1], 24)
    os.rename(staging / "1", served / "2")
    os.rename(staging / "1.sha256.json", served / "2.sha256.json")
    # an unhashed step 3 (its sidecar not written yet): the old "other" weights' checkpoint, moved
    os.rename(runs["other"] / "checkpoints" / "1", served / "3")
    deadline = time.monotonic() + 60
    while server.health()["fingerprint"] != fp_next and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.health()["fingerprint"] == fp_next, server.log_text()[-2000:]
    time.sleep(1.0)  # several more polls: step 3 stays unserved
    assert _admin(server, "GET", "/admin/weights").json()["step"] == 2
    body = {"model": "served", "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0}
    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert (reply["system_fingerprint"], reply["choices"][0]["text"]) == (fp_next, want[0])
    assert _swaps(server)["ok"] == swaps + 1


def _swaps(server) -> dict[str, float]:
    """shipyard_weight_swaps_total by result, read through prometheus-client's parser."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=10).text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "shipyard_weight_swaps")
    return {s.labels["result"]: s.value for s in family.samples if s.name.endswith("_total")}
