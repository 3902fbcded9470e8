"""inference/grammar.py without a server: masks sized to the model's logits whatever the tokenizer
names, the stop ids a reply may end with (only where the grammar may end), and refusals in one line.
The served behaviour (replies validated against their schemas) is in tests/test_serve.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from shipyard.inference.grammar import GrammarError, grammars_for, mask_words

TEXT = ['{"name": "Ada", "age": 36}', '{"ok": true, "items": [1, 2, 3]}', "plain words and more words"] * 20


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXT, trainer)
    tok.add_special_tokens(["<|end|>"])  # an added id past the trained ones
    return tok.to_str()


def _allowed(mask: np.ndarray) -> set[int]:
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


@pytest.mark.parametrize("model_vocab", [256, 300, 512])
def test_masks_cover_exactly_the_models_logits(tokenizer_json, model_vocab):
    """A model may have fewer logits than the tokenizer has ids (an added token past them) or more
    (a padded embedding): the mask is the model's width, and no id past the tokenizer's is allowed."""
    n_ids = Tokenizer.from_str(tokenizer_json).get_vocab_size(with_added_tokens=True)
    g = grammars_for(tokenizer_json, model_vocab, end_ids=[1])
    c = g.constraint(g.compile({"type": "json_object"}), stop_ids=[1])
    mask = c.mask()
    assert mask.dtype == np.uint32 and mask.shape == (mask_words(model_vocab),)
    allowed = _allowed(mask)
    assert allowed and max(allowed) < min(model_vocab, n_ids)


def test_a_reply_may_end_only_where_the_grammar_does_and_only_with_its_own_stop_ids(tokenizer_json):
    tok = Tokenizer.from_str(tokenizer_json)
    end = tok.token_to_id("<|end|>")
    g = grammars_for(tokenizer_json, 512, end_ids=[1, end])
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    c = g.constraint(g.compile({"type": "json_schema", "json_schema": {"schema": schema}}), stop_ids=[end])
    assert not _allowed(c.mask()) & {1, end}  # nothing yet: no end
    for t in tok.encode('{"ok": true}').ids:
        assert t in _allowed(c.mask()), tok.id_to_token(t)
        c.advance(t)
    assert c.complete() and _allowed(c.mask()) == {end}  # whole: this reply's stop id alone (not eos 1)


def test_a_reply_writes_the_properties_in_the_schemas_order(tokenizer_json):
    """Properties listed "name" then "age" are held to that order, not sorted: the reply in the
    schema's order is allowed token by token, the other order is cut off (a tool call's format,
    {"name", "arguments"}, depends on it)."""
    tok = Tokenizer.from_str(tokenizer_json)
    g = grammars_for(tokenizer_json, 512, end_ids=[1])
    props = {"name": {"type": "string"}, "age": {"type": "integer"}}
    schema = {
        "type": "object",
        "properties": props,
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    grammar = g.compile({"type": "json_schema", "json_schema": {"schema": schema}})

    def allowed(text: str) -> bool:
        c = g.constraint(grammar, stop_ids=[1])
        for t in tok.encode(text).ids:
            if t not in _allowed(c.mask()):
                return False
            c.advance(t)
        return c.complete()

    assert allowed('{"name": "Ada", "age": 36}')
    assert not allowed('{"age": 36, "name": "Ada"}')


@pytest.mark.parametrize(
    "fmt, words",
    [
        ({"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "(["}}}, "regex parse error: ([ ^ error: unclosed character class"),
        ({"type": "json_schema", "json_schema": {"schema": {"not": {}}}}, 'Unimplemented keys: ["not"]'),
        ({"type": "yaml"}, "response_format.type 'yaml' is not one of"),
    ],
)  # fmt: skip
def test_what_cannot_be_enforced_is_refused_in_one_line(tokenizer_json, fmt, words):
    g = grammars_for(tokenizer_json, 300, end_ids=[1])
    with pytest.raises(GrammarError) as e:
        g.compile(fmt)
    assert words in str(e.value) and "\n" not in str(e.value)
    assert g.compile({"type": "text"}) is None
    with pytest.raises(GrammarError, match="ignore_eos"):
        g.constraint(g.compile({"type": "json_object"}), stop_ids=[])
    json.dumps(fmt)  # (the format stays a plain dict: the compile cache keys on its JSON)


def test_a_tokenizer_without_a_decoder_is_refused_not_a_crash(tokenizer_json):
    spec = json.loads(tokenizer_json)
    spec["decoder"] = None  # token bytes cannot be known
    with pytest.raises(GrammarError, match="tokenizer cannot be used for structured output"):
        grammars_for(json.dumps(spec), 300, end_ids=[1])
