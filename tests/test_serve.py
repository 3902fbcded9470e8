"""`shipyard serve` against the official openai client: outputs equal `shipyard generate` / the chat model,
continuous batching leaves greedy outputs unchanged, structured output validates against its schema,
hostile requests are refused, SIGTERM drains."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Literal

import httpx
import numpy as np
import openai
import pytest
from data_fixtures import MC_ROWS
from serve_fixtures import ServerProcess, running_server, slow_run, sse_events, tool_tuned_run, trained_run

from shipyard.cli.main import main

KEY = "test-key-123"
PROMPTS = [
    "Kabel lodor",
    "Simon",
    "Mibel kamon kalis",
    "Nujek pelis, rabel",
    "Zugat",
    "Verud sitov",
    "Ra",
    "Lobel",
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return trained_run(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def server(run_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    flags = ("--max-batch", "8", "--model-name", "tiny-chat", "--prefix-cache", "4", "--prefill-chunk", "16")
    with running_server(run_dir, log, *flags, api_key=KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _generate_cli(run_dir, prompts, n, capsys, *flags) -> list[str]:
    """`shipyard generate`'s greedy completions (the text after each prompt)."""
    args = ["generate", str(run_dir), "--max-new-tokens", str(n), *flags]
    for p in prompts:
        args += ["--prompt", p]
    capsys.readouterr()
    assert main(args) == 0
    out = capsys.readouterr().out
    texts = []
    for p, block in zip(prompts, out.split("--- ")[1:]):
        body = block.split("\n", 1)[1].rstrip("\n")
        assert body.startswith(p)
        texts.append(body[len(p) :])
    return texts


def test_completions_equal_shipyard_generate(server, client, run_dir, capsys):
    want = _generate_cli(run_dir, PROMPTS[:4], 24, capsys)
    for prompt, expected in zip(PROMPTS[:4], want):
        r = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=24, temperature=0)
        assert r.choices[0].text == expected
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens > 0
        stream = client.completions.create(
            model="tiny-chat", prompt=prompt, max_tokens=24, temperature=0, stream=True
        )
        pieces = [c.choices[0].text for c in stream]
        assert "".join(pieces) == expected and len(pieces) > 1
    # a batch of prompts in one request: one choice per prompt, in order
    r = client.completions.create(model="tiny-chat", prompt=PROMPTS[:4], max_tokens=24, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == want


def test_stop_strings_cut_the_text_and_end_the_request(server, client):
    full = client.completions.create(model="tiny-chat", prompt="Kabel lodor", max_tokens=24, temperature=0)
    text = full.choices[0].text
    stop = text[6:9]
    assert stop and stop in text
    for stream in (False, True):
        r = client.completions.create(
            model="tiny-chat", prompt="Kabel lodor", max_tokens=24, temperature=0, stop=[stop], stream=stream
        )
        chunks = list(r) if stream else [r]
        got = "".join(c.choices[0].text for c in chunks)
        assert got == text[: text.index(stop)]
        assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_chat_completions_equal_the_chat_model(server, client, run_dir):
    from shipyard.inference.chat import load_chat_model

    model = load_chat_model(run_dir)
    conversations = [
        [{"role": "user", "content": "Kabel lodor mifin"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Simon rasen"}],
    ]
    for messages in conversations:
        want = model.decode(model.replies([messages], 20)[0])
        r = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=20, temperature=0)
        assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
        stream = client.chat.completions.create(
            model="tiny-chat", messages=messages, max_tokens=20, temperature=0, stream=True
        )
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_eight_concurrent_streams_get_their_single_client_outputs(server, client):
    lengths = [5, 40, 12, 33, 8, 27, 19, 50]
    alone = []
    for p, n in zip(PROMPTS, lengths):
        r = client.completions.create(model="tiny-chat", prompt=p, max_tokens=n, temperature=0)
        alone.append(r.choices[0].text)
    got: dict[int, str] = {}

    def one(i):
        stream = client.completions.create(
            model="tiny-chat", prompt=PROMPTS[i], max_tokens=lengths[i], temperature=0, stream=True
        )
        got[i] = "".join(c.choices[0].text for c in stream)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got.get(i) for i in range(8)] == alone


def test_seeded_sampling_repeats_and_does_not_depend_on_other_requests(server, client):
    def sample(seed):
        r = client.completions.create(
            model="tiny-chat", prompt="Mibel", max_tokens=16, temperature=1.0, top_p=0.9, seed=seed
        )
        return r.choices[0].text

    a = sample(7)
    busy = threading.Thread(
        target=lambda: client.completions.create(
            model="tiny-chat", prompt="Ra", max_tokens=60, temperature=1.0
        )
    )
    busy.start()
    b = sample(7)
    busy.join()
    assert a == b
    assert any(sample(s) != a for s in (8, 9, 10))


def _post(server, path, body, headers=None, raw=None):
    h = {"Authorization": f"Bearer {KEY}", **(headers or {})}
    content = raw if raw is not None else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers=h, timeout=30)


def _fmt(schema) -> dict:
    """A completions request held to `schema`."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    return {"body": {"model": "tiny-chat", "prompt": "x", "response_format": fmt}}


HOSTILE = [
    # (what, request kwargs, status, words the message must contain)
    ("not JSON", {"raw": b"{not json"}, 400, "not valid JSON"),
    ("a JSON array", {"body": [1, 2]}, 400, "JSON object"),
    ("unknown model", {"body": {"model": "gpt-9", "prompt": "x"}}, 400, "not served here"),
    ("max_tokens past the context", {"body": {"model": "tiny-chat", "prompt": "x", "max_tokens": 10**6}}, 400, "context"),
    ("prompt past the context", {"body": {"model": "tiny-chat", "prompt": "Simon " * 400}}, 400, "context"),
    ("max_tokens 0", {"body": {"model": "tiny-chat", "prompt": "x", "max_tokens": 0}}, 400, "max_tokens"),
    ("max_tokens as a string", {"body": {"model": "tiny-chat", "prompt": "x", "max_tokens": "5"}}, 400, "max_tokens"),
    ("prompt a number", {"body": {"model": "tiny-chat", "prompt": 5}}, 400, "prompt"),
    ("negative temperature", {"body": {"model": "tiny-chat", "prompt": "x", "temperature": -1}}, 400, "temperature"),
    ("n past --max-batch", {"body": {"model": "tiny-chat", "prompt": "x", "n": 9}}, 400, "n=9 choices do not fit this server's 8 decode slots"),
    ("n=0", {"body": {"model": "tiny-chat", "prompt": "x", "n": 0}}, 400, "n: Input should be greater than or equal to 1"),
    ("chat n past --max-batch", {"path": "/v1/chat/completions", "body": {"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}], "n": 12}}, 400, "n=12 choices do not fit"),
    ("token id past the vocabulary", {"body": {"model": "tiny-chat", "prompt": [1, 10**6]}}, 400, "vocabulary"),
    ("logit_bias", {"body": {"model": "tiny-chat", "prompt": "x", "logit_bias": {"1": 5}}}, 400, "logit_bias"),
    ("chat without messages", {"path": "/v1/chat/completions", "body": {"model": "tiny-chat", "messages": []}}, 400, "messages"),
    ("chat with a bad role", {"path": "/v1/chat/completions", "body": {"model": "tiny-chat", "messages": [{"role": "wizard", "content": "x"}]}}, 400, "role"),
    ("missing API key", {"body": {"model": "tiny-chat", "prompt": "x"}, "headers": {"Authorization": ""}}, 401, "API key"),
    ("wrong API key", {"body": {"model": "tiny-chat", "prompt": "x"}, "headers": {"Authorization": "Bearer nope"}}, 401, "API key"),
    ("a body of 5 MB", {"raw": b'{"model": "tiny-chat", "prompt": "' + b"a" * (5 << 20) + b'"}'}, 413, "limit"),
    ("unknown route", {"path": "/v1/nothing", "body": {}}, 404, "Not Found"),
    ("best_of below n", {"body": {"model": "tiny-chat", "prompt": "x", "n": 3, "best_of": 2}}, 400, "best_of (2) must be at least n (3)"),
    ("best_of streamed", {"body": {"model": "tiny-chat", "prompt": "x", "best_of": 3, "stream": True}}, 400, "best_of cannot be streamed"),
    ("best_of past --max-batch", {"body": {"model": "tiny-chat", "prompt": "x", "best_of": 9}}, 400, "best_of=9 choices do not fit"),
    ("best_of in chat", {"path": "/v1/chat/completions", "body": {"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}], "best_of": 2}}, 400, "'best_of' is not supported"),
    ("a swap on a server without --admin-key", {"path": "/admin/swap", "body": {"path": "x"}}, 403, "--admin-key"),
    ("a schema keyword that cannot be enforced (not)", _fmt({"not": {"type": "string"}}), 400, 'this JSON Schema cannot be enforced: Unimplemented keys: ["not"]'),
    ("if/then", _fmt({"if": {"type": "string"}, "then": {"type": "integer"}}), 400, 'Unimplemented keys: ["if", "then"]'),
    ("uniqueItems", _fmt({"type": "array", "uniqueItems": True}), 400, 'Unimplemented keys: ["uniqueItems"]'),
    ("an unknown type", _fmt({"type": "strin"}), 400, "cannot be enforced: Invalid type: strin"),
    ("a $ref to nothing", _fmt({"$ref": "#/$defs/nope"}), 400, "Pointer '/$defs/nope' does not exist"),
    ("an unsatisfiable schema", _fmt({"type": "integer", "minimum": 5, "maximum": 1}), 400, "Unsatisfiable schema: minimum (5) is greater than maximum (1)"),
    ("conflicting allOf", _fmt({"allOf": [{"type": "string"}, {"type": "integer"}]}), 400, "Unsatisfiable schema: incompatible types"),
    ("a broken pattern", _fmt({"type": "string", "pattern": "(["}), 400, "regex parse error: ([ ^ error: unclosed character class"),
    ("an unknown format", _fmt({"type": "string", "format": "zipcode"}), 400, "Unknown format: zipcode"),
    ("response_format type xml", {"body": {"model": "tiny-chat", "prompt": "x", "response_format": {"type": "xml"}}}, 400, "response_format.type: Input should be 'text', 'json_object' or 'json_schema'"),
    ("json_schema without its schema", {"body": {"model": "tiny-chat", "prompt": "x", "response_format": {"type": "json_schema"}}}, 400, "json_schema is given exactly when type is 'json_schema'"),
    ("a schema that is not an object", {"body": {"model": "tiny-chat", "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}}}, 400, "response_format.json_schema.schema: Input should be a valid dictionary"),
    ("response_format a string", {"body": {"model": "tiny-chat", "prompt": "x", "response_format": "json"}}, 400, "response_format: Input should be a valid dictionary"),
    ("an unknown response_format field", {"body": {"model": "tiny-chat", "prompt": "x", "response_format": {"type": "json_object", "mode": "fast"}}}, 400, "response_format.mode: Extra inputs are not permitted"),
    ("response_format with ignore_eos", {"body": {"model": "tiny-chat", "prompt": "x", "ignore_eos": True, "response_format": {"type": "json_object"}}}, 400, "response_format cannot be combined with ignore_eos"),
    ("a chat schema that cannot be enforced", {"path": "/v1/chat/completions", "body": {"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "dependentSchemas": {"a": {}}}}}}}, 400, 'Unimplemented keys: ["dependentSchemas"]'),
]  # fmt: skip


@pytest.mark.parametrize("what, kw, status, words", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_requests_are_refused_and_the_server_keeps_serving(server, client, what, kw, status, words):
    r = _post(server, kw.get("path", "/v1/completions"), kw.get("body"), kw.get("headers"), kw.get("raw"))
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["type"]
    ok = client.completions.create(model="tiny-chat", prompt="Simon", max_tokens=3, temperature=0)
    assert len(ok.choices[0].text) > 0


def test_the_openai_client_raises_on_refusals(server, client):
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="tiny-chat", prompt="x", max_tokens=10**6)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in client.models.list()] == ["tiny-chat"]


def test_n_choices_are_the_seeds_after_the_requests_each_alone(server, client):
    """n choices of a prompt (one prefill, tests/test_engine.py) are numbered prompt-major; choice j
    of seed s is what seed s + j gets alone; greedy choices are all the greedy reply; streamed
    chat choices reassemble to the non-streamed ones; usage counts each prompt once."""
    kw = {"model": "tiny-chat", "max_tokens": 12, "temperature": 0.9, "extra_body": {"top_k": 30}}
    alone = {
        (p, s): client.completions.create(prompt=p, seed=s, **kw)
        for p in ("Simon", "Zugat")
        for s in (5, 6, 7)
    }
    assert len({alone["Simon", s].choices[0].text for s in (5, 6, 7)}) > 1  # the seeds differ: a mix-up shows
    r = client.completions.create(prompt=["Simon", "Zugat"], n=3, seed=5, **kw)
    assert [c.index for c in r.choices] == list(range(6))
    order = [(p, s) for p in ("Simon", "Zugat") for s in (5, 6, 7)]
    assert [c.text for c in r.choices] == [alone[k].choices[0].text for k in order]
    assert (
        r.usage.prompt_tokens == alone["Simon", 5].usage.prompt_tokens + alone["Zugat", 5].usage.prompt_tokens
    )
    assert r.usage.completion_tokens == sum(alone[k].usage.completion_tokens for k in order)
    greedy = client.completions.create(model="tiny-chat", prompt="Ra", max_tokens=8, temperature=0)
    g = client.completions.create(model="tiny-chat", prompt="Ra", max_tokens=8, temperature=0, n=4)
    assert [c.text for c in g.choices] == [greedy.choices[0].text] * 4

    messages = [{"role": "user", "content": "Kabel lodor"}]
    chat = client.chat.completions.create(
        model="tiny-chat", messages=messages, n=3, seed=2, max_tokens=10, temperature=1
    )
    texts = {}
    for chunk in client.chat.completions.create(
        model="tiny-chat", messages=messages, n=3, seed=2, max_tokens=10, temperature=1, stream=True
    ):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert [texts[i] for i in range(3)] == [c.message.content for c in chat.choices]
    assert len({c.message.content for c in chat.choices}) > 1


def test_best_of_returns_the_samples_with_the_highest_mean_logprob_per_token(client):
    """best_of=4, n=2: the 4 samples are n=4's (seeds s .. s+3, one prefill), and the 2 returned are
    those with the highest mean chosen-token log-prob, best first; usage counts all 4."""
    kw = {"model": "tiny-chat", "prompt": "Simon", "max_tokens": 10, "temperature": 1.0, "seed": 3}
    four = client.completions.create(n=4, logprobs=0, **kw).choices
    mean = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in four]
    assert len(set(mean)) == 4  # no ties: the ranking is the one asked for
    best = client.completions.create(n=2, best_of=4, **kw)
    ranked = sorted(range(4), key=lambda i: -mean[i])
    assert [c.text for c in best.choices] == [four[i].text for i in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in four)


def _scrape(server) -> dict[tuple, float]:
    """GET /metrics through prometheus-client's own parser: {(sample name, labels...): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
    out = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            out[(sample.name, *sorted(sample.labels.items()))] = sample.value
    return out


def test_metrics_count_what_the_requests_did(server, client):
    before = _scrape(server)
    replies = [
        client.completions.create(model="tiny-chat", prompt=p, max_tokens=n)
        for p, n in (("Simon", 5), ("Ra", 9))
    ]
    chat = client.chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "Zugat"}], max_tokens=4
    )
    assert _post(server, "/v1/completions", {"model": "gpt-9", "prompt": "x"}).status_code == 400
    assert httpx.get(server.url + "/metrics", timeout=30).status_code == 401  # behind the key, as the API
    after = _scrape(server)

    def grew(*key) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    usage = [r.usage for r in (*replies, chat)]
    assert grew("shipyard_prompt_tokens_total") == sum(u.prompt_tokens for u in usage)
    assert grew("shipyard_generation_tokens_total") == sum(u.completion_tokens for u in usage)
    finishes = [c.finish_reason for r in (*replies, chat) for c in r.choices]
    for finish in set(finishes):
        assert grew("shipyard_requests_total", ("finish", finish)) == finishes.count(finish)
    assert grew("shipyard_time_to_first_token_seconds_count") == 3
    assert grew("shipyard_time_per_output_token_seconds_count") == 3  # each reply has > 1 token
    assert 0 < grew("shipyard_request_latency_seconds_sum") < 60
    assert grew("shipyard_http_responses_total", ("path", "/v1/completions"), ("status", "200")) == 2
    assert grew("shipyard_http_responses_total", ("path", "/v1/chat/completions"), ("status", "200")) == 1
    assert grew("shipyard_http_responses_total", ("path", "/v1/completions"), ("status", "400")) == 1
    assert grew("shipyard_http_responses_total", ("path", "/metrics"), ("status", "401")) == 1
    # nothing runs between requests: every slot free, nothing queued, no cache held
    assert after[("shipyard_free_slots",)] == after[("shipyard_max_slots",)] == 8
    assert after[("shipyard_active_slots",)] == after[("shipyard_queue_depth",)] == 0
    assert after[("shipyard_kv_cache_tokens",)] == after[("shipyard_kv_cache_usage_ratio",)] == 0


# -- structured output ---------------------------------------------------------------------------

SCHEMAS = {
    "flat object": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "enum and boolean": {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["colour", "ok"],
        "additionalProperties": False,
    },
    "nested array of objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}, "tag": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
                    "required": ["id", "tag"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    "nullable and anyOf": {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "number", "minimum": -5, "maximum": 5}, {"type": "null"}]}, "unit": {"const": "kg"}},
        "required": ["value", "unit"],
        "additionalProperties": False,
    },
    "a recursive tree (depth bounded by max_tokens)": {
        "$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/node"}}}, "required": ["kids"], "additionalProperties": False}},
        "$ref": "#/$defs/node",
    },
}  # fmt: skip


def _in_the_one_layout(text: str) -> bool:
    """Whether JSON `text` has structured output's one layout (docs/serving.md): outside strings no
    whitespace but one space after each "," and ":" (a scan of the text, not the grammar's rules)."""
    inside, escaped = False, False
    for i, ch in enumerate(text):
        if inside:
            inside, escaped = (escaped or ch != '"'), (not escaped and ch == "\\")
        elif ch == '"':
            inside = True
        else:
            stray_space = ch.isspace() and not (ch == " " and i > 0 and text[i - 1] in ",:")
            if stray_space or (ch in ",:" and text[i + 1 : i + 2] != " "):
                return False
    return True


def test_the_one_layout_scan_tells_layouts_apart():
    assert _in_the_one_layout('{"a": [1, 2], "b": {"c": "x, y:z \\" ,"}}')
    for other in ('{"a":1}', '{"a": 1,"b": 2}', '{ "a": 1}', '{"a": 1}\n', '{"a":  1}', "[1 ,2]"):
        assert not _in_the_one_layout(other), other


@pytest.mark.parametrize("what", list(SCHEMAS))
def test_every_structured_reply_validates_against_its_schema(client, what):
    """A prose model held to a JSON Schema, sampled (4 choices, two temperatures) and greedy, in chat
    and completions: every reply ends by itself ("stop") within the bound the schema implies (a
    sampled recursive tree may not), and parses and validates (jsonschema, not the grammar library);
    streamed greedy text equals the non-streamed reply."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = SCHEMAS[what]
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "Kabel lodor"}]
    replies = []
    for temperature in (0.0, 1.0):
        r = client.chat.completions.create(
            model="tiny-chat", messages=messages, response_format=fmt, n=1 if temperature == 0 else 4,
            temperature=temperature, seed=3, max_tokens=160,
        )  # fmt: skip
        replies += [(c.message.content, c.finish_reason) for c in r.choices]
    c = client.completions.create(
        model="tiny-chat",
        prompt="Simon",
        max_tokens=160,
        temperature=0.7,
        n=2,
        extra_body={"response_format": fmt},
    )
    replies += [(x.text, x.finish_reason) for x in c.choices]
    for text, finish in replies:
        if finish == "length" and "$defs" in schema:
            continue  # a sampled tree may grow past max_tokens (cut replies are not JSON, as at OpenAI)
        assert finish == "stop", (what, text, finish)
        jsonschema.validate(json.loads(text), schema)
        assert _in_the_one_layout(text), (what, text)
    assert sum(finish == "stop" for _, finish in replies) >= len(replies) // 2, replies
    greedy = replies[0][0]
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(
            model="tiny-chat",
            messages=messages,
            response_format=fmt,
            temperature=0,
            max_tokens=160,
            stream=True,
        )
        if chunk.choices
    )
    assert streamed == greedy


def test_json_object_replies_are_json_objects_and_plain_rows_beside_them_are_unchanged(server, client):
    """json_object: any JSON object (string lengths bounded here only by max_tokens; a reply that ends
    parses). Plain requests decoding in the same batch as structured ones get their usual greedy
    text (each batch call is then one token, the same arithmetic)."""
    plain = {"model": "tiny-chat", "max_tokens": 24, "temperature": 0}
    alone = [client.completions.create(prompt=p, **plain).choices[0].text for p in PROMPTS[:3]]
    fmt = {"type": "json_object"}
    results: dict = {}

    def structured(i: int) -> None:
        results[i] = client.completions.create(
            model="tiny-chat", prompt=PROMPTS[i], max_tokens=200, temperature=1.0, seed=i,
            n=2, extra_body={"response_format": fmt},
        )  # fmt: skip

    threads = [threading.Thread(target=structured, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    beside = [client.completions.create(prompt=p, **plain).choices[0].text for p in PROMPTS[:3]]
    for t in threads:
        t.join()
    assert beside == alone
    ended = [c.text for r in results.values() for c in r.choices if c.finish_reason == "stop"]
    assert ended, [c.finish_reason for r in results.values() for c in r.choices]
    assert all(isinstance(json.loads(text), dict) for text in ended)


def test_the_openai_clients_parse_helper_gets_its_pydantic_model(client):
    """`client.chat.completions.parse(response_format=Model)`: the openai package turns a pydantic
    model into a strict json_schema and parses the reply back into it."""
    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        name: str = Field(max_length=10)
        legs: int = Field(ge=0, le=8)
        kind: Literal["cat", "dog", "bird"]

    r = client.chat.completions.parse(
        model="tiny-chat",
        messages=[{"role": "user", "content": "Zugat"}],
        response_format=Pet,
        max_tokens=80,
        temperature=0,
    )
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and r.choices[0].finish_reason == "stop", r


# -- tool calls ----------------------------------------------------------------------------------

# A Hermes/Qwen-style template (tools named in the system turn, calls in <tool_call> blocks) over
# the fixture tokenizer's own role tokens; short, as the fixture model's context is 256 tokens.
HERMES_TEMPLATE = (
    "{%- if tools %}<|system|>Call with <tool_call>: "
    "{% for t in tools %}{{ t.function.name }} {% endfor %}<|end|>{% endif -%}"
    "{%- for m in messages %}<|{{ 'user' if m.role == 'tool' else m.role }}|>"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>"
    '{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}</tool_call>{% endfor %}'
    "{%- else %}{{ m.content }}{% endif %}<|end|>{% endfor -%}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif -%}"
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
WEATHER_CALL = {"name": "weather", "arguments": {"city": "Kabel", "unit": "celsius"}}
WEATHER_ASKS = ["Weather in Kabel?", "What is the weather in Kabel?"]
TIME_TOOL = {"type": "function", "function": {"name": "time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": False}}}  # fmt: skip


@pytest.fixture(scope="module")
def tool_server(run_dir, tmp_path_factory):
    """`server`'s model fine-tuned to call `weather` when asked about it (`tool_tuned_run`; the same
    shapes and flags as `server`: its programs come from the compile cache), with a tokenizer
    directory whose HF chat template renders tools in the Hermes family's format."""
    import shutil

    d = tmp_path_factory.mktemp("tools")
    shutil.copytree(run_dir.parent / "tok", d / "tok")
    (d / "tok" / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    tools = [WEATHER_TOOL, TIME_TOOL]
    model = tool_tuned_run(d, run_dir, d / "tok", HERMES_TEMPLATE, tools, WEATHER_CALL, WEATHER_ASKS)
    flags = (
        "--max-batch",
        "8",
        "--model-name",
        "tiny-chat",
        "--tokenizer",
        str(d / "tok"),
        "--template",
        "hf",
    )
    with running_server(model, d / "server.log", *flags, api_key=KEY) as s:
        yield s


@pytest.fixture(scope="module")
def tool_client(tool_server):
    return openai.OpenAI(base_url=tool_server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _streamed_calls(stream) -> tuple[dict, str | None]:
    calls, finish = {}, None
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                calls[d.index]["id"] += d.id or ""
                calls[d.index]["name"] += d.function.name or ""
                calls[d.index]["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return calls, finish


def test_a_named_tool_choice_returns_a_call_whose_arguments_fit_its_schema(tool_client):
    """tool_choice naming a function: the reply is held to its parameters, returned as one call
    (finish "tool_calls", no content); sampled with n=3 each validates; the streamed deltas
    reassemble to exactly the non-streamed calls (ids aside, which are per request)."""
    jsonschema = pytest.importorskip("jsonschema")
    kw = dict(
        model="tiny-chat", messages=[{"role": "user", "content": "Weather in Kabel?"}], tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "function": {"name": "weather"}}, max_tokens=80,
    )  # fmt: skip
    r = tool_client.chat.completions.create(temperature=0, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
    streamed, finish = _streamed_calls(tool_client.chat.completions.create(temperature=0, stream=True, **kw))
    assert finish == "tool_calls" and len(streamed) == 1
    assert (streamed[0]["name"], streamed[0]["arguments"]) == (call.function.name, call.function.arguments)
    sampled = tool_client.chat.completions.create(temperature=1.0, n=3, seed=4, **kw)
    for c in sampled.choices:
        jsonschema.validate(
            json.loads(c.message.tool_calls[0].function.arguments), WEATHER_TOOL["function"]["parameters"]
        )


def test_required_returns_one_or_more_calls_of_the_offered_tools(tool_client):
    jsonschema = pytest.importorskip("jsonschema")
    tools = {"weather": WEATHER_TOOL, "time": TIME_TOOL}
    r = tool_client.chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": WEATHER_ASKS[1]}], tools=list(tools.values()),
        tool_choice="required", max_tokens=120, temperature=1.0, seed=1, n=2,
    )  # fmt: skip
    for choice in r.choices:
        if choice.finish_reason == "length":
            continue  # a sampled list of calls may run past max_tokens
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            jsonschema.validate(
                json.loads(call.function.arguments), tools[call.function.name]["function"]["parameters"]
            )
    assert any(c.finish_reason == "tool_calls" for c in r.choices), [
        (c.finish_reason, c.message.content) for c in r.choices
    ]


def test_auto_shows_the_tools_to_the_model_and_a_prose_reply_stays_text(tool_client, tool_server):
    """auto: the template renders the tools into the prompt (more prompt tokens than without); this
    prose model answers in prose, returned as content; a conversation carrying an assistant's calls
    and a tool's result renders and is answered."""
    messages = [{"role": "user", "content": "Kabel lodor"}]
    plain = tool_client.chat.completions.create(
        model="tiny-chat", messages=messages, max_tokens=12, temperature=0
    )
    r = tool_client.chat.completions.create(
        model="tiny-chat", messages=messages, tools=[WEATHER_TOOL], max_tokens=12, temperature=0
    )
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 5
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    turn = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees"},
    ]  # fmt: skip
    again = tool_client.chat.completions.create(
        model="tiny-chat", messages=turn, tools=[WEATHER_TOOL], max_tokens=8, temperature=0
    )
    assert again.usage.prompt_tokens > r.usage.prompt_tokens


def test_auto_returns_the_call_the_model_makes_of_its_own_accord(tool_client):
    """auto, with a model that calls `weather` when asked about it: the reply is parsed into one call
    (finish "tool_calls", no content) whose arguments are what the model wrote and fit the schema;
    the streamed deltas reassemble to exactly that call; cut by max_tokens inside the call, the
    reply comes back as its text with finish_reason invalid_tool_call (not a 500)."""
    jsonschema = pytest.importorskip("jsonschema")
    kw = dict(
        model="tiny-chat",
        messages=[{"role": "user", "content": WEATHER_ASKS[0]}],
        tools=[WEATHER_TOOL, TIME_TOOL],
    )
    r = tool_client.chat.completions.create(temperature=0, max_tokens=160, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert (
        call.function.name == "weather" and json.loads(call.function.arguments) == WEATHER_CALL["arguments"]
    )
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
    streamed, finish = _streamed_calls(
        tool_client.chat.completions.create(temperature=0, max_tokens=160, stream=True, **kw)
    )
    assert finish == "tool_calls" and len(streamed) == 1
    assert (streamed[0]["name"], streamed[0]["arguments"]) == (call.function.name, call.function.arguments)
    cut = tool_client.chat.completions.create(temperature=0, max_tokens=40, **kw).choices[0]
    assert cut.finish_reason == "invalid_tool_call" and cut.message.tool_calls is None
    assert cut.message.content.startswith("<tool_call>")


TOOL_HOSTILE = [
    ("a tool whose parameters cannot be enforced", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}]}, 'tools[0].function.parameters: this JSON Schema cannot be enforced: Unimplemented keys: ["not"]'),
    ("a tool whose parameters are not an object", {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools[0].function.parameters: Input should be a valid dictionary"),
    ("a function name with spaces", {"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name: String should match pattern"),
    ("two tools of one name", {"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "function names must be unique"),
    ("tool_choice without tools", {"tool_choice": "required"}, "tool_choice needs tools"),
    ("tool_choice naming a tool not offered", {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "time"}}}, "tool_choice names 'time', which is not among the tools ['weather']"),
    ("a tool of another type", {"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type: Input should be 'function'"),
    ("tools with a JSON response_format", {"tools": [WEATHER_TOOL], "response_format": {"type": "json_object"}}, "tools and a JSON response_format cannot be combined"),
    ("a tool_choice of another kind", {"tools": [WEATHER_TOOL], "tool_choice": "always"}, "tool_choice"),
]  # fmt: skip


@pytest.mark.parametrize("what, extra, words", TOOL_HOSTILE, ids=[h[0] for h in TOOL_HOSTILE])
def test_bad_tool_requests_are_400s_naming_the_part(tool_server, what, extra, words):
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}], **extra}
    r = _post(tool_server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"], r.json()


def test_tools_where_they_cannot_work_are_refused(server):
    """The built-in template cannot show tools to the model; completions have no tools (as at OpenAI)."""
    chat = {"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER_TOOL]}
    r = _post(server, "/v1/chat/completions", chat)
    assert r.status_code == 400 and "no known tool-call format" in r.json()["error"]["message"], r.text
    r = _post(server, "/v1/chat/completions", {**chat, "tool_choice": "required"})
    assert r.status_code == 400 and "has no way to show tools to the model" in r.json()["error"]["message"], (
        r.text
    )
    r = _post(server, "/v1/completions", {"model": "tiny-chat", "prompt": "x", "tools": [WEATHER_TOOL]})
    assert r.status_code == 400 and "'tools' is not supported" in r.json()["error"]["message"], r.text


@pytest.fixture(scope="module")
def slow_server(run_dir, tmp_path_factory):
    """A server around the `small`-shaped model, whose requests last long enough to act on mid-way."""
    d = tmp_path_factory.mktemp("slow")
    s = ServerProcess(slow_run(d, run_dir.parent / "shards"), "--max-batch", "2", api_key=KEY, log=d / "log")
    yield s
    s.stop()


def test_a_client_leaving_mid_stream_frees_its_slot(slow_server, client):
    """A reply that cannot end early (ignore_eos: exactly max_tokens) is cancelled when its client
    goes: the engine itself ends it ("cancelled" in /metrics, counted by the engine's callback) with
    far fewer tokens than it was due."""
    server = slow_server
    before = _scrape(server)
    body = json.dumps(
        {"model": "slow", "prompt": "Kabel", "max_tokens": 900, "stream": True, "ignore_eos": True}
    )
    sock = socket.create_connection(("127.0.0.1", server.port))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body.encode())
    received = b""
    while b"data: " not in received:  # streaming has begun
        received += sock.recv(4096)
    assert server.health()["active"] == 1
    during = _scrape(server)  # the gauges read the engine: one slot held, its cache in use
    assert during[("shipyard_active_slots",)] == 1 and during[("shipyard_free_slots",)] == 1
    assert during[("shipyard_kv_cache_tokens",)] > 0 and 0 < during[("shipyard_kv_cache_usage_ratio",)] <= 0.5
    sock.close()
    deadline = time.monotonic() + 20
    while server.health()["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.health()["active"] == 0
    after = _scrape(server)
    assert "client went away" in server.log_text()
    assert after[("shipyard_requests_total", ("finish", "cancelled"))] == 1 + before.get(
        ("shipyard_requests_total", ("finish", "cancelled")), 0
    )
    generated = after[("shipyard_generation_tokens_total",)] - before[("shipyard_generation_tokens_total",)]
    assert 0 < generated < 300, generated  # cancelled, not run out to its 900
    r = _post(server, "/v1/completions", {"model": "slow", "prompt": "Simon", "max_tokens": 3})
    assert r.json()["choices"][0]["finish_reason"] == "length"


def _stream_times(server, prompt: str, max_tokens: int) -> tuple[str, list[float]]:
    """A streamed greedy completion that runs to max_tokens: (its text, the arrival time of each chunk)."""
    body = {"model": "slow", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    text, times = [], []
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json={**body, "stream": True},
        headers=server.headers(),
        timeout=120,
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[len("data: ") :])
                text.append(event["choices"][0]["text"])
                times.append(time.monotonic())
    return "".join(text), times


def test_requests_join_a_batch_that_is_already_decoding(slow_server):
    """Continuous, not static, batching, at --max-batch 2: while one long reply runs, three short
    requests arrive; only one slot is free, so they take turns in it, and each gets its tokens before
    the long reply ends (a static batcher would admit them only when both slots were free). Every
    reply equals the same request sent alone."""
    alone = {p: _stream_times(slow_server, p, 12)[0] for p in ("Simon", "Zugat", "Ra")}
    long_alone, times = _stream_times(slow_server, "Kabel", 240)
    short = _stream_times(slow_server, "Simon", 12)[1]
    assert times[-1] - times[0] > 4 * (
        short[-1] - short[0]
    )  # the long reply outlasts three short ones in a row
    results: dict = {}

    def run(key, prompt, n):
        results[key] = _stream_times(slow_server, prompt, n)

    long = threading.Thread(target=run, args=("long", "Kabel", 240))
    long.start()
    deadline = time.monotonic() + 60
    while slow_server.health()["active"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)  # the long reply holds its slot
    shorts = [threading.Thread(target=run, args=(p, p, 12)) for p in ("Simon", "Zugat", "Ra")]
    for t in shorts:
        t.start()
    for t in [*shorts, long]:
        t.join(120)
    long_text, long_times = results["long"]
    assert long_text == long_alone
    for p in ("Simon", "Zugat", "Ra"):
        text, got = results[p]
        assert text == alone[p]
        assert got[0] < long_times[-1] and got[-1] < long_times[-1], p  # served while the long one ran


@pytest.fixture(scope="module")
def float64_model(run_dir, tmp_path_factory):
    """(transformers' Llama in float64 on the run's exported weights, the run's ModelDir): the
    independent reference the served log-probs are checked against, exported and loaded once."""
    import torch
    import transformers

    from shipyard.interop.hf import write_hf_dir
    from shipyard.run.model_dir import open_model_dir

    model_dir = open_model_dir(run_dir, "test")
    cfg, _, params = model_dir.load()
    hf_dir = tmp_path_factory.mktemp("float64") / "hf"
    write_hf_dir(params, cfg.model, hf_dir, model_dir.tokenizer())
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), torch_dtype=torch.float64)
    return hf.eval(), model_dir


def _float64_greedy(hf, prompt: list[int], new: int):
    """(prompt + the float64 model's own greedy reply of `new` tokens, log_softmax of its logits
    over all of it ([len(ids), vocab]))."""
    import numpy as np
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new + 1):  # the greedy reply, then the scores of all of it
            logits = hf(torch.tensor([ids])).logits[0].numpy()
            if len(ids) < len(prompt) + new:
                ids.append(int(np.argmax(logits[-1])))
    return ids, logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)


def test_logprobs_equal_an_independent_float64_forward(server, float64_model):
    """The served log-probs are the model's: the prompt's (echo) and the greedy reply's chosen tokens
    equal log_softmax of transformers' Llama run in float64 on the exported weights (not the function
    the server calls) within 1e-5, and the reply is that forward's greedy continuation."""
    import numpy as np

    from shipyard.data.tokenizer import load_tokenizer

    prompt, new = [5, 17, 99, 3, 8, 2, 77, 41, 12, 6], 8
    body = {"model": "tiny-chat", "prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True}
    choice = _post(server, "/v1/completions", {**body, "echo": True, "logprobs": 1}).json()["choices"][0]
    served = choice["logprobs"]["token_logprobs"]
    assert served[0] is None and len(served) == len(prompt) + new
    hf, model_dir = float64_model
    ids, logp = _float64_greedy(hf, prompt, new)
    np.testing.assert_allclose(served[1:], logp[np.arange(len(ids) - 1), ids[1:]], rtol=0, atol=1e-5)
    tok = load_tokenizer(model_dir.tokenizer())
    assert choice["text"] == tok.decode(ids, skip_special_tokens=False)  # echo: the prompt, then the reply
    assert all(
        max(top.values()) >= v - 1e-6 for v, top in zip(served[1:], choice["logprobs"]["top_logprobs"][1:])
    )


def test_a_structured_reply_reports_the_model_s_own_log_probs_before_the_mask(server, float64_model):
    """The grammar's mask decides which tokens may come; the log-probs a structured reply reports are
    still the model's own for the tokens chosen (docs/serving.md), not renormalised over the allowed
    ones: each equals transformers' float64 forward on the exported weights within 1e-5, and the
    tokens the grammar forced on this prose model (where the mask leaves one choice, renormalised
    log-probs are 0) show how little the model wanted them."""
    import numpy as np

    from shipyard.data.tokenizer import load_tokenizer

    prompt = [5, 17, 99, 3, 8, 2, 77, 41, 12, 6]
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
              "required": ["name"], "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}
    body = {"model": "tiny-chat", "prompt": prompt, "max_tokens": 24, "temperature": 0, "logprobs": 1,
            "response_format": fmt}  # fmt: skip
    choice = _post(server, "/v1/completions", body).json()["choices"][0]
    pieces, served = choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"]
    hf, model_dir = float64_model
    tok = load_tokenizer(model_dir.tokenizer())
    # each piece back to its id: a special token by name, any other by encoding its text (one token)
    reply = [[tok.token_to_id(p)] if p.startswith("<|") else tok.encode(p).ids for p in pieces]
    assert all(len(r) == 1 for r in reply), pieces
    ids = [*prompt, *(r[0] for r in reply)]
    assert json.loads(choice["text"])["name"] and tok.decode(ids[len(prompt) :]) == choice["text"]
    _, logp = _float64_greedy(hf, ids, 0)
    own = logp[np.arange(len(prompt) - 1, len(ids) - 1), ids[len(prompt) :]]
    np.testing.assert_allclose(served, own, rtol=0, atol=1e-5)
    assert min(served) < -1.0, served


def _warm_prefix(server, head: list[int]) -> None:
    """Send a prompt starting with `head`, so its blocks are in the prefix cache."""
    body = {"model": "tiny-chat", "prompt": [*head, 5], "max_tokens": 1}
    assert _post(server, "/v1/completions", body).status_code == 200


@pytest.mark.slow
def test_sixteen_concurrent_requests_each_score_as_the_float64_forward(server, float64_model):
    """16 clients at once (the server has 8 slots: requests queue, join and leave a running batch),
    random prompt and reply lengths, echo + logprobs, half of them after a shared 40-token head (so
    its first two 16-token blocks come from the prefix cache): each reply is the greedy continuation of transformers' Llama
    run in float64 on the exported weights, and every served log-prob (prompt and reply) equals that
    forward's log_softmax within 1e-5."""
    import random

    import numpy as np

    from shipyard.data.tokenizer import load_tokenizer

    rng = random.Random(7)
    head = [rng.randrange(5, 400) for _ in range(40)]
    _warm_prefix(server, head)
    before = _scrape(server)
    prompts = [
        [*head, *(rng.randrange(5, 400) for _ in range(rng.randint(1, 16)))]
        if i % 2
        else [rng.randrange(5, 400) for _ in range(rng.randint(2, 40))]
        for i in range(16)
    ]
    bodies = [
        {"model": "tiny-chat", "prompt": prompt, "max_tokens": rng.randint(1, 24), "temperature": 0,
         "ignore_eos": True, "echo": True, "logprobs": 1}
        for prompt in prompts
    ]  # fmt: skip
    results: dict = {}

    def send(i: int) -> None:
        results[i] = _post(server, "/v1/completions", bodies[i]).json()["choices"][0]

    threads = [threading.Thread(target=send, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    hf, model_dir = float64_model
    tok = load_tokenizer(model_dir.tokenizer())
    for i, body in enumerate(bodies):
        ids, logp = _float64_greedy(hf, body["prompt"], body["max_tokens"])
        choice = results[i]
        assert choice["text"] == tok.decode(ids, skip_special_tokens=False), i
        served = choice["logprobs"]["token_logprobs"]
        np.testing.assert_allclose(served[1:], logp[np.arange(len(ids) - 1), ids[1:]], rtol=0, atol=1e-5)
    after = _scrape(server)

    # each prompt after the head took the head's 2 whole blocks from the cache (its store of 4 x 256
    # tokens holds them and every other prompt's blocks: nothing is evicted)
    def grew(name: str) -> float:
        return (
            after[(f"shipyard_prefix_cache_{name}_total",)] - before[(f"shipyard_prefix_cache_{name}_total",)]
        )

    assert grew("hits") == 8 and grew("hit_tokens") == 8 * 32 and grew("saved_tokens") == 8 * 32


def test_start_up_says_in_its_log_what_it_loaded_allocated_and_compiled(server, run_dir):
    """Not a terminal (a log file): the start-up still says what it does, and the KV cache line
    states the size docs/serving.md's formula gives (2 x layers x rows x slots x kv_heads x head_dim)."""
    from shipyard.config import load_config

    log = server.log_text()
    m = load_config(str(run_dir / "config.yaml")).model
    values = 2 * m.num_layers * 8 * m.max_seq_len * m.num_kv_heads * m.head_dim
    assert f"serve: KV cache 8 rows x {m.max_seq_len} slots x float32 = {values * 4 / 2**20:.1f} MiB" in log
    assert "the model's whole context" in log and "parameters (fp_" in log
    total = int(log.split("serve: compiling ")[1].split()[0])
    assert f"serve: compiled {total}/{total} (" in log and log.index("compiled 1/") < log.index(
        "serving 'tiny-chat'"
    )


def test_sigterm_drains_in_flight_streams_and_exits_zero(slow_server):
    s = slow_server
    body = {"model": "slow", "prompt": "Kabel", "max_tokens": 120, "temperature": 0, "stream": True}
    lines: list[str] = []
    with httpx.stream("POST", s.url + "/v1/completions", json=body, headers=s.headers(), timeout=60) as r:
        it = r.iter_lines()
        lines.append(next(it))
        s.proc.send_signal(15)  # SIGTERM while the stream runs
        lines.extend(it)
    assert s.proc.wait(60) == 0, s.log_text()
    events = sse_events(lines)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert "tokens_out=120" in s.log_text() and "finish=length" in s.log_text()  # the request log line


@pytest.mark.slow
def test_serve_int8_with_a_bfloat16_cache_answers_like_generate_int8(run_dir, tmp_path, capsys):
    flags = ["--quantize", "int8", "--kv-dtype", "bfloat16"]
    s = ServerProcess(run_dir, "--max-batch", "4", *flags, log=tmp_path / "log")
    try:
        got = []
        for p in PROMPTS[:4]:
            r = httpx.post(
                s.url + "/v1/completions",
                json={"model": run_dir.name, "prompt": p, "max_tokens": 16, "temperature": 0},
                timeout=30,
            )
            got.append(r.json()["choices"][0]["text"])
    finally:
        assert s.stop() == 0
    want = _generate_cli(run_dir, PROMPTS[:4], 16, capsys, *flags)
    assert sum(g == w for g, w in zip(got, want)) >= 3, (got, want)


@pytest.mark.slow
def test_a_draft_model_over_http_gives_the_replies_of_the_server_without_one(
    server, client, run_dir, tmp_path
):
    """serve --draft-model (the served model drafting for itself, so the drafts are nearly all kept):
    greedy completions, streamed and not, over the openai client are the module's server's (no
    speculation) with log-probs within 1e-5, and /metrics counts the drafts it kept."""
    want = [
        client.completions.create(model="tiny-chat", prompt=p, max_tokens=24, temperature=0, logprobs=1)
        for p in PROMPTS[:3]
    ]
    flags = (
        "--max-batch",
        "4",
        "--model-name",
        "tiny-chat",
        "--draft-model",
        str(run_dir),
        "--speculate",
        "3",
    )
    s = ServerProcess(run_dir, *flags, api_key=KEY, log=tmp_path / "log")
    try:
        fast = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        for _ in range(60):  # the check and the draft's programs compile on the engine's thread first
            fast.completions.create(model="tiny-chat", prompt=PROMPTS[0], max_tokens=24, temperature=0)
            if _scrape(s)[("shipyard_spec_decode_num_accepted_tokens_total",)] > 0:
                break
            time.sleep(0.5)
        got = [
            fast.completions.create(model="tiny-chat", prompt=p, max_tokens=24, temperature=0, logprobs=1)
            for p in PROMPTS[:3]
        ]
        streamed = fast.completions.create(
            model="tiny-chat", prompt=PROMPTS[1], max_tokens=24, temperature=0, stream=True
        )
        streamed = "".join(c.choices[0].text for c in streamed)
        metrics = _scrape(s)
    finally:
        assert s.stop() == 0, s.log_text()
    assert [g.choices[0].text for g in got] == [w.choices[0].text for w in want]
    assert streamed == want[1].choices[0].text
    for g, w in zip(got, want):
        np.testing.assert_allclose(
            g.choices[0].logprobs.token_logprobs, w.choices[0].logprobs.token_logprobs, rtol=0, atol=1e-5
        )
    drafted = metrics[("shipyard_spec_decode_num_draft_tokens_total",)]
    assert drafted > 0 and metrics[("shipyard_spec_decode_num_accepted_tokens_total",)] >= 0.8 * drafted
    assert "draft model" in s.log_text()


def _mc_task(d) -> str:
    mc = d / "mc.jsonl"
    mc.write_text("".join(json.dumps(r) + "\n" for r in MC_ROWS))
    tasks = d / "tasks"
    tasks.mkdir()
    (tasks / "serve_mc.yaml").write_text(
        f"task: serve_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {json.dumps(str(mc))}\n"
        f"  cache_dir: {json.dumps(str(d / 'hf-datasets'))}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: context\ndoc_to_choice: choices\ndoc_to_target: label\ntarget_delimiter: ""\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    return str(tasks)


def test_lm_eval_local_completions_equals_the_in_process_adapter(server, run_dir, tmp_path, monkeypatch):
    """lm-eval's own OpenAI-completions client, tokenizing through the server's /tokenize endpoint."""
    pytest.importorskip("lm_eval")
    import lm_eval
    import lm_eval.models  # noqa: F401  (lm-eval's own models, local-completions among them)
    from lm_eval.tasks import TaskManager

    import shipyard.lm_eval_adapter  # noqa: F401  (registers the in-process "shipyard" model)

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # what lm-eval's local-completions sends as the Bearer key
    include = _mc_task(tmp_path)

    def run(model, model_args):
        out = lm_eval.simple_evaluate(
            model=model,
            model_args=model_args,
            tasks=["serve_mc"],
            task_manager=TaskManager(include_path=include, include_defaults=False),
            log_samples=True,
            bootstrap_iters=0,
        )
        samples = sorted(out["samples"]["serve_mc"], key=lambda s: s["doc_id"])
        return out["results"]["serve_mc"], [[float(r[0][0]) for r in s["resps"]] for s in samples]

    remote, remote_ll = run(
        "local-completions",
        {
            "base_url": server.url + "/v1/completions",
            "model": "tiny-chat",
            "tokenizer_backend": "remote",
            "auth_token": KEY,
            "max_length": 256,
            "max_retries": 1,
        },
    )
    local, local_ll = run("shipyard", {"checkpoint": str(run_dir), "batch_size": 4})
    assert remote["acc,none"] == local["acc,none"] and remote["acc_norm,none"] == local["acc_norm,none"]
    assert len(remote_ll) == len(MC_ROWS)
    for r, ll in zip(remote_ll, local_ll):
        assert r == pytest.approx(ll, abs=1e-4)


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--tokens-per-call", "0"], "--tokens-per-call must be at least 1"),
        (["--max-batch", "0"], "--max-batch must be at least 1"),
        (["--max-len", "100000"], "--max-len 100000 must be in 1..256"),
        (["--port", "70000"], "is not a TCP port"),
        (["--prefix-cache", "-1"], "--prefix-cache is a number of prompts (0: off), got -1"),
        (["--speculate", "-2"], "--speculate is a number of draft tokens (0: off), got -2"),
        (["--draft-model", "{run}", "--speculate", "0"], "the draft model would never be asked"),
        (["--speculate", "2", "--fixed-shape"], "--speculate/--draft-model with --fixed-shape"),
        (["--prefill-chunk", "0"], "--prefill-chunk is a number of tokens (at least 1), got 0"),
    ],
)
def test_bad_serve_flags_are_one_line(run_dir, capsys, flags, words):
    flags = [f.replace("{run}", str(run_dir)) for f in flags]
    assert main(["serve", str(run_dir), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err


def test_a_draft_model_with_another_vocabulary_is_refused_in_one_line(run_dir, tmp_path, capsys):
    """Served with a tokenizer whose ids differ from the draft model's (two tokens trade ids): one
    line naming the difference, exit 2, before any weights load."""
    import shutil

    shutil.copytree(run_dir.parent / "tok", tmp_path / "tok")
    path = tmp_path / "tok" / "tokenizer.json"
    spec = json.loads(path.read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(spec))
    flags = ["--tokenizer", str(tmp_path / "tok"), "--draft-model", str(run_dir)]
    assert main(["serve", str(run_dir), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "tokenizer is not the served model's" in err and "\n" not in err, err
    assert main(["serve", str(run_dir), "--draft-model", str(tmp_path / "none")]) == 4  # (a missing path)
    err = capsys.readouterr().err.strip()
    assert "serve --draft-model" in err and "does not exist" in err and "\n" not in err, err


def test_the_default_kv_cache_is_sized_to_the_memory_available():
    """With no --max-len, a CPU server whose whole context would not fit the memory available (by the
    documented formula) takes the longest halving of it that does, and says both numbers; with room
    for the whole context, or nothing known, it keeps the context."""
    from shipyard.config import load_config
    from shipyard.inference.service import fitting_max_len, predicted_bytes

    shape = ["num_layers=30", "num_heads=9", "num_kv_heads=3", "hidden_size=576", "max_seq_len=8192"]
    cfg = load_config("tiny", [f"model.{o}" for o in shape]).model
    weights, per_slot = 513 * 2**20, 2 * 30 * 3 * 64 * 4
    assert fitting_max_len(cfg, weights, 8, 2, "float32", 16 * 2**30) is None
    assert fitting_max_len(cfg, weights, 8, 2, "float32", None) is None
    slots, whole, available = fitting_max_len(cfg, weights, 8, 2, "float32", 5 * 2**30)
    assert available == 5 * 2**30 and whole == predicted_bytes(weights, per_slot * (8 * 8192 + 2 * 2048))
    assert slots == 4096  # 5.9 GiB for all 8,192 slots, 4.3 for 4,096: under 90% of 5
    assert predicted_bytes(weights, per_slot * (8 * 4096 + 2 * 2048)) <= 0.9 * available < whole
    assert fitting_max_len(cfg, weights, 8, 2, "float32", 2**30)[0] == 256  # nothing fits: the shortest


def test_a_server_without_max_len_serves_the_fitted_length(run_dir, tmp_path, monkeypatch):
    """`load_service` with no max_len, in a process whose memory would not hold the model's whole
    context, builds its engine with the length `fitting_max_len` chose, shorter than the context, and
    that engine's caches then fit the memory by the documented formula."""
    from model_fixtures import noisy_params, save_run

    import shipyard.inference.service as service
    from shipyard.config import load_config

    cfg = load_config("tiny", ["model.vocab_size=400", "model.max_seq_len=4096"])
    params = noisy_params(cfg.model, key=1, seed=1, scale=0.1)
    save_run(tmp_path / "long", cfg, params)
    weights = service.weight_bytes(params)
    # room for about 1,500 of the 8 rows x 4,096 slots: the whole context does not fit, 1,024 does
    per_slot = 2 * cfg.model.num_layers * cfg.model.num_kv_heads * cfg.model.head_dim * 4
    available = int((service.RUNTIME_BYTES + 2 * weights + 1.1 * per_slot * 8 * 1500) / 0.9)
    monkeypatch.setattr(service, "_memory", lambda: available)
    want = service.fitting_max_len(cfg.model, weights, 8, 0, "float32", available)
    assert want is not None and want[0] == 1024

    class Built(Exception):
        pass

    built, real = [], service.Engine

    def engine(*args, **kwargs):  # the real engine, then stop before the server compiles and starts
        built.append(real(*args, **kwargs))
        raise Built

    monkeypatch.setattr(service, "Engine", engine)
    with pytest.raises(Built):
        service.load_service(tmp_path / "long", tokenizer=run_dir.parent / "tok", max_batch=8, prefix_cache=0)
    (served,) = built
    assert served.max_len == want[0] < cfg.model.max_seq_len
    assert service.predicted_bytes(weights, served.kv_cache_bytes()) <= 0.9 * available
