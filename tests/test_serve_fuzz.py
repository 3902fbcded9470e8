"""Schema-driven fuzzing of `shipyard serve`: schemathesis generates requests from the server's own
/openapi.json (valid ones from every request schema, and invalid ones: wrong types, missing fields,
out-of-range numbers, bodies that are not JSON objects) and sends them over real HTTP. No response
may be a 5xx, every refusal carries OpenAI's error body, and afterwards the server is healthy with
every slot free and exits cleanly on SIGTERM (`running_server` checks the exit code)."""

from __future__ import annotations

import httpx
import pytest
from serve_fixtures import running_server, swap_runs

from shipyard.inference.openapi import openapi_document

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

KEY, ADMIN = "fuzz-key", "fuzz-admin-key"
MAX_BATCH = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    run = swap_runs(d)["served"]
    # a short context keeps every valid request short (prompt + max_tokens must fit 48 slots)
    flags = ("--max-batch", str(MAX_BATCH), "--max-len", "48", "--admin-key", ADMIN)
    with running_server(run, d / "server.log", *flags, api_key=KEY) as s:
        yield s


def _headers(path: str) -> dict:
    return {"Authorization": f"Bearer {ADMIN if path.startswith('/admin/') else KEY}"}


def test_the_served_document_is_the_request_models(server):
    r = httpx.get(server.url + "/openapi.json", headers=_headers("/openapi.json"), timeout=10)
    assert r.status_code == 200 and r.json() == openapi_document()
    assert httpx.get(server.url + "/openapi.json", timeout=10).status_code == 401  # behind --api-key


@pytest.mark.parametrize("mode, examples", [("positive", 700), ("negative", 500)])
def test_generated_requests_get_no_server_error_and_openai_error_bodies(server, mode, examples):
    schema = schemathesis.openapi.from_dict(openapi_document())
    seen: dict[int, int] = {}

    @hypothesis.settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    @hypothesis.given(case=schema.as_strategy(schemathesis.GenerationMode(mode)))
    def send(case):
        response = case.call(base_url=server.url, headers=_headers(case.path), timeout=60)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        where = f"{case.method} {case.path} {case.body!r:.300}"
        assert response.status_code < 500, (where, response.text[:500])
        if response.status_code >= 400:
            error = response.json()["error"]
            assert isinstance(error["message"], str) and error["message"], (where, error)
            assert isinstance(error["type"], str), (where, error)

    send()
    print(mode, dict(sorted(seen.items())))
    assert sum(seen.values()) >= examples
    if mode == "positive":
        assert seen.get(200, 0) >= examples // 10, seen  # valid requests were served, not only refused
    else:
        assert sum(n for code, n in seen.items() if 400 <= code < 500) >= examples // 2, seen
    health = server.health()
    assert health["status"] == "ok" and health["active"] == 0, health
    assert "request failed" not in server.log_text()  # the 500 handler's log line
