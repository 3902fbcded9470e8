"""inference/tool_calls.py: the three families' call formats parsed into OpenAI's tool_calls, a
reply streamed piece by piece giving exactly what it gives whole, calls that do not parse returned
as text, forced calls. Over HTTP with the openai client: tests/test_serve.py."""

from __future__ import annotations

import json

import pytest

from shipyard.inference.tool_calls import (
    ToolCallError,
    ToolReply,
    family_of,
    forced_calls,
    forced_schema,
    parse,
)

WEATHER = {"city": "Oslo", "unit": "celsius"}

# What models of each family write (Qwen/Hermes, Llama 3.1, Mistral), one or two calls each.
REPLIES = {
    "hermes": (
        'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>',
        "Let me look.",
    ),
    "llama3_json": (
        '<|python_tag|>{"name": "weather", "parameters": {"city": "Oslo", "unit": "celsius"}}; {"name": "time", "parameters": {}}',
        None,
    ),
    "mistral": (
        'Checking. [TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Oslo", "unit": "celsius"}}, {"name": "time", "arguments": {}}]',
        "Checking.",
    ),
}  # fmt: skip


@pytest.mark.parametrize("family", list(REPLIES))
def test_each_familys_calls_parse_into_name_and_json_arguments(family):
    text, content = REPLIES[family]
    got_content, calls = parse(family, text)
    assert got_content == content
    assert [c["name"] for c in calls] == ["weather", "time"]
    assert [json.loads(c["arguments"]) for c in calls] == [WEATHER, {}]


@pytest.mark.parametrize("family", list(REPLIES))
def test_a_streamed_reply_gives_exactly_what_the_whole_reply_gives(family):
    """Pushed one character at a time (and whole): the same content, calls and finish; no piece of
    a call's text leaks out as content on the way."""
    text, content = REPLIES[family]
    whole = ToolReply(family, "r")
    head = whole.push(text)
    rest, calls, finish = whole.end("stop")
    assert finish == "tool_calls" and (head + rest) == (content or "")
    streamed = ToolReply(family, "r")
    out = "".join(streamed.push(ch) for ch in text)
    rest2, calls2, finish2 = streamed.end("stop")
    assert (out + rest2, calls2, finish2) == (head + rest, calls, finish)
    assert "<" not in out and "[" not in out and "{" not in out
    assert [c["function"]["name"] for c in calls] == ["weather", "time"] and calls[0]["id"] != calls[1]["id"]


@pytest.mark.parametrize(
    "family, text",
    [
        ("hermes", 'Sure.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Os'),  # cut mid-call
        ("hermes", "<tool_call>\nnot json\n</tool_call>"),
        ("llama3_json", '{"name": "weather", "parameters": [1, 2]}'),
        ("mistral", '[TOOL_CALLS] {"name": "weather"}'),
        ("mistral", '[TOOL_CALLS] [{"arguments": {}}]'),
    ],
)
def test_a_call_that_does_not_parse_comes_back_as_text_saying_so(family, text):
    with pytest.raises(ToolCallError):
        parse(family, text)
    reply = ToolReply(family, "r")
    out = "".join(reply.push(ch) for ch in text)
    rest, calls, finish = reply.end("stop")
    assert calls is None and finish == "invalid_tool_call" and out + rest == text.lstrip()


def test_plain_text_passes_through_unchanged_in_every_family():
    for family in REPLIES:
        text = "The weather in Oslo is mild; [brackets] and {braces} in prose stay text."
        if family == "llama3_json":
            assert parse(family, text) == (text, [])
        reply = ToolReply(family, "r")
        out = "".join(reply.push(ch) for ch in text)
        rest, calls, finish = reply.end("stop")
        assert (out + rest, calls, finish) == (text, None, "stop")


def test_the_family_is_read_from_the_chat_template():
    assert family_of("{% for t in tools %}<tool_call>{{ t }}</tool_call>{% endfor %}") == "hermes"
    assert family_of("{{ '[AVAILABLE_TOOLS]' }}{{ tools }}{{ '[TOOL_CALLS]' }}") == "mistral"
    assert family_of("<|start_header_id|>ipython<|end_header_id|>{{ tools }}<|python_tag|>") == "llama3_json"
    assert family_of("{{ messages }}") is None and family_of(None) is None


def test_forced_calls_are_the_schema_the_reply_was_held_to():
    tools = [
        {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
        {"type": "function", "function": {"name": "time"}},
    ]  # fmt: skip
    schema, name = forced_schema(tools, {"type": "function", "function": {"name": "weather"}})
    assert name == "weather" and schema == tools[0]["function"]["parameters"]
    assert forced_calls('{"city": "Oslo"}', "weather") == [
        {"name": "weather", "arguments": '{"city": "Oslo"}'}
    ]
    schema, name = forced_schema(tools, "required")
    assert name is None and schema["minItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    calls = forced_calls('[{"name": "time", "arguments": {}}]', None)
    assert calls == [{"name": "time", "arguments": "{}"}]
    reply = ToolReply("hermes", "r", forced=(schema, None))
    assert reply.push('[{"name": "time", "arguments": {}}]') == ""
    rest, calls, finish = reply.end("stop")
    assert finish == "tool_calls" and calls[0]["function"] == {"name": "time", "arguments": "{}"}
    cut = ToolReply("hermes", "r", forced=(schema, None))
    cut.push('[{"name": "ti')
    assert cut.end("length") == ('[{"name": "ti', None, "length")  # cut by max_tokens: text, as it is
