"""The OpenAPI 3.1 document of `shipyard serve`, served at GET /openapi.json.

The routes read their bodies themselves (`server._parse`: one 400 naming the
field, strict types, OpenAI's error shape), so FastAPI cannot see their
request models; this document is built from the same pydantic models
(`openai_api`), so a schema-driven client or fuzzer (schemathesis, in
tests/test_serve_fuzz.py) generates exactly what the server validates.
Every refusal is documented as an OpenAI-style error body.
"""

from __future__ import annotations

import functools

from pydantic.json_schema import models_json_schema

from shipyard import __version__
from shipyard.inference.openai_api import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    SwapRequest,
    TokenizeRequest,
)

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
"""OpenAI's error body, which every 4xx and 5xx of the server carries."""

POSTS = {
    "/v1/completions": (CompletionRequest, "text completions (streamed as server-sent events with stream)"),
    "/v1/chat/completions": (ChatRequest, "chat completions with the model's chat template"),
    "/tokenize": (TokenizeRequest, "token ids of a prompt, as the server tokenizes it"),
    "/detokenize": (DetokenizeRequest, "the text of token ids"),
    "/admin/swap": (SwapRequest, "serve other weights from now on (needs --admin-key)"),
}
GETS = {
    "/health": "status, active requests and the weights' fingerprint",
    "/metrics": "Prometheus text format",
    "/v1/models": "the served model",
    "/tokenizer_info": "special tokens, chat template and context length",
    "/admin/weights": "which weights are served (needs --admin-key)",
}


def _responses(what: str) -> dict:
    error = {"description": "an OpenAI-style error", "content": {"application/json": {"schema": ERROR}}}
    return {"200": {"description": what}, "4XX": error, "5XX": error}


@functools.cache
def openapi_document() -> dict:
    """The whole document (request schemas under components.schemas, referenced by each POST); built
    once per process, since the models do not change (callers must not modify it)."""
    refs, defs = models_json_schema(
        [(model, "validation") for model, _ in POSTS.values()], ref_template="#/components/schemas/{model}"
    )
    paths: dict[str, dict] = {}
    for path, (model, what) in POSTS.items():
        schema = refs[(model, "validation")]
        paths[path] = {
            "post": {
                "summary": what,
                "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
                "responses": _responses(what),
            }
        }
    for path, what in GETS.items():
        paths[path] = {"get": {"summary": what, "responses": _responses(what)}}
    paths["/v1/models/{name}"] = {
        "get": {
            "summary": "one model by name (404 unless it is the served one)",
            "parameters": [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": _responses("the model"),
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "shipyard serve", "version": __version__},
        "paths": paths,
        "components": {
            "schemas": defs.get("$defs", {}),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }
