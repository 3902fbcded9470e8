"""`shipyard serve`: an OpenAI-compatible HTTP API (FastAPI on uvicorn) over the continuous-batching engine.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions
(both streamed as server-sent events with `stream: true`), GET /health, and
vLLM's tokenizer endpoints (GET /tokenizer_info, POST /tokenize,
POST /detokenize), which lm-eval's `local-completions` model uses to
tokenize exactly as the server does.

Every request becomes one `engine.Request` per prompt; the engine thread
hands token bursts to the event loop (`call_soon_threadsafe`), where they
are detokenized (`detokenize.IncrementalText`: whole characters, stop
strings cut) and written out. A client that disconnects mid-stream cancels
its request, which frees its slot at the next decode step.

GET /metrics serves the Prometheus text format (metrics.py): queue depth, slots,
KV cache use, token counters, time-to-first-token and per-token histograms,
responses by status.

Refusals are OpenAI-style error bodies: 400 for a malformed or unsupported
request, 401 for a missing or wrong API key, 404 for an unknown route, 413
for a body over the limit; the server keeps serving whatever it refuses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from shipyard.inference.detokenize import IncrementalText
from shipyard.inference.engine import Engine, Request
from shipyard.inference.grammar import GrammarError, Grammars, grammars_for
from shipyard.inference.hot_swap import SwapBusy, Swapper, SwapRefused
from shipyard.inference.metrics import CONTENT_TYPE, ServeMetrics
from shipyard.inference.openai_api import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    SwapRequest,
    TokenizeRequest,
    validation_message,
)
from shipyard.inference.openapi import openapi_document
from shipyard.inference.sampling import API, Sampling, resolve_sampling
from shipyard.inference.scoring import prompt_logprobs
from shipyard.inference.tool_calls import FAMILIES, ToolReply, forced_schema

log = logging.getLogger("shipyard.serve")


@dataclasses.dataclass
class Service:
    """What the endpoints serve: one model behind an engine, with its tokenizer and chat template."""

    name: str
    engine: Engine
    tok: object
    """A `tokenizers.Tokenizer`."""
    eos_ids: tuple[int, ...]
    """Ids that end a completion (the tokenizer's eos and the model's generation_config eos ids)."""
    chat: object | None
    """A `data.chat_format.ChatFormat`, or None when the model has no chat template."""
    chat_missing: str = ""
    """Why there is no chat template (the 400 a chat request gets)."""
    defaults: object | None = None
    """`interop.hf_config.GenerationDefaults`: sampling settings a request leaves out."""
    specials: dict = dataclasses.field(default_factory=dict)
    """bos/eos/pad token strings (GET /tokenizer_info)."""
    chat_template: str | None = None
    """The model's Jinja chat template text, if it has one (GET /tokenizer_info)."""
    metrics: ServeMetrics | None = None
    """What GET /metrics reports (made by `create_app` when not given)."""
    swapper: Swapper | None = None
    """Loads new weights for POST /admin/swap and `--watch` (None: this server cannot swap)."""
    grammars: Grammars | None = None
    """The tokenizer as the structured-output engine sees it (made at the first `response_format`)."""
    tool_parser: str | None = None
    """The tool-call format of the model's family (`tool_calls.FAMILIES`; None: none known)."""

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids


def _sampling(
    service: Service, body, max_tokens: int, stop_ids, logprobs: bool = False, choice: int = 0
) -> Sampling:
    """The request's settings, else the model's generation_config.json, else OpenAI's defaults
    (`sampling.resolve_sampling`, the rule `generate` and `chat` follow too); choice j of n samples
    with seed + j."""
    return resolve_sampling(
        API,
        service.defaults,
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_k=body.top_k,
        top_p=body.top_p,
        seed=(body.seed if body.seed is not None else 0) + choice,
        stop_ids=() if body.ignore_eos else stop_ids,
        logprobs=logprobs,
    )


class _Job:
    """One choice in flight: engine callbacks in, (text piece, tokens, logprobs, finish) events out.
    The n choices of one prompt are one group (`Engine.submit_group`: one prefill); `_submit` queues
    every group of an HTTP request at once."""

    def __init__(
        self,
        service: Service,
        prompt: list[int],
        sampling: Sampling,
        stops,
        hidden,
        grammar: str | None = None,
    ):
        self.group: list[_Job] = [self]
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.text = IncrementalText(service.decode, stops, hidden)
        constraint = None if grammar is None else service.grammars.constraint(grammar, sampling.stop_ids)
        self.request = Request(prompt, sampling, self._on_tokens, constraint=constraint)
        self.tokens: list[int] = []
        self.chosen: list[float] = []  # the log-probs of the kept tokens, when the request asked for them
        self.service = service
        self.arrived, self.first = time.perf_counter(), None
        self.tools: ToolReply | None = None
        """Set for a chat choice with tools in play: its text goes out through it."""

    def _on_tokens(self, tokens, logprobs, finish) -> None:  # the engine thread
        if self.first is None and tokens:
            self.first = time.perf_counter()
        if finish is not None and self.service.metrics is not None:
            n = self.request.generated
            self.service.metrics.request_done(
                len(self.request.prompt), n, finish, self.arrived, self.first, time.perf_counter()
            )
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (tokens, logprobs, finish))

    async def events(self) -> AsyncIterator[tuple[str, list[int], list, str | None]]:
        try:
            while True:
                tokens, logprobs, finish = await self.queue.get()
                if finish in ("error", "cancelled"):
                    raise ApiError(
                        f"generation ended early ({finish}): the server is stopping or failed", status=503
                    )
                self.tokens.extend(tokens)
                self.chosen += [lp[0] for lp in logprobs if lp is not None]
                piece = self.text.push(tokens)
                if self.text.stopped:
                    self.request.cancel()
                    finish = "stop"
                elif finish is not None:
                    piece += self.text.finish()
                yield piece, tokens, logprobs, finish
                if finish is not None:
                    return
        finally:
            if not self.request.finished and not self.text.stopped:
                log.info("client went away after %d tokens: request cancelled", len(self.tokens))
            self.request.cancel()  # frees the slot at the next step (a no-op once finished)


def _end_ids(service: Service) -> tuple[int, ...]:
    """Every id a reply of this server may end with (chat's end-of-turn ids and the eos ids)."""
    return tuple(
        dict.fromkeys((*(service.chat.end_ids if service.chat is not None else ()), *service.eos_ids))
    )


def _grammar(service: Service, body) -> str | None:
    """The compiled `response_format` of a request (None: plain text); a 400 naming what cannot be
    enforced."""
    if body.response_format is None or body.response_format.type == "text":
        return None
    return _compiled_format(service, body, body.response_format.openai(), "response_format")


def _compiled_format(service: Service, body, fmt: dict, param: str) -> str | None:
    if body.ignore_eos:
        raise ApiError(
            f"{param} cannot be combined with ignore_eos (a JSON reply must end)", param="ignore_eos"
        )
    try:
        if service.grammars is None:
            service.grammars = grammars_for(
                service.tok.to_str(), service.engine.cfg.vocab_size, _end_ids(service)
            )
        return service.grammars.compile(fmt)
    except GrammarError as e:
        raise ApiError(str(e).replace("response_format", param, 1), param=param) from None


def _tool_setup(service: Service, body: ChatRequest) -> tuple[str | None, tuple | None]:
    """(the grammar a forced call is held to, (schema, named function)) for a request with tools in
    play; every tool's parameters must be a schema the engine can read (a 400 naming the tool)."""
    choice = body.choice()
    if choice is None:
        return None, None
    for i, tool in enumerate(body.tools):
        params = tool.function.parameters or {"type": "object"}
        _compiled_format(service, body, _schema_format(params), f"tools[{i}].function.parameters")
    if choice == "auto":
        if service.tool_parser is None:
            raise ApiError(
                "this model's chat template shows no known tool-call format, so a call could not be read back; "
                f"serve with --tool-parser ({', '.join(FAMILIES)}) or send tool_choice 'required' or a named function",
                param="tools",
            )
        return None, None
    forced = forced_schema(body.tool_dicts(), choice)
    return _compiled_format(service, body, _schema_format(forced[0]), "tools"), forced


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"schema": schema}}


def _submit(service: Service, jobs: list[_Job]):
    """Queue every choice of one HTTP request with nothing between them, so all run on one set of
    weights even during a hot swap: (params, fingerprint) of those weights."""
    groups = {id(job.group[0]): [j.request for j in job.group] for job in jobs}
    return service.engine.submit_groups(list(groups.values()))


def _cancel(jobs: list[_Job]) -> None:
    """Free the slots of a request's choices (a no-op for those that finished)."""
    for job in jobs:
        job.request.cancel()


def _grouped(jobs: list[_Job], n: int) -> list[_Job]:
    """Make each run of n consecutive jobs (the choices of one prompt) one group."""
    for i in range(0, len(jobs), n):
        for job in jobs[i : i + n]:
            job.group = jobs[i : i + n]
    return jobs


def _n_check(service: Service, n: int, name: str = "n") -> None:
    if n > service.engine.max_batch:
        raise ApiError(
            f"{name}={n} choices do not fit this server's {service.engine.max_batch} decode slots "
            "(shipyard serve --max-batch); ask for fewer",
            param=name,
        )


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class _Logprobs:
    """The completions API's `logprobs` object, built up token by token."""

    def __init__(self, service: Service, top: int):
        self.service, self.top = service, top
        self.obj = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self.offset = 0

    def add(self, ids: list[int], logprobs: list) -> dict:
        start = len(self.obj["tokens"])
        for t, lp in zip(ids, logprobs):
            piece = self.service.decode([t])
            self.obj["tokens"].append(piece)
            self.obj["text_offset"].append(self.offset)
            self.offset += len(piece)
            if lp is None:
                self.obj["token_logprobs"].append(None)
                self.obj["top_logprobs"].append(None)
                continue
            chosen, alternatives = lp
            self.obj["token_logprobs"].append(chosen)
            top: dict[str, float] = {}
            for i, value in alternatives[: self.top]:
                top.setdefault(self.service.decode([i]), value)
            self.obj["top_logprobs"].append(top)
        return {k: v[start:] for k, v in self.obj.items()}


def _chat_logprobs(service: Service, ids: list[int], logprobs: list, top: int) -> list[dict]:
    def entry(i, value):
        text = service.decode([i])
        return {"token": text, "logprob": value, "bytes": list(text.encode())}

    return [
        {**entry(t, chosen), "top_logprobs": [entry(i, v) for i, v in alternatives[:top]]}
        for t, (chosen, alternatives) in zip(ids, logprobs)
    ]


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _context_check(service: Service, n_prompt: int, max_tokens: int) -> None:
    limit = service.engine.max_len
    if n_prompt + max_tokens > limit:
        raise ApiError(
            f"this model's context is {limit} tokens; the prompt has {n_prompt} and max_tokens asks for "
            f"{max_tokens} more ({n_prompt + max_tokens}); shorten the prompt or lower max_tokens",
            param="max_tokens" if n_prompt < limit else "prompt",
            code="context_length_exceeded",
        )


def _parse(model_cls, raw: bytes, service: Service):
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(f"the request body is not valid JSON ({e})") from e
    if not isinstance(obj, dict):
        raise ApiError(f"the request body must be a JSON object, got {type(obj).__name__}")
    try:
        body = model_cls.model_validate(obj)
    except ValidationError as e:
        message, field = validation_message(e)
        raise ApiError(message, param=field) from e
    if hasattr(body, "model") and body.model != service.name:
        raise ApiError(
            f"model {body.model!r} is not served here; this server serves {service.name!r} (GET /v1/models)",
            param="model",
            code="model_not_found",
        )
    if hasattr(body, "extras") and body.extras():
        log.warning("ignoring unknown request fields: %s", ", ".join(body.extras()))
    return body


def create_app(
    service: Service,
    *,
    api_key: str | None = None,
    max_body_bytes: int = 1 << 20,
    admin_key: str | None = None,
):
    """The FastAPI application serving `service` (run it with uvicorn; see `serve`). `admin_key`
    opens /admin/* to requests that send it (without one they are refused)."""
    app = FastAPI(title="shipyard serve", docs_url=None, redoc_url=None, openapi_url=None)
    if service.metrics is None:
        service.metrics = ServeMetrics(service.engine, service.swapper)

    _add_error_handlers(app)
    _add_operations(app, service)
    _add_openai_api(app, service)
    _add_tokenizer_api(app, service)
    return _Guard(app, api_key, max_body_bytes, service.metrics, admin_key)


def _add_error_handlers(app) -> None:
    """Every error as an OpenAI-style JSON error body: `ApiError`, HTTP errors, anything else as a 500."""

    @app.exception_handler(ApiError)
    async def api_error(_request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(_request, e: HTTPException):
        return JSONResponse(ApiError(str(e.detail), status=e.status_code).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def server_error(_request, e: Exception):
        log.exception("request failed")
        return JSONResponse(ApiError(f"internal error: {e}", status=500).body(), status_code=500)


def _add_operations(app, service: Service) -> None:
    """The operator's routes: /health, /admin/weights and /admin/swap, /openapi.json, /metrics."""

    @app.get("/health")
    async def health():
        if service.engine.error is not None:
            return JSONResponse({"status": "error", "error": str(service.engine.error)}, status_code=503)
        engine = service.engine
        return {
            "status": "ok",
            "model": service.name,
            "max_batch": engine.max_batch,
            "active": engine.active(),
            "fingerprint": engine.fingerprint,
        }

    @app.get("/admin/weights")
    async def weights():
        swapper = service.swapper
        source = {"model": swapper.model, "step": swapper.step} if swapper else {}
        return {"fingerprint": service.engine.fingerprint, **source}

    @app.post("/admin/swap")
    async def swap(request: HttpRequest):
        body = _parse(SwapRequest, await request.body(), service)
        if service.swapper is None:
            raise ApiError("this server was started without a way to load weights", status=409)
        try:
            return await asyncio.to_thread(service.swapper.swap_to, body.path, body.step)
        except SwapBusy as e:
            raise ApiError(str(e), status=409, code="swap_in_progress") from e
        except SwapRefused as e:
            raise ApiError(str(e), status=409, param="path", code="swap_refused") from e

    @app.get("/openapi.json")
    async def openapi():
        return openapi_document()

    @app.get("/metrics")
    async def metrics():
        return Response(service.metrics.render(), media_type=CONTENT_TYPE)


def _add_openai_api(app, service: Service) -> None:
    """OpenAI's routes: /v1/models (and one model), /v1/completions, /v1/chat/completions."""

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(service)]}

    @app.get("/v1/models/{name}")
    async def model(name: str):
        if name != service.name:
            raise ApiError(f"model {name!r} is not served here", status=404, code="model_not_found")
        return _model_card(service)

    @app.post("/v1/completions")
    async def completions(request: HttpRequest):
        body = _parse(CompletionRequest, await request.body(), service)
        return await _completions(service, body, StreamingResponse)

    @app.post("/v1/chat/completions")
    async def chat(request: HttpRequest):
        body = _parse(ChatRequest, await request.body(), service)
        return await _chat(service, body, StreamingResponse)


def _add_tokenizer_api(app, service: Service) -> None:
    """vLLM's tokenizer routes (lm-eval tokenizes through them): /tokenizer_info, /tokenize, /detokenize."""

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return {
            **service.specials,
            "chat_template": service.chat_template,
            "model_max_length": service.engine.max_len,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }

    @app.post("/tokenize")
    async def tokenize(request: HttpRequest):
        body = _parse(TokenizeRequest, await request.body(), service)
        ids = service.tok.encode(body.prompt, add_special_tokens=body.add_special_tokens).ids
        return {"tokens": ids, "count": len(ids), "max_model_len": service.engine.max_len}

    @app.post("/detokenize")
    async def detokenize(request: HttpRequest):
        body = _parse(DetokenizeRequest, await request.body(), service)
        vocab = service.tok.get_vocab_size(with_added_tokens=True)
        if any(t >= vocab for t in body.tokens):
            raise ApiError(f"token ids must be below the vocabulary size {vocab}", param="tokens")
        return {"prompt": service.decode(body.tokens)}


def _model_card(service: Service) -> dict:
    return {
        "id": service.name,
        "object": "model",
        "created": 0,
        "owned_by": "shipyard",
        "max_model_len": service.engine.max_len,
    }


def _prompt_ids(service: Service, prompt) -> list[int]:
    vocab = service.engine.cfg.vocab_size
    if isinstance(prompt, str):
        ids = service.encode(prompt)
        if not ids:
            raise ApiError("the prompt is empty; give at least one token", param="prompt")
        return ids
    if any(t >= vocab for t in prompt):
        raise ApiError(f"prompt token ids must be below the model's vocabulary size {vocab}", param="prompt")
    return list(prompt)


async def _completions(service: Service, body: CompletionRequest, streaming: Callable):
    prompts = [_prompt_ids(service, p) for p in body.prompts()]
    for p in prompts:
        _context_check(service, len(p), body.max_tokens)
    k = body.samples  # sampled per prompt; the best n of them are returned
    _n_check(service, k, "best_of" if k > body.n else "n")
    rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    t0 = time.perf_counter()
    want_lp = body.logprobs is not None or k > body.n  # best_of ranks by the chosen tokens' log-probs
    grammar = _grammar(service, body)
    jobs = _grouped(
        [
            _Job(
                service,
                p,
                _sampling(service, body, body.max_tokens, service.eos_ids, want_lp, j),
                body.stops(),
                service.eos_ids,
                grammar,
            )
            for p in prompts
            for j in range(k)
        ],
        k,
    )  # choice i * k + j: prompt i's choice j, as OpenAI numbers them
    head = {"id": rid, "object": "text_completion", "created": created, "model": service.name}

    def logged(completion_tokens: int, finish) -> None:
        log.info(
            "%s completions prompts=%d tokens_in=%d tokens_out=%d latency=%.3fs finish=%s",
            rid, len(prompts), sum(map(len, prompts)), completion_tokens, time.perf_counter() - t0, finish,
        )  # fmt: skip

    if body.stream:
        return streaming(
            _stream_completions(service, body, prompts, jobs, head, logged), media_type="text/event-stream"
        )
    try:
        echoes = await _started(service, body, prompts, jobs, head)
        choices = await asyncio.gather(
            *(_complete_one(body, i, job, echoes[i]) for i, job in enumerate(jobs))
        )
    finally:
        _cancel(jobs)
    if k > body.n:
        choices = _best(choices, jobs, body.n, k)
    n_out = sum(len(j.tokens) for j in jobs)  # every sample counts, as OpenAI bills best_of
    logged(n_out, ",".join(c["finish_reason"] for c in choices))
    return {**head, "choices": choices, "usage": _usage(sum(map(len, prompts)), n_out)}


def _best(choices: list[dict], jobs: list[_Job], n: int, k: int) -> list[dict]:
    """best_of: of each prompt's k choices, the n with the highest mean log-probability per token (ties:
    the lower seed), best first, numbered prompt-major."""
    out = []
    for first in range(0, len(jobs), k):
        ranked = sorted(
            range(first, first + k), key=lambda i: -sum(jobs[i].chosen) / max(len(jobs[i].chosen), 1)
        )
        out += [{**choices[i], "index": len(out) + r} for r, i in enumerate(ranked[:n])]
    return out


async def _started(service: Service, body: CompletionRequest, prompts, jobs: list[_Job], head: dict) -> list:
    """Queue the jobs, note their weights' fingerprint in `head`, and return each choice's echo
    (scored on those weights)."""
    params, fingerprint = _submit(service, jobs)
    head["system_fingerprint"] = fingerprint
    echoes = await asyncio.gather(*(_echo(service, body, p, params) for p in prompts))
    return [e for e in echoes for _ in range(body.samples)]


async def _echo(service: Service, body: CompletionRequest, prompt: list[int], params):
    """(prompt text, a function making its logprobs object, or None) for an `echo` request, else
    None. A fresh object per choice: each choice's logprobs go on from the prompt's."""
    if not body.echo:
        return None
    fresh = None
    if body.logprobs is not None:
        scores = await asyncio.to_thread(prompt_logprobs, params, service.engine.cfg, prompt)

        def fresh():
            lp = _Logprobs(service, body.logprobs)
            lp.add(prompt, [None, *scores])
            return lp

    return service.decode(prompt), fresh


async def _complete_one(body: CompletionRequest, index: int, job: _Job, echo) -> dict:
    text, finish = [], None
    if echo and echo[1] is not None:
        lp = echo[1]()
    else:
        lp = _Logprobs(job.service, body.logprobs) if body.logprobs is not None else None
    async for piece, tokens, logprobs, finish in job.events():  # noqa: B007 (the last finish is the reply's)
        text.append(piece)
        if lp is not None:
            lp.add(tokens, logprobs)
    prefix = echo[0] if echo else ""
    return {
        "index": index,
        "text": prefix + "".join(text),
        "logprobs": lp.obj if lp is not None else None,
        "finish_reason": finish,
    }


async def _stream_completions(service, body, prompts, jobs, head, logged) -> AsyncIterator[str]:
    queue: asyncio.Queue = asyncio.Queue()
    try:
        echoes = await _started(service, body, prompts, jobs, head)
    except BaseException:
        _cancel(jobs)
        raise

    async def pump(index: int, job: _Job):
        lp = _Logprobs(job.service, body.logprobs) if body.logprobs is not None else None
        try:
            if echoes[index]:
                text, fresh = echoes[index]
                echo_lp = fresh() if fresh is not None else None
                await queue.put((index, text, echo_lp.obj if echo_lp else None, None))
                if echo_lp is not None:
                    lp.offset = echo_lp.offset
            async for piece, tokens, logprobs, finish in job.events():
                await queue.put((index, piece, lp.add(tokens, logprobs) if lp else None, finish))
        finally:  # also when the job failed: the stream below must not wait for it forever
            await queue.put((index, None, None, "done"))

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    finishes = []
    try:
        running = len(jobs)
        while running:
            index, piece, lp, finish = await queue.get()
            if finish == "done":
                running -= 1
                continue
            if finish is not None:
                finishes.append(finish)
            choice = {"index": index, "text": piece, "logprobs": lp, "finish_reason": finish}
            yield _sse({**head, "choices": [choice]})
        for t in tasks:
            t.result()  # an error inside a job surfaces here
        n_in = sum(len(j.request.prompt) for j in jobs if j.group[0] is j)  # each prompt once, as OpenAI
        n_out = sum(len(j.tokens) for j in jobs)
        if body.stream_options is not None and body.stream_options.include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(n_in, n_out)})
        yield "data: [DONE]\n\n"
        logged(n_out, ",".join(finishes))
    except ApiError as e:
        yield _sse(e.body())
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
        _cancel(jobs)


async def _chat(service: Service, body: ChatRequest, streaming: Callable):
    if service.chat is None:
        raise ApiError(f"this model has no chat template ({service.chat_missing}); use /v1/completions")
    tool_grammar, forced = _tool_setup(service, body)
    try:
        prompt = service.chat.prompt(body.conversation(), tools=body.tool_dicts())
    except Exception as e:  # a template may refuse a conversation (raise_exception in Jinja)
        raise ApiError(f"the model's chat template refused these messages: {e}", param="messages") from e
    limit = service.engine.max_len
    max_tokens = body.max_completion_tokens or body.max_tokens or max(limit - len(prompt), 1)
    _context_check(service, len(prompt), max_tokens)
    stop_ids = tuple(dict.fromkeys((*service.chat.end_ids, *service.eos_ids)))
    _n_check(service, body.n)
    grammar = tool_grammar or _grammar(service, body)
    jobs = _grouped(
        [
            _Job(
                service,
                prompt,
                _sampling(service, body, max_tokens, stop_ids, bool(body.logprobs), j),
                body.stops(),
                stop_ids,
                grammar,
            )
            for j in range(body.n)
        ],
        body.n,
    )
    rid, created, t0 = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), time.perf_counter()
    top = body.top_logprobs or 0
    if body.choice() is not None:  # each choice's text goes out through its own ToolReply
        for j, job in enumerate(jobs):
            job.tools = ToolReply(service.tool_parser, f"{rid}/{j}", forced)

    def logged(finishes) -> None:
        log.info(
            "%s chat choices=%d tokens_in=%d tokens_out=%d latency=%.3fs finish=%s",
            rid, len(jobs), len(prompt), sum(len(j.tokens) for j in jobs), time.perf_counter() - t0, ",".join(finishes),
        )  # fmt: skip

    if body.stream:
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": service.name}
        return streaming(_stream_chat(service, body, jobs, head, top, logged), media_type="text/event-stream")
    _, fingerprint = _submit(service, jobs)

    async def one(index: int, job: _Job) -> dict:
        text, logprobs, finish = [], [], None
        async for piece, tokens, lps, finish in job.events():  # noqa: B007 (the last finish is the reply's)
            text.append(job.tools.push(piece) if job.tools is not None else piece)
            if body.logprobs:
                logprobs += _chat_logprobs(service, tokens, lps, top)
        message = {"role": "assistant", "content": "".join(text)}
        if job.tools is not None:
            rest, calls, finish = job.tools.end(finish)
            message["content"] = "".join(text) + rest
            if calls:
                message["content"] = message["content"] or None
                message["tool_calls"] = calls
        return {
            "index": index,
            "message": message,
            "logprobs": {"content": logprobs} if body.logprobs else None,
            "finish_reason": finish,
        }

    try:
        choices = await asyncio.gather(*(one(i, job) for i, job in enumerate(jobs)))
    finally:
        _cancel(jobs)
    logged([c["finish_reason"] for c in choices])
    head = {"id": rid, "object": "chat.completion", "created": created, "model": service.name}
    head["system_fingerprint"] = fingerprint
    return {**head, "choices": choices, "usage": _usage(len(prompt), sum(len(j.tokens) for j in jobs))}


async def _stream_chat(service, body: ChatRequest, jobs: list[_Job], head, top, logged) -> AsyncIterator[str]:
    """The choices' chunks as they come (each names its `index`), merged into one event stream."""

    def chunk(index: int, delta: dict, finish=None, logprobs=None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return _sse({**head, "choices": [choice]})

    queue: asyncio.Queue = asyncio.Queue()
    _, head["system_fingerprint"] = _submit(service, jobs)

    async def pump(index: int, job: _Job):
        try:
            async for piece, tokens, lps, finish in job.events():
                lp = {"content": _chat_logprobs(service, tokens, lps, top)} if body.logprobs else None
                if job.tools is None:
                    await queue.put((index, piece, lp, finish))
                    continue
                piece = job.tools.push(piece)
                if finish is None:
                    await queue.put((index, piece, lp, None))
                    continue
                rest, calls, finish = job.tools.end(finish)
                await queue.put((index, piece + rest, lp, None))
                for k, call in enumerate(calls or []):  # each call whole: the deltas reassemble exactly
                    await queue.put((index, {"tool_calls": [{"index": k, **call}]}, None, None))
                await queue.put((index, "", None, finish))
        finally:  # also when the job failed: the stream below must not wait for it forever
            await queue.put((index, None, None, "done"))

    tasks = []
    try:
        for i in range(len(jobs)):
            yield chunk(i, {"role": "assistant", "content": ""})
        tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
        running, finishes = len(jobs), []
        while running:
            index, piece, lp, finish = await queue.get()
            if finish == "done":
                running -= 1
                continue
            if isinstance(piece, dict):  # a tool call
                yield chunk(index, piece)
            elif piece or lp:
                yield chunk(index, {"content": piece}, None, lp)
            if finish is not None:
                finishes.append(finish)
                yield chunk(index, {}, finish)
        for t in tasks:
            t.result()  # an error inside a job surfaces here
        logged(finishes)
        if body.stream_options is not None and body.stream_options.include_usage:
            usage = _usage(len(jobs[0].request.prompt), sum(len(j.tokens) for j in jobs))
            yield _sse({**head, "choices": [], "usage": usage})
        yield "data: [DONE]\n\n"
    except ApiError as e:
        yield _sse(e.body())
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
        _cancel(jobs)


ROUTES = frozenset(
    {
        "/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
        "/tokenizer_info", "/tokenize", "/detokenize", "/admin/weights", "/admin/swap", "/openapi.json",
    }
)  # fmt: skip
"""The routes /metrics counts responses of by name (any other path counts as "other")."""


class _Guard:
    """ASGI middleware in front of every route: the API key (the admin key for /admin/*), then the
    body size limit.

    The body is read here in full (at most `max_body` bytes) and replayed to
    the app, so an oversized upload is refused (413) before any parsing, and
    the app's later `receive` calls still see a client's disconnect.
    """

    def __init__(self, app, api_key: str | None, max_body: int, metrics: ServeMetrics, admin_key: str | None):
        self.app, self.api_key, self.max_body, self.metrics = app, api_key, max_body, metrics
        self.admin_key = admin_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"] if scope["path"] in ROUTES else "other"  # bounded label values

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.response(path, message["status"])
            await send(message)

        return await self._guarded(scope, receive, counted)

    async def _guarded(self, scope, receive, send):
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"authorization", b"")
        if scope["path"].startswith("/admin/"):
            if self.admin_key is None:
                message = "the admin endpoints are off: start shipyard serve with --admin-key KEY to use them"
                return await _send_error(send, ApiError(message, status=403, code="admin_disabled"))
            if not hmac.compare_digest(given, b"Bearer " + self.admin_key.encode()):
                what = "no admin key" if not given else "a wrong admin key"
                message = f"{what}: send the server's --admin-key as 'Authorization: Bearer KEY'"
                return await _send_error(send, ApiError(message, status=401, code="invalid_api_key"))
        elif (
            self.api_key is not None
            and scope["path"] != "/health"
            and not hmac.compare_digest(given, b"Bearer " + self.api_key.encode())
        ):
            what = "no API key" if not given else "a wrong API key"
            message = f"{what}: send the server's --api-key as 'Authorization: Bearer KEY'"
            return await _send_error(send, ApiError(message, status=401, code="invalid_api_key"))
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            return await _send_error(send, self._too_big(int(declared)))
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body:
                return await _send_error(send, self._too_big(size))
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    def _too_big(self, size: int) -> ApiError:
        return ApiError(
            f"the request body has {size} bytes, more than this server's limit of {self.max_body} "
            "(shipyard serve --max-body-mb)",
            status=413,
            code="body_too_large",
        )


async def _send_error(send, e: ApiError) -> None:
    payload = json.dumps(e.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
