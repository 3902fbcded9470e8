"""Preference pairs: the final-reply mask token by token, bad pairs by reason, pair packing, the loader."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from chat_fixtures import write_tokenizer
from hf_fixtures import write_bpe
from model_fixtures import noisy_params

from shipyard.config import load_config
from shipyard.data.chat_format import ChatFormat, pick_template
from shipyard.data.preference import (
    PREFERENCE_BATCH_KEYS,
    PairBatchLoader,
    pack_pairs,
    pair_slots,
    read_pairs,
    render_pair,
)
from shipyard.data.tokenizer import load_tokenizer
from shipyard.errors import DataError
from shipyard.model.transformer import logits_and_stats
from shipyard.train.preference_loss import reply_logps

MULTI_TURN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "HELLO"},
    {"role": "user", "content": "write a word: cat"},
]


@pytest.fixture(scope="module")
def fmt(tmp_path_factory):
    tok = load_tokenizer(write_tokenizer(tmp_path_factory.mktemp("tok")))
    return ChatFormat(tok, pick_template("auto", tok))


def _pairs(n: int, seed: int = 0) -> list[dict]:
    """Pairs of the uppercase task with prompts and replies of varied length, some multi-turn."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        word = "".join(rng.choice(list("abcdefghij"), size=int(rng.integers(2, 8))))
        messages = [{"role": "user", "content": f"write a word: {word}"}]
        if i % 3 == 0:
            messages = MULTI_TURN[:3] + messages
        out.append({"messages": messages, "chosen": word.upper(), "rejected": word})
    return out


def _write(path, lines) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def test_shipyard_template_masks_exactly_the_final_reply(fmt):
    tok, sid = fmt.tok, fmt.tok.token_to_id
    pair = {"messages": MULTI_TURN, "chosen": "CAT", "rejected": "cat!"}
    rendered = render_pair(fmt, pair)
    prompt = [sid("<|bos|>")]
    for m in MULTI_TURN:
        prompt += [sid(f"<|{m['role']}|>"), *tok.encode(m["content"]).ids, sid("<|end|>")]
    prompt.append(sid("<|assistant|>"))
    for (ids, mask), reply in ((rendered.chosen, "CAT"), (rendered.rejected, "cat!")):
        content = tok.encode(reply).ids
        assert ids == prompt + content + [sid("<|end|>")]
        # only the final reply and its end token: the earlier assistant turn HELLO is context
        assert mask == [0] * len(prompt) + [1] * (len(content) + 1)
    # SFT's rendering would train HELLO too: the pair's mask is narrower on purpose
    assert sum(fmt.render([*MULTI_TURN, {"role": "assistant", "content": "CAT"}])[1]) == 6 + 4


def test_hf_template_masks_exactly_the_final_reply(tmp_path):
    path = write_bpe(tmp_path / "hf")
    tok = load_tokenizer(path)
    hf = ChatFormat(tok, pick_template("hf", tok, path))
    rendered = render_pair(hf, {"messages": MULTI_TURN, "chosen": "the model", "rejected": "a token"})
    prompt = hf.prompt(MULTI_TURN)  # ends with "<|im_start|>assistant\n"
    for (ids, mask), reply in ((rendered.chosen, "the model"), (rendered.rejected, "a token")):
        assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])
        trained = [t for t, m in zip(ids, mask) if m]
        assert tok.decode(trained, skip_special_tokens=False) == reply + "<|im_end|>"
        # the template's newline after <|im_end|> closes the turn untrained, as in SFT
        assert mask == [0] * len(prompt) + [1] * len(trained) + [0] * (len(ids) - len(prompt) - len(trained))
        assert tok.decode(ids[len(prompt) :], skip_special_tokens=False) == reply + "<|im_end|>\n"


def test_read_pairs_normalises_prompts_and_refuses_malformed_lines(tmp_path):
    good = {"prompt": "hi", "chosen": "HI", "rejected": "hi", "id": 7}  # extra keys are ignored
    path = _write(tmp_path / "ok.jsonl", [good, "", {"messages": MULTI_TURN, "chosen": "A", "rejected": "b"}])
    pairs = read_pairs(path)
    assert pairs[0] == {"messages": [{"role": "user", "content": "hi"}], "chosen": "HI", "rejected": "hi"}
    assert pairs[1]["messages"] == MULTI_TURN and len(pairs) == 2
    cases = {
        "json": ('{"prompt": "x", ', "not valid JSON"),
        "list": ("[1, 2]", "expected an object"),
        "neither": ({"chosen": "a", "rejected": "b"}, "has neither of 'prompt' and 'messages'"),
        "both": ({"prompt": "x", "messages": MULTI_TURN, "chosen": "a", "rejected": "b"}, "has both"),
        "chosen": ({"prompt": "x", "rejected": "b"}, "missing 'chosen'"),
        "type": ({"prompt": "x", "chosen": "a", "rejected": ["b"]}, "'rejected' must be a string"),
        "prompt": ({"prompt": 3, "chosen": "a", "rejected": "b"}, "'prompt' must be a string"),
        "role": (
            {"messages": [{"role": "bot", "content": "x"}], "chosen": "a", "rejected": "b"},
            "role 'bot'",
        ),
        "ends": (
            {"messages": MULTI_TURN[:3], "chosen": "a", "rejected": "b"},
            "must end with a user turn .* not 'assistant'",
        ),
    }
    for name, (line, needle) in cases.items():
        bad = _write(tmp_path / f"{name}.jsonl", [good, line])
        with pytest.raises(DataError, match=f"^data.preference: {bad} line 2: .*{needle}") as e:
            read_pairs(bad)
        assert "\n" not in str(e.value)
    with pytest.raises(DataError, match="holds no pairs"):
        read_pairs(_write(tmp_path / "empty.jsonl", [""]))
    with pytest.raises(DataError, match="does not exist"):
        read_pairs(tmp_path / "missing.jsonl")


def test_bad_pairs_are_counted_by_reason_and_the_rest_kept_intact(fmt):
    good = _pairs(6)
    bad = [
        {"messages": MULTI_TURN, "chosen": "", "rejected": "x"},
        {"messages": MULTI_TURN, "chosen": "X", "rejected": " \n"},
        {"messages": MULTI_TURN, "chosen": "same", "rejected": "same"},
        {"messages": [{"role": "user", "content": "y" * 80}], "chosen": "Y" * 30, "rejected": "y"},
    ]
    rendered = [render_pair(fmt, p) for p in good + bad]
    assert rendered[6:9] == ["empty_reply", "empty_reply", "identical"]
    packed = pack_pairs(rendered, seq_len=127, pad_id=0, seed=0)
    assert packed.bad == {"empty_reply": 2, "identical": 1, "too_long": 1}
    assert packed.pairs == 6 == int(packed.pair_mask.sum())
    # every kept pair is in the rows exactly as rendered, chosen then rejected
    found = []
    for r in range(len(packed)):
        seg, tokens = packed.segment_ids[r], packed.tokens[r]
        for k in range(int(packed.pair_mask[r].sum())):
            c, j = np.flatnonzero(seg == 2 * k), np.flatnonzero(seg == 2 * k + 1)
            assert c[-1] + 1 == j[0]  # the rejected sequence follows its chosen one in the same row
            match = [i for i, x in enumerate(rendered[:6]) if x.chosen[0] == tokens[c[0] : j[0]].tolist()]
            assert match, "a packed chosen sequence differs from its rendering"
            rejected = rendered[match[0]].rejected[0]
            assert tokens[j[0] : j[0] + len(rejected)].tolist() == rejected
            assert len(j) in (
                len(rejected),
                len(rejected) - 1,
            )  # its last token is an input unless it ends the row
            found.append(match[0])
    assert sorted(found) == list(range(6))
    with pytest.raises(
        DataError, match=r"none of the 4 pairs is usable \(2 empty_reply, 1 identical, 1 too_long\)"
    ):
        pack_pairs(rendered[6:], seq_len=127, pad_id=0, seed=0)


def test_packing_slots_pair_mask_positions_and_seeded_order(fmt):
    rendered = [render_pair(fmt, p) for p in _pairs(40)]
    packed = pack_pairs(rendered, seq_len=255, pad_id=0, seed=3)
    P = pair_slots(255)
    assert packed.pair_mask.shape == (len(packed), P) == (len(packed), 64)
    assert len(packed) <= 40 / 2  # several pairs per row
    for r in range(len(packed)):
        seg, pos, slots, mask = (
            packed.segment_ids[r],
            packed.positions[r],
            packed.slots[r],
            packed.loss_mask[r],
        )
        held = int(packed.pair_mask[r].sum())
        assert packed.pair_mask[r].tolist() == [1.0] * held + [0.0] * (P - held)
        assert set(seg.tolist()) - {-1} == set(range(2 * held))
        # slots: the segment id where a reply token is the target, -1 elsewhere
        np.testing.assert_array_equal(slots, np.where(mask > 0, seg, -1))
        for s in range(2 * held):
            where = np.flatnonzero(seg == s)
            assert pos[where].tolist() == list(range(len(where)))
            ids = packed.tokens[r, where[0] : where[0] + len(where) + 1]
            # the trained targets are the sequence's final reply: the tokens after its last <|assistant|>
            # (inputs from that header to the one before the reply's <|end|> predict a reply token)
            header = np.flatnonzero(ids == fmt.tok.token_to_id("<|assistant|>"))[-1]
            end = header + 1 + np.flatnonzero(ids[header + 1 :] == fmt.end_id)[0]
            assert mask[where].tolist() == [float(header <= t < end) for t in range(len(where))]
        assert not np.any(mask[seg == -1]) and np.all(slots[seg == -1] == -1)
    again = pack_pairs(rendered, seq_len=255, pad_id=0, seed=3)
    other = pack_pairs(rendered, seq_len=255, pad_id=0, seed=4)
    for key in PREFERENCE_BATCH_KEYS:
        np.testing.assert_array_equal(getattr(packed, key), getattr(again, key))
    assert not np.array_equal(packed.tokens[0], other.tokens[0])
    alone = pack_pairs(rendered, seq_len=255, pad_id=0, seed=3, pack=False)
    assert len(alone) == 40 and np.all(alone.pair_mask.sum(1) == 1) and alone.segment_ids.max() == 1


def test_loader_is_a_pure_function_of_seed_and_step(fmt):
    packed = pack_pairs([render_pair(fmt, p) for p in _pairs(40)], seq_len=63, pad_id=0, seed=0)
    a, b = PairBatchLoader(packed, 4, seed=5), PairBatchLoader(packed, 4, seed=5)
    assert a.row_shapes == {
        "tokens": (64,),
        "loss_mask": (63,),
        "segment_ids": (63,),
        "positions": (63,),
        "slots": (63,),
        "pair_mask": (pair_slots(63),),
    }
    for step in (7, 0, 3, 7):  # any order: no hidden state
        full = a.rows(step)
        assert set(full) == set(PREFERENCE_BATCH_KEYS)
        np.testing.assert_array_equal(full["tokens"], b.rows(step)["tokens"])
        np.testing.assert_array_equal(full["slots"][1:3], b.rows(step, 1, 3)["slots"])
        assert a.row_indices(step, 1, 3) == b.row_indices(step)[1:3]
    steps = [tuple(a.row_indices(s)) for s in range(len(packed) // 4)]
    epoch = sorted(i for s in steps for i in s)
    assert epoch == sorted(set(epoch))  # an epoch visits rows without repeats
    c = PairBatchLoader(packed, 4, seed=6)
    assert [c.row_indices(s) for s in range(3)] != [a.row_indices(s) for s in range(3)]


def test_packed_reply_logps_equal_each_sequence_run_alone(fmt):
    rendered = [render_pair(fmt, p) for p in _pairs(3, seed=1)]
    packed = pack_pairs(rendered, seq_len=255, pad_id=0, seed=None)
    assert len(packed) == 1 and packed.pairs == 3
    cfg = load_config("tiny").model
    params = jax.tree.map(jnp.asarray, noisy_params(cfg, 0, 4, 0.05))
    forward = jax.jit(lambda p, t, **kw: logits_and_stats(p, t, cfg, **kw)[0])
    lg = forward(
        params,
        jnp.asarray(packed.tokens[:, :-1]),
        segment_ids=jnp.asarray(packed.segment_ids),
        positions=jnp.asarray(packed.positions),
    )
    P = pair_slots(255)
    logps, counts = reply_logps(lg, jnp.asarray(packed.tokens[:, 1:]), jnp.asarray(packed.slots), 2 * P)
    # each sequence alone, padded at the end to one shape (causal: padding after it changes nothing)
    sequences = [s for r in rendered for s in (r.chosen, r.rejected)]
    n = len(sequences)
    width = max(len(ids) for ids, _ in sequences)
    batch = np.zeros((len(sequences), width), np.int32)
    for i, (ids, _) in enumerate(sequences):
        batch[i, : len(ids)] = ids
    alone = jax.nn.log_softmax(forward(params, jnp.asarray(batch)), axis=-1)
    expected, expected_counts = [], []
    for i, (ids, mask) in enumerate(sequences):
        t = np.flatnonzero(np.asarray(mask[1:]))  # input positions whose target is a reply token
        expected.append(float(jnp.sum(alone[i, t, np.asarray(ids)[t + 1]])))
        expected_counts.append(len(t))
    np.testing.assert_allclose(np.asarray(logps[0, :n]), expected, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(counts[0]), expected_counts + [0] * (2 * P - n))
    assert np.all(np.asarray(logps[0, n:]) == 0)
    # without the segment ids a later sequence would see the earlier ones: the check can tell
    mixed = forward(params, jnp.asarray(packed.tokens[:, :-1]), positions=jnp.asarray(packed.positions))
    mixed_logps, _ = reply_logps(mixed, jnp.asarray(packed.tokens[:, 1:]), jnp.asarray(packed.slots), 2 * P)
    assert np.max(np.abs(np.asarray(mixed_logps[0, 1:n]) - expected[1:])) > 1e-2
