"""Structured output: a reply held to a JSON Schema token by token, failing closed.

A request's `response_format` (OpenAI's shape: `{"type": "json_object"}` or `{"type":
"json_schema", "json_schema": {"name", "schema", "strict"}}`) becomes a grammar once per request;
each reply gets its own matcher (`Constraint`), which the engine asks for the set of allowed next
tokens before each token it picks and tells each token it picked. Tokens outside the set have
their logits set to -inf before temperature, top-k/top-p and the draw, so what is sampled is the
model's distribution restricted to what the schema allows.

The grammar engine is llguidance (chosen by measurement over a corpus of schemas against
outlines-core and xgrammar: bench/grammar_choice.py). It refuses every JSON Schema keyword it
cannot enforce instead of ignoring it ("Unimplemented keys: ..."), and that refusal is the 400 a
client gets: a schema is enforced whole or the request is refused, never answered with
unconstrained text.

JSON is produced in one layout: ", " between items and ": " after keys, no other whitespace (a
model cannot pad a reply with endless spaces, and every reply parses the same way).
"""

from __future__ import annotations

import dataclasses
import functools
import json

import numpy as np

WORD = 32
"""Tokens per mask word: token t is bit t % 32 of word t // 32 (llguidance's layout, little-endian)."""

_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A response_format that cannot be enforced; the message names the part (a 400)."""


def mask_words(vocab_size: int) -> int:
    """uint32 words of a token mask over `vocab_size` tokens."""
    return -(-vocab_size // WORD)


@dataclasses.dataclass(frozen=True)
class Grammars:
    """A served tokenizer as the grammar engine sees it, and the grammars compiled for it."""

    tokenizer: object
    """An `llguidance.LLTokenizer` over the model's whole vocabulary (ids past the tokenizer's own
    have no text and are never allowed)."""
    end_ids: tuple[int, ...]
    """Every id the server may end a reply with: a reply's own stop ids replace them in its mask."""
    words: int
    """uint32 words of a mask over the model's logits (the tokenizer may name more or fewer ids)."""

    def compile(self, response_format: dict) -> str | None:
        """The grammar for an OpenAI `response_format` (None: plain text), or GrammarError."""
        # (keys in the client's order: a schema's property order is the order a reply writes them in,
        # and a tool call's format puts "name" before "arguments"; sorted keys reordered them)
        return _compiled(self, json.dumps(response_format))

    def constraint(self, grammar: str, stop_ids) -> Constraint:
        """A matcher for one reply that may end with any of `stop_ids` once the grammar is complete."""
        if not stop_ids:
            raise GrammarError(
                "a structured reply must be able to end: response_format cannot be used with ignore_eos"
            )
        return Constraint(self, grammar, tuple(stop_ids))


def grammars_for(tokenizer_json: str, vocab_size: int, end_ids) -> Grammars:
    """`Grammars` for a `tokenizers` tokenizer (its JSON) serving a model of `vocab_size` logits."""
    import llguidance
    from tokenizers import Tokenizer

    # llguidance wants every id the tokenizer names; the masks are then cut to the model's logits
    n_ids = max(vocab_size, Tokenizer.from_str(tokenizer_json).get_vocab_size(with_added_tokens=True))
    try:
        llt = llguidance.LLTokenizer(tokenizer_json, n_vocab=n_ids, eos_token=list(end_ids), slices=None)
    except ValueError as e:  # e.g. a tokenizer without a decoder: token bytes unknown
        raise GrammarError(
            f"response_format: this model's tokenizer cannot be used for structured output ({e})"
        ) from None
    return Grammars(llt, tuple(end_ids), mask_words(vocab_size))


@functools.lru_cache(maxsize=256)  # clients send the same few schemas again and again
def _compiled(grammars: Grammars, key: str) -> str | None:
    import llguidance

    fmt = json.loads(key)
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = {"type": "object"}
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise GrammarError("response_format.json_schema must be an object with a 'schema' object")
        schema = spec.get("schema", {})  # OpenAI's default: any JSON value
    else:
        raise GrammarError(
            f"response_format.type {kind!r} is not one of 'text', 'json_object', 'json_schema'"
        )
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_LAYOUT)
    except ValueError as e:
        raise GrammarError(f"response_format: the schema is not a JSON object ({e})") from None
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, grammars.tokenizer)
    if failed:
        why = " ".join(messages[0].split())  # one line (a regex error comes with a caret diagram)
        raise GrammarError(f"response_format: this JSON Schema cannot be enforced: {why}")
    return grammar


class Constraint:
    """One reply's place in its grammar: the tokens allowed next, advanced by each token picked.
    Used from the engine's thread only."""

    def __init__(self, grammars: Grammars, grammar: str, stop_ids: tuple[int, ...]):
        import llguidance

        self._matcher = llguidance.LLMatcher(grammars.tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise GrammarError(f"response_format: {self._matcher.get_error()}")
        self.words = words = grammars.words
        self._ends = _bits(grammars.end_ids, words)
        self._stops = _bits(stop_ids, words)

    def mask(self) -> np.ndarray:
        """The allowed next tokens, uint32 [words] (a set bit allows its token). The grammar's end ids
        are replaced by this reply's stop ids, allowed only where the grammar may end."""
        allowed = np.zeros(self.words, np.uint32)
        computed = np.frombuffer(self._matcher.compute_bitmask(), np.uint32)[: self.words]
        allowed[: len(computed)] = computed  # ids past the model's logits (added tokens) cannot be picked
        allowed &= ~self._ends
        if self._matcher.is_accepting():
            allowed = allowed | self._stops
        return allowed

    def advance(self, token: int) -> None:
        """`token` was picked (a stop id ends the reply: nothing to advance)."""
        if self._stops[token // WORD] >> np.uint32(token % WORD) & 1:
            return
        if not self._matcher.consume_token(token):
            raise RuntimeError(
                f"structured output: token {token} broke the grammar: {self._matcher.get_error()}"
            )

    def complete(self) -> bool:
        """Whether the reply so far is a whole document of the grammar."""
        return self._matcher.is_accepting()


def _bits(ids, words: int) -> np.ndarray:
    out = np.zeros(words, np.uint32)
    for t in ids:
        out[t // WORD] |= np.uint32(1) << np.uint32(t % WORD)
    return out
