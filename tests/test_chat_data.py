"""Chat SFT data: templates rendered token by token, the assistant-only loss mask, packing, bad input."""

import numpy as np
import pytest
from chat_fixtures import upper_task, write_chats, write_tokenizer

from shipyard.cli.main import main
from shipyard.data.chat_format import ChatFormat, pack, pick_template, read_conversations
from shipyard.data.tokenizer import load_tokenizer
from shipyard.errors import DataError

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hi <|assistant|>"},
    {"role": "assistant", "content": "HI"},
    {"role": "user", "content": "again"},
    {"role": "assistant", "content": "AGAIN"},
]


@pytest.fixture(scope="module")
def shipyard_tok(tmp_path_factory):
    return load_tokenizer(write_tokenizer(tmp_path_factory.mktemp("tok")))


def _bytes(tok, text):
    return tok.encode(text, add_special_tokens=False).ids


def test_shipyard_template_and_assistant_mask_token_by_token(shipyard_tok):
    tok = shipyard_tok
    fmt = ChatFormat(tok, pick_template("auto", tok))
    assert fmt.template.name == "shipyard"
    sid = tok.token_to_id
    ids, mask = fmt.render(CONVERSATION)
    expected, expected_mask = [sid("<|bos|>")], [0]
    for m in CONVERSATION:
        trained = int(m["role"] == "assistant")
        content = _bytes(tok, m["content"])
        expected += [sid(f"<|{m['role']}|>"), *content, sid("<|end|>")]
        expected_mask += [0, *[trained] * len(content), trained]
    assert ids == expected and mask == expected_mask
    # each byte of the content is its own token, so the text is what it looks like
    assert len(_bytes(tok, "hi <|assistant|>")) == len("hi <|assistant|>")
    # text that looks like a role marker stays text: exactly three assistant headers are the real ones
    assert ids.count(sid("<|assistant|>")) == 2
    prompt = fmt.prompt(CONVERSATION[:2])
    assert prompt[-1] == sid("<|assistant|>") and prompt[:-1] == expected[: len(prompt) - 1]
    assert sum(mask) == len("HI") + len("AGAIN") + 2


@pytest.mark.parametrize(
    "name, specials, header, end",
    [
        (
            "chatml",
            ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
            ["<|im_start|>", "assistant\n"],
            "<|im_end|>",
        ),
        (
            "llama3",
            (
                "<|begin_of_text|>",
                "<|end_of_text|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
            ),
            ["<|start_header_id|>", "assistant", "<|end_header_id|>", "\n\n"],
            "<|eot_id|>",
        ),
    ],
)
def test_chatml_and_llama3_templates_are_picked_and_masked(tmp_path, name, specials, header, end):
    bos = specials[0]
    eos = "<|endoftext|>" if name == "chatml" else "<|end_of_text|>"
    tok = load_tokenizer(write_tokenizer(tmp_path, specials, bos_token=bos, eos_token=eos, pad_token=None))
    fmt = ChatFormat(tok, pick_template("auto", tok))
    assert fmt.template.name == name
    ids, mask = fmt.render(CONVERSATION[1:3])
    text = tok.decode(ids, skip_special_tokens=False)
    assert header[0] + "".join(header[1:]) in text
    trained = tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert trained == "HI" + end
    with pytest.raises(DataError, match="shipyard needs the special tokens"):
        pick_template("shipyard", tok)


def _rendered(fmt, conversations):
    return [fmt.render(c["messages"]) for c in conversations]


def test_packing_keeps_conversations_apart_and_aligns_the_mask(shipyard_tok):
    tok = shipyard_tok
    fmt = ChatFormat(tok, pick_template("auto", tok))
    rendered = _rendered(fmt, upper_task(0, 40))
    long = fmt.render([{"role": "user", "content": "x" * 300}, {"role": "assistant", "content": "y"}])
    no_reply = fmt.render([{"role": "user", "content": "hello"}])
    packed = pack(rendered + [long, no_reply], seq_len=127, pad_id=2, seed=0)
    assert packed.conversations == 40 and packed.dropped == 2
    assert len(packed) <= 40 / 3  # several conversations per row
    seen = []
    for r in range(len(packed)):
        tokens, seg, pos, mask = (
            packed.tokens[r],
            packed.segment_ids[r],
            packed.positions[r],
            packed.loss_mask[r],
        )
        for s in sorted(set(seg.tolist()) - {-1}):
            where = np.flatnonzero(seg == s)
            a = where[0]
            # a conversation's last token is an input unless it ends the row (then only a target)
            match = [
                i
                for i, (ids, _) in enumerate(rendered)
                if tokens[a : a + len(ids)].tolist() == ids and len(where) in (len(ids), len(ids) - 1)
            ]
            assert match, "a packed conversation differs from its rendering"
            ids, trained = rendered[match[0]]
            seen.append(match[0])
            assert pos[where].tolist() == list(range(len(where)))  # positions restart at 0
            # loss on input t <=> target t+1 is an assistant token of the same conversation
            # (the conversation's last input would predict the next one's first token: no loss)
            expected = [float(m) for m in trained[1:]] + [0.0] * (len(where) - len(ids) + 1)
            assert mask[where].tolist() == expected
        # no loss across a boundary or on padding
        assert not np.any(mask[seg == -1])
    assert sorted(seen) == list(range(40))
    alone = pack(rendered, seq_len=127, pad_id=2, seed=0, pack=False)
    assert len(alone) == 40 and np.all(alone.segment_ids <= 0)


def test_bad_chat_files_get_one_clear_line(tmp_path):
    cases = {
        "bad json": ('{"messages": [', "line 1: not valid JSON"),
        "no messages": ('{"text": "hi"}', "line 1: expected an object with a 'messages' list"),
        "role": (
            '{"messages": [{"role": "bot", "content": "x"}]}',
            "role 'bot'; expected one of system, user",
        ),
        "content": ('{"messages": [{"role": "user", "content": 3}]}', "content must be a string"),
        "empty": ('{"messages": []}', "'messages' must be a non-empty list"),
    }
    for name, (line, needle) in cases.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text('{"messages": [{"role": "user", "content": "ok"}]}\n' * 0 + line + "\n")
        with pytest.raises(DataError, match=needle.replace("(", r"\(")):
            read_conversations(path)
    with pytest.raises(DataError, match="does not exist"):
        read_conversations(tmp_path / "missing.jsonl")


def test_train_refuses_bad_chat_input_with_one_line(tmp_path, capsys):
    tok = write_tokenizer(tmp_path / "tok")
    good = write_chats(tmp_path / "good.jsonl", upper_task(0, 8))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(good.read_text() + '{"messages": [{"role": "robot", "content": "x"}]}\n')
    base = ["train", "tiny", f"run.out_dir={tmp_path}", "data.seq_len=64", "train.logging.progress=false"]
    assert main([*base, "run.name=a", f"data.chat={{train: {bad}, tokenizer: {tok}}}"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "line 9" in err[0] and "robot" in err[0]
    assert not (tmp_path / "a").exists()  # nothing half-written
    # chat data and token shards together are refused by the config
    assert main([*base, "run.name=b", "data.train_tokens=x.npy", f"data.chat={{train: {good}}}"]) == 2
    assert "data.train_tokens: null" in capsys.readouterr().err
    # a tokenizer without chat tokens
    plain = write_tokenizer(
        tmp_path / "plain", ("<|eos|>",), bos_token="<|eos|>", eos_token="<|eos|>", pad_token=None
    )
    assert main([*base, "run.name=c", f"data.chat={{train: {good}, tokenizer: {plain}}}"]) != 0
    assert "no chat template" in capsys.readouterr().err
