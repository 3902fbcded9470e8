"""The request bodies of the OpenAI-compatible API `shipyard serve` speaks, as strict pydantic models.

Strict: a number where a string is expected (or "0.7" where a number is) is
an error, not a guess. Fields OpenAI defines that shipyard does not implement
(penalties, logit_bias, tools in completions, best_of in chat) are refused
with a 400 naming them rather than silently ignored, so a client never gets behaviour it did
not ask for; other unknown fields are ignored (clients send extras such as
`user`), and listed in the server log.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    model_validator,
)

Number = StrictFloat | StrictInt


class ApiError(Exception):
    """A request the server refuses: HTTP `status` with an OpenAI-style error body."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code
        self.type = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}.get(
            status, "invalid_request_error" if status < 500 else "server_error"
        )

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


MAX_N = 128
"""The most choices per prompt a request may ask for (a server also holds it to --max-batch)."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False
    """Send a last chunk with the token counts before [DONE]."""


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: OpenAI's shape."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: Annotated[StrictStr, Field(max_length=64)] | None = None
    description: StrictStr | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    """The JSON Schema every reply must validate against (default: any JSON value)."""
    strict: StrictBool | None = None
    """Accepted for OpenAI's clients; shipyard always enforces the whole schema or refuses it."""


class ResponseFormat(BaseModel):
    """`response_format`: plain text, any JSON object, or JSON valid against a schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format.json_schema is given exactly when type is 'json_schema'")
        return self

    def openai(self) -> dict:
        """The format as OpenAI spells it (what `grammar.Grammars.compile` reads)."""
        out: dict = {"type": self.type}
        if self.json_schema is not None:
            out["json_schema"] = {
                "schema": self.json_schema.schema_ if self.json_schema.schema_ is not None else {}
            }
        return out


class _Sampling(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr
    """The served model's name (GET /v1/models)."""
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    """0 is greedy; default: the model's generation_config.json, else 1 (OpenAI's default)."""
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    """Nucleus sampling mass; default: the model's generation_config.json, else 1."""
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    """An extension (vLLM's): sample among the k best tokens; 0 or -1 mean all."""
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=16)] | None = None
    """Up to 16 strings; the text ends before the first one that appears."""
    seed: StrictInt | None = None
    """Seeds this request's sampling alone (default 0): same seed, same reply."""
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    """Choices per prompt (at most the server's --max-batch): the prompt is prefilled once and each
    choice samples on from it with seed + its index, so choice j of seed s is the reply seed s + j
    gets alone (greedy choices are all the same reply)."""
    ignore_eos: StrictBool = False
    """An extension (vLLM's): keep generating past end-of-sequence ids, to max_tokens (benchmarks,
    and tests that need a reply of a known length)."""
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Literal[0, 0.0] | None = None
    frequency_penalty: Literal[0, 0.0] | None = None
    response_format: ResponseFormat | None = None
    """Hold every reply to JSON (`json_object`) or to a JSON Schema (`json_schema`), token by token
    (inference/grammar.py); a schema that cannot be enforced whole is a 400."""

    UNSUPPORTED: ClassVar[tuple[str, ...]] = ("logit_bias", "tools", "functions", "suffix")
    """OpenAI fields refused with a 400 naming them (rather than ignored)."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        if isinstance(data, dict):
            for name in cls.UNSUPPORTED:
                if data.get(name) not in (None, {}, [], 1 if name == "best_of" else None):
                    raise ValueError(f"'{name}' is not supported by shipyard serve")
        return data

    def extras(self) -> list[str]:
        """Unknown fields the client sent (ignored)."""
        return sorted(self.model_extra or {})

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: (
        StrictStr
        | TokenIds
        | Annotated[list[StrictStr], Field(min_length=1)]
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    """A string, token ids, or a batch of either (one choice per prompt)."""
    max_tokens: Annotated[StrictInt, Field(ge=1)] = 16
    """New tokens at most (OpenAI's default: 16)."""
    echo: StrictBool = False
    """Return the prompt before the completion (with `logprobs`: the prompt tokens' log-probabilities)."""
    logprobs: Annotated[StrictInt, Field(ge=0, le=5)] | None = None
    """Log-probabilities of each token and of the `logprobs` most likely alternatives."""
    best_of: Annotated[StrictInt, Field(ge=1, le=MAX_N)] | None = None
    """Sample this many choices per prompt (one prefill, seeds seed + j as for `n`) and return the `n`
    with the highest mean log-probability per token (OpenAI's rule), best first; not with `stream`."""

    @model_validator(mode="after")
    def _check_best_of(self):
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.stream and self.samples > self.n:
            raise ValueError("best_of cannot be streamed (the best choices are known only at the end)")
        return self

    @property
    def samples(self) -> int:
        """Choices sampled per prompt: `best_of`, else `n`."""
        return self.best_of or self.n

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr
    arguments: StrictStr
    """The arguments as a JSON string (OpenAI's shape)."""


class ToolCall(BaseModel):
    """A call an assistant message made (sent back in the conversation)."""

    model_config = ConfigDict(extra="ignore")
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    """The calls an assistant message made."""
    tool_call_id: StrictStr | None = None
    """Which call a `tool` message answers."""
    name: StrictStr | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: Annotated[StrictStr, Field(pattern=FUNCTION_NAME)]
    description: StrictStr | None = None
    parameters: dict | None = None
    """A JSON Schema of the arguments (checked: one the structured-output engine cannot read is a 400)."""
    strict: StrictBool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: StrictStr


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Sampling):
    """POST /v1/chat/completions."""

    UNSUPPORTED: ClassVar[tuple[str, ...]] = (
        *(name for name in _Sampling.UNSUPPORTED if name != "tools"),
        "best_of",
    )

    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    """Functions the model may call: shown to it through its chat template, its reply parsed back
    into `tool_calls` (inference/tool_calls.py)."""
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """"auto" (the default with tools): the model decides; "none": no call; "required" or a named
    function: the reply is held to a call (of that function)."""
    parallel_tool_calls: StrictBool | None = None
    """Accepted (a reply may hold several calls; "required" allows several)."""

    @model_validator(mode="after")
    def _check_tools(self):
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError(f"tools: function names must be unique, got {names}")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(
                f"tool_choice names {self.tool_choice.function.name!r}, which is not among the tools {names}"
            )
        if (
            self.tools
            and self.tool_choice != "none"
            and self.response_format not in (None,)
            and (self.response_format.type != "text")
        ):
            raise ValueError("tools and a JSON response_format cannot be combined; use tool_choice")
        return self

    def choice(self):
        """tool_choice as the server uses it: None (no tools in play), "auto", "required" or the
        named function's dict."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.model_dump()
        return self.tool_choice or "auto"

    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    """New tokens at most; default: what is left of the context."""
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    """OpenAI's newer name for max_tokens (wins when both are given)."""
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=5)] | None = None

    def conversation(self) -> list[dict]:
        """The messages as a chat template reads them; a call's arguments as an object when they
        are one (transformers' convention, which templates index into)."""
        out = []
        for m in self.messages:
            msg: dict = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.tool_calls:
                msg["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                    for c in m.tool_calls
                ]  # fmt: skip
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                msg["name"] = m.name
            out.append(msg)
        return out

    def tool_dicts(self) -> list[dict] | None:
        """The offered tools in OpenAI's shape (what a template's `tools` gets), when in play."""
        if self.choice() is None:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


def _arguments(text: str):
    import json

    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's tokenizer endpoint, which lm-eval's remote tokenizer uses)."""

    model_config = ConfigDict(extra="ignore")
    prompt: StrictStr
    add_special_tokens: StrictBool = False


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model_config = ConfigDict(extra="ignore")
    tokens: list[Annotated[StrictInt, Field(ge=0)]]


class SwapRequest(BaseModel):
    """POST /admin/swap: the weights to serve from now on."""

    model_config = ConfigDict(extra="forbid")
    path: Annotated[StrictStr, Field(min_length=1)]
    """A model directory on the server's machine (or a URL): a run, a LoRA run, an import, an HF directory."""
    step: Annotated[StrictInt, Field(ge=0)] | None = None
    """A run's checkpoint step (default: its newest)."""


def validation_message(error) -> tuple[str, str | None]:
    """One line for a pydantic ValidationError: (message, the offending field)."""
    first = error.errors()[0]
    where = ""
    for p in first["loc"]:  # tools[1].function.name: a list index in brackets, as a person writes it
        where += f"[{p}]" if isinstance(p, int) else (f".{p}" if where else str(p))
    where = where or None
    msg = first["msg"].removeprefix("Value error, ")
    field = where.split(".")[0].split("[")[0] if where else None
    return (f"{where}: {msg}" if where else msg), field
