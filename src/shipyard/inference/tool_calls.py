"""Tool calls: the functions a chat request offers, the call format of the model's template family,
and the reply parsed back into OpenAI's `tool_calls`.

The tools reach the model through its own chat template (the `tools` variable an HF template
renders, as transformers passes it). What the model writes back depends on the family it was
trained in; three are read:

- `hermes` (Hermes, Qwen 2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
  block per call, after optional text;
- `llama3_json` (Llama 3.1+): the reply is `{"name": ..., "parameters": {...}}` (or
  `"arguments"`), optionally after `<|python_tag|>`, several separated by `;`;
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}`, after optional text.

The family is read from the template (`family_of`) or named (`shipyard serve --tool-parser`).
`tool_choice` "required" or a named function does not trust the model to follow its format: the
reply is held to a JSON Schema (a list of calls of the offered functions, or the named function's
parameters) with the structured-output machinery, so it always parses. A reply that begins a call
in the family's format but does not parse is returned as text with finish_reason
`invalid_tool_call`, never a 500.
"""

from __future__ import annotations

import json
import re
import uuid

FAMILIES = ("hermes", "llama3_json", "mistral")

_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


class ToolCallError(ValueError):
    """The reply started a tool call that does not parse (the message says where)."""


def family_of(template_source: str | None) -> str | None:
    """The call format a chat template's family writes, read from its source (None: none known)."""
    if not template_source:
        return None
    if "<tool_call>" in template_source:
        return "hermes"
    if "[TOOL_CALLS]" in template_source:
        return "mistral"
    if "<|python_tag|>" in template_source or (
        "<|start_header_id|>" in template_source and "tools" in template_source
    ):
        return "llama3_json"
    return None


def call_start(family: str, text: str) -> int | None:
    """Where in `text` (the reply so far) a tool call begins, or None. For streaming: text before it
    can go out; from there on the reply is held until it can be parsed."""
    if family == "hermes":
        i = text.find("<tool_call>")
    elif family == "mistral":
        i = text.find("[TOOL_CALLS]")
    else:  # llama3_json: a call is the whole reply
        stripped = text.lstrip()
        i = 0 if stripped.startswith(("{", "<|python_tag|>")) else -1
    return None if i < 0 else i


def may_start(family: str, text: str) -> bool:
    """Whether `text` could still become the start of a call with more tokens (hold it back)."""
    marker = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}.get(family)
    if marker is None:
        return not text.strip() or "<|python_tag|>".startswith(text.strip())
    return any(text.endswith(marker[:k]) for k in range(1, len(marker)))


def parse(family: str, text: str) -> tuple[str | None, list[dict]]:
    """(text before the calls or None, the calls as [{"name", "arguments" (a JSON string)}]) of a reply;
    ([the text], []) when it holds no call; ToolCallError when it begins one that does not parse."""
    start = call_start(family, text)
    if start is None:
        return text, []
    content = text[:start].strip() or None
    body = text[start:]
    if family == "hermes":
        calls = [_one(block, "arguments") for block in _HERMES.findall(body)]
    elif family == "mistral":
        payload = _json(body.removeprefix("[TOOL_CALLS]").strip(), "the [TOOL_CALLS] list")
        if not isinstance(payload, list):
            raise ToolCallError("[TOOL_CALLS] is not followed by a JSON list")
        calls = [_checked(c, "arguments") for c in payload]
    else:
        body = body.strip().removeprefix("<|python_tag|>").strip()
        calls = [_one(part, "parameters") for part in _split_top_level(body)]
    if not calls:
        raise ToolCallError("a tool call was begun but holds no call")
    return content, calls


def _json(text: str, what: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ToolCallError(f"{what} is not JSON ({e.msg} at character {e.pos})") from None


def _one(text: str, key: str) -> dict:
    return _checked(_json(text.strip(), "a tool call"), key)


def _checked(call, key: str) -> dict:
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ToolCallError('a tool call is not an object with a "name"')
    args = call.get(key, call.get("arguments", call.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        args = _json(args, f'the arguments of "{call["name"]}"')
    if not isinstance(args, dict):
        raise ToolCallError(f'the arguments of "{call["name"]}" are not a JSON object')
    return {"name": call["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def _split_top_level(text: str) -> list[str]:
    """Llama's `;`-separated calls, split where the `;` is outside any JSON object or string."""
    parts, depth, quoted, escaped, start = [], 0, False, False, 0
    for i, ch in enumerate(text):
        if quoted:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = False
            continue
        if ch == '"':
            quoted = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == ";" and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]


def openai_calls(calls: list[dict], request_id: str) -> list[dict]:
    """`tool_calls` entries (OpenAI's shape) with ids unique to the request."""
    return [
        {"id": f"call_{uuid.uuid5(uuid.NAMESPACE_URL, f'{request_id}/{i}').hex[:24]}", "type": "function",
         "function": {"name": c["name"], "arguments": c["arguments"]}}
        for i, c in enumerate(calls)
    ]  # fmt: skip


def forced_schema(tools: list[dict], choice) -> tuple[dict, str | None]:
    """The JSON Schema a reply is held to when the request forces a call: (schema, the named function
    or None). Named: that function's parameters (the reply is its arguments). "required": a list of
    one or more calls of the offered functions, each {"name": const, "arguments": its parameters}."""
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        fn = next(t["function"] for t in tools if t["function"]["name"] == name)
        return _parameters(fn), name
    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": t["function"]["name"]}, "arguments": _parameters(t["function"])},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return {"type": "array", "minItems": 1, "items": {"anyOf": variants}}, None


def _parameters(fn: dict) -> dict:
    return fn.get("parameters") or {"type": "object", "properties": {}}


def forced_calls(text: str, name: str | None) -> list[dict]:
    """The calls of a reply held to `forced_schema` (it parses: the grammar made sure)."""
    value = _json(text, "the forced tool call")
    if name is not None:
        return [{"name": name, "arguments": json.dumps(value, ensure_ascii=False)}]
    return [{"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)} for c in value]


class ToolReply:
    """One choice's text on its way out when the request offers tools: `push` each decoded piece and
    send what it returns as content (text before a call; a call's text is held back), then `end`
    gives the last content, the calls (or None) and the finish reason. The streamed and the whole
    reply are built by the same object, so they agree by construction."""

    def __init__(self, family: str | None, request_id: str, forced: tuple[dict, str | None] | None = None):
        self.family, self.request_id, self.forced = family, request_id, forced
        self.text = ""
        self.sent = 0  # characters of `text` handed out (after leading whitespace, which is dropped)
        self.begun: int | None = None

    def push(self, piece: str) -> str:
        self.text += piece
        if self.forced is not None or self.begun is not None:
            return ""  # a forced reply is all call; a begun call is held until it can be parsed
        if self.family is not None:
            self.begun = call_start(self.family, self.text)
        upto = len(self.text) if self.begun is None else len(self.text[: self.begun].rstrip())
        if self.begun is None and self.family is not None:
            tail = self.text[self.sent : upto]
            if may_start(self.family, self.text):  # hold a suffix that may grow into a call's marker
                upto -= max(
                    (k for k in range(1, len(tail) + 1) if may_start(self.family, tail[-k:])), default=0
                )
            upto = (
                len(self.text[:upto].rstrip()) if self.text[:upto].strip() else upto
            )  # trailing space waits
        return self._out(upto)

    def _out(self, upto: int) -> str:
        if self.sent == 0:
            lead = len(self.text) - len(self.text.lstrip())
            self.sent = min(lead, upto)
        out = self.text[self.sent : upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return out

    def end(self, finish: str | None) -> tuple[str, list[dict] | None, str | None]:
        """(the rest of the content, the calls in OpenAI's shape or None, finish_reason)."""
        if self.forced is not None:
            if finish != "stop":  # cut by max_tokens: not a whole call
                return self._out(len(self.text)), None, finish
            try:
                calls = forced_calls(self.text, self.forced[1])
            except (ToolCallError, KeyError, TypeError):  # (the grammar should have made this impossible)
                return self._out(len(self.text)), None, "invalid_tool_call"
            return "", openai_calls(calls, self.request_id), "tool_calls"
        if self.begun is None:
            return self._out(len(self.text)), None, finish
        try:
            _, calls = parse(self.family, self.text)
        except ToolCallError:
            return self._out(len(self.text)), None, "invalid_tool_call"
        return "", openai_calls(calls, self.request_id), "tool_calls"
