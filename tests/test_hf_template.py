"""The model's own (Hugging Face) chat template: ids token for token as transformers' apply_chat_template,
the assistant-only loss mask derived from the rendering, the template's errors as one line."""

import json

import pytest
from chat_fixtures import upper_task, write_chats

from shipyard.cli.main import main
from shipyard.data.chat_format import ChatFormat, pick_template
from shipyard.data.hf_template import load_hf_template
from shipyard.data.tokenizer import load_tokenizer
from shipyard.errors import DataError

QWEN2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# Mixtral-Instruct's: an optional system message folded into the first [INST], roles must alternate
MISTRAL = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token }}
    {%- endif %}
{%- endfor %}
"""
# ChatML whose assistant output is marked: the marks are the mask
GENERATION = """{% for message in messages %}
{% if message['role'] == 'assistant' %}
{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] | trim + '<|im_end|>' }}{% endgeneration %}
{{ '\\n' }}
{% else %}
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
{% endif %}
{% endfor %}
{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"""

CASES = {
    # name: (template, special tokens (bos, eos first), where the template goes, end of turn)
    "chatml": (
        QWEN2,
        ("<|endoftext|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        "config",
        "<|im_end|>",
    ),
    "llama3": (
        LLAMA3,
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        "list",
        "<|eot_id|>",
    ),
    "mistral": (MISTRAL, ("<s>", "</s>"), "config", "</s>"),
    "generation": (
        GENERATION,
        ("<|endoftext|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        "file",
        None,
    ),
}

SENTENCES = [
    "You are a helpful assistant. Be brief and kind.",
    "What is the capital of France? Paris is the capital of France.",
    "Tell me a joke about cats, then another one about dogs!",
    "Sure. Here it is: the quick brown fox jumps over the lazy dog.",
    "system user assistant INST /INST",
]


def write_hf_tokenizer(out, template: str, specials: tuple[str, ...], where: str = "config"):
    """A small byte-level BPE trained on SENTENCES, with the template's special tokens, as an HF tokenizer
    directory: the template in tokenizer_config.json (a string, or a list of named ones) or chat_template.jinja."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=True)  # trims whitespace off offsets, like GPT-2's
    unique = tuple(dict.fromkeys(specials))
    trainer = trainers.BpeTrainer(
        vocab_size=256 + len(unique) + 120,
        special_tokens=list(unique),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": specials[0],
        "eos_token": {  # as older transformers saved it
            "__type": "AddedToken",
            "content": specials[1],
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        },
        "clean_up_tokenization_spaces": False,
    }
    if where == "config":
        config["chat_template"] = template
    elif where == "list":
        config["chat_template"] = [
            {"name": "tool_use", "template": "{{ raise_exception('not this one') }}"},
            {"name": "default", "template": template},
        ]
    else:
        (out / "chat_template.jinja").write_text(template)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """name: (directory, shipyard ChatFormat, transformers tokenizer, end-of-turn token)."""
    from transformers import AutoTokenizer

    out = {}
    for name, (template, specials, where, end) in CASES.items():
        path = write_hf_tokenizer(tmp_path_factory.mktemp(name), template, specials, where)
        tok = load_tokenizer(path)
        out[name] = (
            path,
            ChatFormat(tok, pick_template("auto", tok, path)),
            AutoTokenizer.from_pretrained(path),
            end,
        )
    return out


SYSTEM = {"role": "system", "content": "Be brief."}
TURNS = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "Tell me a joke <|im_end|> about <|eot_id|> cats </s> [INST]"},
    {"role": "assistant", "content": " Sure. Here <|im_start|> it is:\nthe fox</s>! "},
]
CONVERSATIONS = {
    "single": TURNS[:2],
    "multi, system": [SYSTEM, *TURNS],
    "multi, no system": TURNS,
    "open": [SYSTEM, *TURNS[:3]],  # ends with the user: the mask is the earlier reply
    "empty reply": [TURNS[0], {"role": "assistant", "content": ""}],
}


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of trained tokens."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _expected_turns(name: str, messages: list[dict], end: str | None) -> list[str]:
    """By hand: the text each assistant turn trains."""
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    if name == "llama3":  # the template trims the content
        return [r.strip() + end for r in replies]
    if name == "mistral":  # the template writes ' ' + content + eos: the model writes the space too
        return [" " + r + end for r in replies]
    if name == "generation":  # exactly the marked block: trimmed content + <|im_end|>
        return [r.strip() + "<|im_end|>" for r in replies]
    return [r + end for r in replies]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_ids_match_transformers_and_mask_is_assistant_content_and_end(
    hf_dirs, name, conversation, generation_prompt
):
    path, fmt, ref, end = hf_dirs[name]
    messages = CONVERSATIONS[conversation]
    assert fmt.template.name == "hf"
    ids, mask = fmt.render(messages, generation_prompt)
    expected = ref.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=generation_prompt, return_dict=False
    )
    assert ids == expected
    assert len(mask) == len(ids)
    decode = fmt.tok.decode
    turns = [decode(ids[a:b], skip_special_tokens=False) for a, b in _runs(mask)]
    assert turns == _expected_turns(name, messages, end)
    # what is not trained is the rest of the conversation, in order
    text = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    assert decode(ids, skip_special_tokens=False) == text
    if generation_prompt:
        assert fmt.prompt(messages) == ids
    if name in ("chatml", "generation"):
        # the newline after each trained <|im_end|> belongs to the next turn
        for _, b in _runs(mask):
            assert decode([ids[b - 1]], skip_special_tokens=False) == "<|im_end|>"
            assert b == len(ids) or decode([ids[b]], skip_special_tokens=False) == "\n"


def test_special_token_strings_in_text_are_parsed_like_transformers(hf_dirs):
    _, fmt, _, _ = hf_dirs["chatml"]
    ids, _ = fmt.render([SYSTEM, *TURNS])
    # the user's "<|im_end|>" is a real token in an HF rendering (as in transformers): 1 system + 4 turns + 1
    assert ids.count(fmt.tok.token_to_id("<|im_end|>")) == 6


def test_generation_blocks_mask_equals_transformers_assistant_mask(hf_dirs):
    _, fmt, ref, _ = hf_dirs["generation"]
    assert fmt.template.has_generation_blocks
    for messages in CONVERSATIONS.values():
        out = ref.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = fmt.render(messages)
        assert ids == out["input_ids"] and mask == out["assistant_masks"]


@pytest.mark.parametrize(
    "name, end_ids",
    [
        ("chatml", ("<|im_end|>", "<|endoftext|>")),
        ("llama3", ("<|eot_id|>", "<|end_of_text|>")),
        ("mistral", ("</s>",)),
        ("generation", ("<|im_end|>", "<|endoftext|>")),
    ],
)
def test_end_of_turn_comes_from_the_template(hf_dirs, name, end_ids):
    _, fmt, _, _ = hf_dirs[name]
    assert fmt.end_ids == tuple(fmt.tok.token_to_id(t) for t in end_ids)
    assert fmt.end_id == fmt.end_ids[0]


def test_template_locations_and_auto(tmp_path, hf_dirs):
    assert str(load_hf_template(hf_dirs["generation"][0]).where).endswith("chat_template.jinja")
    assert "(chat_template 'default')" in load_hf_template(hf_dirs["llama3"][0]).where
    # the file next to tokenizer.json wins over tokenizer_config.json, as in transformers
    path = write_hf_tokenizer(
        tmp_path / "both", QWEN2, ("<|endoftext|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")
    )
    (path / "chat_template.jinja").write_text(GENERATION)
    assert load_hf_template(path / "tokenizer.json").source == GENERATION
    # without a template auto picks the built-in ones as before, and --template overrides auto
    (path / "chat_template.jinja").unlink()
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(path)
    assert pick_template("auto", tok, path).name == "chatml"
    with pytest.raises(DataError, match="hf needs the tokenizer's own chat template"):
        pick_template("hf", tok, path)
    hf_dir = hf_dirs["chatml"][0]
    assert pick_template("chatml", load_tokenizer(hf_dir), hf_dir).name == "chatml"


def _broken(tmp_path, template):
    path = write_hf_tokenizer(
        tmp_path, template, ("<|endoftext|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")
    )
    return path, load_tokenizer(path)


def test_bad_templates_are_one_line_data_errors(tmp_path, hf_dirs):
    path, tok = _broken(tmp_path / "syntax", "{% for m in messages %}{{ m.content }")
    with pytest.raises(DataError) as e:
        pick_template("auto", tok, path)
    assert "tokenizer_config.json (chat_template): does not parse (line 1" in str(e.value)
    assert "\n" not in str(e.value) and e.value.exit_code == 3

    path, tok = _broken(tmp_path / "undefined", "{{ messages[0].content.nope() }}")
    with pytest.raises(DataError, match="rendering failed") as e:
        ChatFormat(tok, pick_template("auto", tok, path)).render(TURNS[:2])
    assert "\n" not in str(e.value)

    _, fmt, _, _ = hf_dirs["mistral"]
    with pytest.raises(DataError) as e:
        fmt.render([TURNS[0], TURNS[0]])
    message = str(e.value)
    assert (
        "raise_exception: Conversation roles must alternate" in message and "tokenizer_config.json" in message
    )
    assert "\n" not in message


def test_train_refuses_a_raising_template_with_one_line(tmp_path, capsys, hf_dirs):
    path, _ = _broken(
        tmp_path / "tok",
        "{% if messages[0]['role'] == 'user' %}{{ raise_exception('Start with\\na system message') }}{% endif %}",
    )
    chats = write_chats(tmp_path / "chats.jsonl", upper_task(0, 4, system=False))
    args = ["train", "tiny", f"run.out_dir={tmp_path}", "run.name=a", "data.seq_len=64"]
    assert (
        main([*args, "train.logging.progress=false", f"data.chat={{train: {chats}, tokenizer: {path}}}"]) == 3
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and "conversation 1" in err[0]
        and "raise_exception: Start with a system message" in err[0]
    )
    assert not (tmp_path / "a").exists()


def test_sft_data_renders_with_the_hf_template_and_the_run_keeps_it(tmp_path, hf_dirs):
    from shipyard.config import load_config
    from shipyard.run.model_dir import chat_format_of
    from shipyard.train.sft_data import copy_tokenizer, load_chat_data

    path, fmt, _, _ = hf_dirs["generation"]  # the template is in chat_template.jinja
    chats = write_chats(tmp_path / "chats.jsonl", upper_task(0, 16))
    cfg = load_config("tiny", ["data.seq_len=64", f"data.chat={{train: {chats}, tokenizer: {path}}}"])
    data = load_chat_data(cfg)
    assert "(hf template)" in data["summary"] and data["inputs"]["chat_template"]["path"].endswith(".jinja")
    first = upper_task(0, 16)[0]["messages"]
    ids, mask = fmt.render(first)
    rows = data["loader"].packed
    assert any(rows.tokens[r, : len(ids)].tolist() == ids for r in range(len(rows)))
    assert rows.loss_mask.sum() == sum(sum(fmt.render(c["messages"])[1][1:]) for c in upper_task(0, 16))
    copy_tokenizer(data["tokenizer"], tmp_path / "run" / "tokenizer")  # what the trainer does
    kept = tmp_path / "run" / "tokenizer"
    assert (kept / "chat_template.jinja").read_text() == GENERATION
    again = chat_format_of(kept)  # what chat, eval and generate use
    assert again.template.name == "hf" and again.end_ids == fmt.end_ids


HELPERS = (
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}{{ m | tojson }}{{ {'é': [1, 2]} | tojson(indent=2) }}"
    "{% if loop.index == 2 %}{% break %}{% endif %}{% endfor %}|{{ ns.n }}|{{ strftime_now('%Y') }}"
    "|{{ dict(x=1).x }}|{{ tools is none }}|{{ documents is none }}|{{ bos_token }}{{ eos_token }}"
    "|{{ add_generation_prompt }}"
)


def test_template_helpers_render_as_in_transformers(tmp_path):
    from transformers import AutoTokenizer

    path = write_hf_tokenizer(tmp_path / "tok", HELPERS, ("<|endoftext|>", "<|im_end|>"))
    template = load_hf_template(path)
    ref = AutoTokenizer.from_pretrained(path)
    messages = [SYSTEM, *TURNS]
    for prompt in (False, True):
        expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        assert template.text(messages, prompt) == expected
    # tojson keeps non-ASCII and indents; continue skipped the system message, break stopped after one
    assert '{\n  "é": [' in expected and expected.count('"role"') == 1 and "|1|" in expected
    # the sandbox holds: no Python internals, no underscore names on a namespace
    for bad in ("{{ ''.__class__.__mro__ }}", "{% set ns = namespace(_x=1) %}"):
        (path / "chat_template.jinja").write_text(bad)
        with pytest.raises(DataError, match="chat_template.jinja: rendering failed"):
            load_hf_template(path).text(messages)
