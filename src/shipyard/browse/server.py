"""`shipyard browse ROOT`: the site (browse/site.py) served on 127.0.0.1 by FastAPI, plus the two
answers a static page cannot give: /api/complete (the serving engine on a checkpoint of the root)
and /api/trace (a span of text looked up in a run's training shards). Before each page the site's
artifacts are re-checked (`Site.reverify`), so a file changed under a running server shows ✗ on
the next page.

Nothing is served but the site's pages and the package's assets: no route reads a path a request
names, so `..`, absolute paths and symlinks out of ROOT have nothing to reach (404). With a token
(`--token`), every request needs it (`?token=` once, then a cookie) or gets 403. No route writes to
ROOT (the trace index is cached under the user's cache directory).
"""

from __future__ import annotations

import hmac
import json
import threading
from importlib import resources
from pathlib import Path

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from shipyard.browse.html import ASSETS

COOKIE = "shipyard_browse_token"
MAX_NEW_TOKENS = 512
TRACE_MIN_TOKENS = 4
"""Spans shorter than this are not traced (a few tokens occur everywhere)."""
CONTEXT_CHARS = 240
"""Characters of a matching document shown on each side of the match."""


def create_app(site, token: str | None = None):
    """The FastAPI app serving `site` (with `token`: every request must carry it)."""
    app = FastAPI(title="shipyard browse", docs_url=None, redoc_url=None, openapi_url=None)
    models = _Models(site)

    @app.middleware("http")
    async def check_token(request: Request, call_next):
        if token is None:
            return await call_next(request)
        given = request.query_params.get("token") or request.cookies.get(COOKIE) or ""
        if not hmac.compare_digest(given.encode(), token.encode()):
            return JSONResponse({"detail": "browse: this server needs its access token (?token=...)"}, 403)
        response = await call_next(request)
        if request.query_params.get("token"):
            response.set_cookie(COOKIE, token, httponly=True, samesite="strict")
        return response

    @app.get("/assets/{name}")
    def asset(name: str):
        if name not in ASSETS:
            raise HTTPException(404, f"no asset {name}")
        media = "text/css" if name.endswith(".css") else "text/javascript"
        return Response(read_asset(name), media_type=media)

    @app.post("/api/complete")
    async def complete(request: Request):
        body = await _json(request)
        return models.complete(body)

    @app.post("/api/trace")
    async def trace(request: Request):
        body = await _json(request)
        return models.trace(body)

    @app.get("/{path:path}")
    def any_page(path: str):
        site.reverify()  # every page shows the root as it is now (graph.py: only changes are re-read)
        html = site.render(path or "index.html")
        if html is None:
            raise HTTPException(404, f"no page {path}")
        return HTMLResponse(html)

    return app


async def _json(request) -> dict:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise HTTPException(400, "the request body is not JSON (expected an object)") from None
    if not isinstance(body, dict):
        raise HTTPException(400, "the request body must be a JSON object")
    return body


def read_asset(name: str) -> bytes:
    return resources.files("shipyard.browse").joinpath("assets", name).read_bytes()


class _Models:
    """The checkpoints and trace indexes the API has opened (each once: loading is the slow part)."""

    def __init__(self, site):
        self.site = site
        self.lock = threading.Lock()
        self.open: dict[str, dict] = {}

    def _node(self, key):
        from shipyard.browse.pages_model import models

        nodes = {n.key: n for n in models(self.site)}
        if key not in nodes:
            raise HTTPException(
                400, f"model: {key!r} is not a run or export of this root (one of {sorted(nodes)})"
            )
        return nodes[key]

    def _load(self, node) -> dict:
        with self.lock:
            if node.key not in self.open:
                self.open[node.key] = load_model(self.site, node)
            return self.open[node.key]

    def complete(self, body: dict) -> dict:
        node = self._node(body.get("model"))
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise HTTPException(400, "prompt: expected a non-empty string")
        try:
            max_tokens = int(body.get("max_tokens", 32))
        except (TypeError, ValueError):
            raise HTTPException(400, "max_tokens: expected a whole number") from None
        if not 1 <= max_tokens <= MAX_NEW_TOKENS:
            raise HTTPException(400, f"max_tokens: {max_tokens} is outside 1..{MAX_NEW_TOKENS}")
        mode = body.get("mode", "complete")
        if mode not in ("complete", "chat"):
            raise HTTPException(400, f"mode: {mode!r}; expected complete or chat")
        m = self._load(node)
        return generate(m, prompt, max_tokens, mode)

    def trace(self, body: dict) -> dict:
        node = self._node(body.get("model"))
        text = body.get("text")
        if not isinstance(text, str) or not text.strip():
            raise HTTPException(400, "text: expected the text to trace (a non-empty string)")
        m = self._load(node)
        return trace_text(m, text)


def load_model(site, node) -> dict:
    """A node's model on a started engine, its tokenizer, and what the answer cites."""
    from shipyard.data.tokenizer import load_tokenizer, special_token_ids
    from shipyard.inference.engine import Engine
    from shipyard.run.model_dir import open_model_dir

    md = open_model_dir(node.path, "browse")
    cfg, step, params = md.load(what="browse")
    tok_dir = md.require_tokenizer("browse")
    tok = load_tokenizer(tok_dir)
    eos = special_token_ids(tok_dir, tok).get("eos_token")
    engine = Engine(params, cfg.model, max_batch=1, max_len=min(cfg.model.max_seq_len, 1024)).start()
    try:
        chat = md.chat_format(what="browse")
    except Exception:  # a model without a chat template completes only
        chat = None
    shards = [str(p) for p in (cfg.data.sources()[0] if cfg.data.train_tokens or cfg.data.mixture else [])]
    digest = next((v for k, v in node.recorded.items() if k.startswith("params@") or k == "files"), None)
    return {
        "site": site,
        "node": node,
        "engine": engine,
        "tokenizer": tok,
        "eos": eos,
        "chat": chat,
        "step": step,
        "shards": shards,
        "digest": digest,
        "tokenizer_dir": Path(tok_dir),
        "trace": None,
    }


def generate(m: dict, prompt: str, max_tokens: int, mode: str) -> dict:
    """A greedy reply with each token's log-prob and top alternatives, from the engine."""
    from shipyard.inference.engine import Request
    from shipyard.inference.sampling import Sampling

    tok = m["tokenizer"]
    if mode == "chat":
        if m["chat"] is None:
            raise HTTPException(400, "mode: chat: this model has no chat template; use complete")
        ids = list(m["chat"].prompt([{"role": "user", "content": prompt}]))
        stops = tuple(dict.fromkeys((*m["chat"].end_ids, m["eos"])))
    else:
        ids = tok.encode(prompt, add_special_tokens=False).ids or [m["eos"]]
        stops = (m["eos"],) if m["eos"] is not None else ()
    engine = m["engine"]
    if len(ids) + max_tokens > engine.max_len:
        raise HTTPException(
            400, f"prompt: {len(ids)} tokens + max_tokens {max_tokens} exceed the context {engine.max_len}"
        )
    got, done = [], threading.Event()

    def on_tokens(tokens, logprobs, finish):
        got.extend(zip(tokens, logprobs or [None] * len(tokens)))
        if finish is not None:
            done.set()

    engine.submit(Request(ids, Sampling(max_tokens=max_tokens, stop_ids=stops, logprobs=True), on_tokens))
    done.wait(300)
    out = []
    for token, lp in got:
        value, top = lp if lp is not None else (float("nan"), [])
        out.append(
            {
                "id": int(token),
                "text": tok.decode([int(token)], skip_special_tokens=False),
                "logprob": float(value),
                "top": [
                    {
                        "id": int(i),
                        "text": tok.decode([int(i)], skip_special_tokens=False),
                        "logprob": float(v),
                    }
                    for i, v in top
                ],
            }
        )
    node = m["node"]
    return {
        "prompt": prompt,
        "tokens": out,
        "model": {
            "name": node.name,
            "key": node.key,
            "params_sha256": m["digest"],
            "checkpoint": m["step"],
            "shards": [{"path": p, "page": _page_of(m["site"], p)} for p in m["shards"]],
            "page": f"node/{node.key}.html",
        },
    }


def _page_of(site, path: str) -> str | None:
    """The node page of the step directory `path` lies in, when it is one of the root's."""
    for n in site.nodes:
        if Path(path).resolve().is_relative_to(n.path.resolve()):
            return f"node/{n.key}.html"
    return None


def trace_text(m: dict, text: str) -> dict:
    """The spans of `text` found in the run's training shards (browse/trace.py)."""
    from shipyard.browse import trace
    from shipyard.user_cache import user_cache

    if not m["shards"]:
        raise HTTPException(400, "model: this model records no training shards to trace into")
    if m["trace"] is None:
        m["trace"] = trace.build_index(m["shards"][0], user_cache("trace"))
    tok = m["tokenizer"]
    tokens = tok.encode(text, add_special_tokens=False).ids
    if not tokens:
        raise HTTPException(400, "text: it encodes to no tokens")
    spans = []
    for span in m["trace"].spans(tokens, min_len=TRACE_MIN_TOKENS):
        shown = []
        for match in span.matches:
            doc = trace.document_text(m["trace"], match, tok)
            shown.append(
                {
                    "shard": match.shard,
                    "document": match.document,
                    "before": doc.text[max(0, doc.start - CONTEXT_CHARS) : doc.start],
                    "match": doc.text[doc.start : doc.end],
                    "after": doc.text[doc.end : doc.end + CONTEXT_CHARS],
                }
            )
        piece = tok.decode(tokens[span.start : span.end], skip_special_tokens=False)
        spans.append({"text": piece, "count": span.count, "matches": shown})
    return {"tokens": len(tokens), "shards": m["shards"][0], "spans": spans}


def serve(site, host: str = "127.0.0.1", port: int = 8000, token: str | None = None) -> None:
    import uvicorn

    uvicorn.run(create_app(site, token), host=host, port=port, log_level="warning")
