"""Schema-driven fuzzing of `shipyard serve`: schemathesis generates requests from the server's own
/openapi.json (valid ones from every request schema, and invalid ones: wrong types, missing fields,
out-of-range numbers, bodies that are not JSON objects) and sends them over real HTTP. No response
may be a 5xx, every refusal carries OpenAI's error body, and afterwards the server is healthy with
every slot free and exits cleanly on SIGTERM (`running_server` checks the exit code). Then a server
SIGKILLed mid-stream is started again and serves, loading its programs from the compile cache.
(16 clients for minutes with dropped streams, and memory growth: bench/serve_load.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest
from serve_fixtures import ServerProcess, running_server, swap_runs

from shipyard.inference.openapi import openapi_document

# Heavy compiles and end-to-end runs: the `make test-slow` tier (docs/testing.md: tiers).
pytestmark = pytest.mark.slow

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

KEY, ADMIN = "fuzz-key", "fuzz-admin-key"
MAX_BATCH = 4


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    # a short context keeps every valid request short (prompt + max_tokens must fit 48 slots)
    flags = ("--max-batch", str(MAX_BATCH), "--max-len", "48", "--compile-cache", str(d / "xla"))
    return {"run": swap_runs(d)["served"], "dir": d, "flags": flags}


@pytest.fixture(scope="module")
def server(served):
    d = served["dir"]
    with running_server(
        served["run"], d / "server.log", *served["flags"], "--admin-key", ADMIN, api_key=KEY
    ) as s:
        yield s


def _headers(path: str) -> dict:
    return {"Authorization": f"Bearer {ADMIN if path.startswith('/admin/') else KEY}"}


def test_the_served_document_is_the_request_models(server):
    r = httpx.get(server.url + "/openapi.json", headers=_headers("/openapi.json"), timeout=10)
    assert r.status_code == 200 and r.json() == openapi_document()
    assert httpx.get(server.url + "/openapi.json", timeout=10).status_code == 401  # behind --api-key


@pytest.mark.parametrize("mode, examples", [("positive", 600), ("negative", 400)])
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


def test_a_server_killed_mid_stream_restarts_from_its_compile_cache(server, served, tmp_path, monkeypatch):
    """SIGKILL while a reply streams; the same command again serves the same request from the
    programs the first start cached: it compiles nothing (JAX logs cache hits and no miss, and the
    cache directory is unchanged)."""
    cache = served["dir"] / "xla"
    assert any(cache.iterdir()) and "compiled programs cached in" in server.log_text()
    first = ServerProcess(served["run"], *served["flags"], api_key=KEY, log=tmp_path / "first.log")
    body = {"model": "served", "prompt": "Kabel", "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    with httpx.stream(
        "POST",
        first.url + "/v1/completions",
        json={**body, "stream": True},
        headers=first.headers(),
        timeout=60,
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                first.proc.send_signal(signal.SIGKILL)
                break
    assert first.stop() == -signal.SIGKILL
    cached = sorted(p.name for p in cache.iterdir())
    monkeypatch.setenv("JAX_DEBUG_LOG_MODULES", "jax._src.compiler")  # its cache hit / miss lines
    again = ServerProcess(served["run"], *served["flags"], api_key=KEY, log=tmp_path / "again.log")
    try:
        r = httpx.post(again.url + "/v1/completions", json=body, headers=again.headers(), timeout=60)
        assert r.status_code == 200 and json.loads(r.text)["usage"]["completion_tokens"] == 40
        assert sorted(p.name for p in cache.iterdir()) == cached  # every program came from the cache
        log = again.log_text()
        assert "Persistent compilation cache hit" in log and "COMPILATION CACHE MISS" not in log, log[-3000:]
    finally:
        assert again.stop() == 0, again.log_text()


def test_the_compile_cache_writes_beside_programs_of_an_unbounded_jax_process(tmp_path):
    """`$JAX_COMPILATION_CACHE_DIR` is shared with training runs, which cache their programs
    unbounded. The server's cache must still write there: JAX's size-bounded cache fails every
    write in a directory holding a program without its access-time file, so a server that bounded
    a shared directory cached nothing and compiled everything again on each restart."""
    code = (
        "import sys, jax, jax.numpy as jnp\n"
        "from shipyard.inference.service import enable_compile_cache\n"
        "if sys.argv[1] == 'serve':\n"
        "    enable_compile_cache(None)\n"
        "else:\n"
        "    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)\n"
        "jax.jit(lambda x: x * int(sys.argv[2]))(jnp.ones(3)).block_until_ready()\n"
    )
    env = {
        **os.environ,
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path),
        "XLA_FLAGS": "",
        "SHIPYARD_NO_REEXEC": "1",
    }
    written = {}
    for role, factor in (("train", 2), ("serve", 3)):
        done = subprocess.run(
            [sys.executable, "-c", code, role, str(factor)], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        written[role] = {p.name for p in tmp_path.glob("*-cache")}
    assert "Error writing persistent compilation cache" not in done.stderr, done.stderr[-2000:]
    assert written["train"] and written["serve"] > written["train"], written  # the server's program too
