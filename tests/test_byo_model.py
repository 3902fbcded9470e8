"""Bring your own model: a Hugging Face directory (and its `import hf` output) used directly, with no
training run: generate, eval and export agree with transformers."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hf_fixtures import corpus, write_hf_model

from shipyard.cli.main import main

# Heavy compiles and end-to-end runs: the `make test-slow` tier (docs/testing.md: tiers).
pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def byo(tmp_path_factory):
    """{hf: the HF directory, imported: its `import hf` output, model, tok}."""
    root = tmp_path_factory.mktemp("byo")
    model, tok = write_hf_model(root / "hf")
    assert main(["import", "hf", str(root / "hf"), str(root / "imported")]) == 0
    return {"root": root, "hf": root / "hf", "imported": root / "imported", "model": model, "tok": tok}


PROMPTS = ["the model reads", "parse def return value"]


def _printed_completions(out: str) -> list[str]:
    """What `shipyard generate` printed after each prompt."""
    parts = out.split("--- ")[1:]
    return [p.split("\n", 1)[1].rstrip("\n") for p in parts]


@pytest.mark.parametrize("which", ["hf", "imported"])
def test_generate_equals_transformers_greedy(byo, which, capsys):
    args = ["generate", str(byo[which]), "--max-new-tokens", "20"]
    for p in PROMPTS:
        args += ["--prompt", p]
    assert main(args) == 0
    got = _printed_completions(capsys.readouterr().out)
    tok, model = byo["tok"], byo["model"]
    for prompt, text in zip(PROMPTS, got):
        ids = tok.encode(prompt, add_special_tokens=False).ids
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)[0, len(ids) :]
        new = [t for t in out.tolist() if t != model.generation_config.eos_token_id[0]]
        assert text == prompt + tok.decode(new, skip_special_tokens=False)
        assert len(out) > 3  # the comparison covers real decoding, not an immediate stop


@pytest.mark.parametrize("which", ["hf", "imported"])
def test_eval_loss_equals_transformers_token_nll(byo, which, tmp_path):
    from shipyard.data.loader import SequenceSource

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus(60)))
    shards = tmp_path / "shards"
    assert main(["data", "tokenize", str(docs), "--out", str(shards), "--tokenizer", str(byo["hf"])]) == 0
    report = tmp_path / "eval.json"
    assert main(["eval", str(byo[which]), "--tokens", f"held={shards}", "--out", str(report)]) == 0
    held = json.loads(report.read_text())["domains"]["held"]
    src = SequenceSource(shards, 128, byo["tok"].get_vocab_size())
    seqs = np.stack([src[i] for i in range(held["sequences"])]).astype(np.int64)
    with torch.no_grad():
        logits = byo["model"](torch.from_numpy(seqs[:, :-1])).logits
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), torch.from_numpy(seqs[:, 1:]).reshape(-1)
    )
    assert held["tokens"] == seqs[:, 1:].size
    np.testing.assert_allclose(held["loss"], float(nll), rtol=1e-4)


@pytest.mark.parametrize("which", ["hf", "imported"])
def test_export_gives_identical_tensors_and_nothing_is_written_into_the_source(byo, which, tmp_path):
    from safetensors.numpy import load_file

    before = sorted(p.name for p in byo[which].iterdir())
    out = tmp_path / "out"
    assert main(["export", "hf", str(byo[which]), str(out)]) == 0
    original = load_file(str(byo["hf"] / "model.safetensors"))
    exported = load_file(str(out / "model.safetensors"))
    assert set(exported) == set(original)
    for name, t in original.items():
        assert np.array_equal(exported[name], t), name
    assert (out / "tokenizer.json").read_bytes() == (byo["hf"] / "tokenizer.json").read_bytes()
    assert sorted(p.name for p in byo[which].iterdir()) == before


def test_a_directory_that_is_no_model_says_what_it_lacks(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["generate", str(tmp_path / "empty"), "--prompt", "x"]) == 4
    err = capsys.readouterr().err
    assert err.startswith("error: generate: ") and "neither config.yaml nor config.json" in err


def _hf_chat_reply(byo, messages, max_new_tokens: int) -> str:
    """transformers: apply_chat_template(..., add_generation_prompt=True), greedy, up to <|im_end|>."""
    tok = transformers.AutoTokenizer.from_pretrained(str(byo["hf"]))
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        out = byo["model"].generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
    new = out[0, len(ids) :].tolist()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    return byo["tok"].decode(new[: new.index(end)] if end in new else new, skip_special_tokens=False)


@pytest.mark.parametrize("which", ["hf", "imported"])
def test_chat_in_a_terminal_equals_transformers_on_the_models_own_template(byo, which):
    """The model's template injects a default system prompt; shipyard's reply must be what
    transformers generates on apply_chat_template, first turn and second."""
    import os
    import pty
    import subprocess
    import sys

    from test_finetune import _read_until

    first = [{"role": "user", "content": "the model reads"}]
    want1 = _hf_chat_reply(byo, first, 12)
    second = [*first, {"role": "assistant", "content": want1}, {"role": "user", "content": "upper value"}]
    want2 = _hf_chat_reply(byo, second, 12)
    master, slave = pty.openpty()
    env = dict(os.environ, XLA_FLAGS="", SHIPYARD_NO_REEXEC="1")
    cmd = [sys.executable, "-m", "shipyard.cli", "chat", str(byo[which]), "--temperature", "0"]
    proc = subprocess.Popen(
        [*cmd, "--max-new-tokens", "12"], stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True
    )
    os.close(slave)
    try:
        _read_until(master, b"you> ")
        for text, want in (("the model reads", want1), ("upper value", want2)):
            os.write(master, text.encode() + b"\n")
            reply = _read_until(master, b"you> ").decode()
            streamed = reply.split("assistant> ", 1)[1].rsplit("you> ", 1)[0].replace("\r\n", "\n")
            assert streamed == want + "\n"
        os.write(master, b"\x04")
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)


def test_lora_on_the_hf_directory_then_export_peft(byo, tmp_path):
    """LoRA SFT straight from the HF directory (its tokenizer and template), then a PEFT directory
    that peft loads on the original model with shipyard's logits."""
    peft = pytest.importorskip("peft")
    from chat_fixtures import QUIET, upper_task, write_chats

    from shipyard.model.transformer import logits
    from shipyard.run.model_dir import load_model

    train = write_chats(tmp_path / "train.jsonl", upper_task(0, 64))
    run = tmp_path / "lora"
    args = [
        "train",
        str(byo["hf"]),  # the HF directory is the config: its model, trained from its weights
        f"run.out_dir={tmp_path}",
        "run.name=lora",
        "data.seq_len=96",
        f"data.chat={{train: {train}}}",
        "train.steps=6",
        "train.optimizer.lr=1e-2",
        "train.finetune={lora: {rank: 4, targets: [q, v]}}",
        *QUIET,
    ]
    assert main(args) == 0
    assert (run / "tokenizer" / "tokenizer.json").is_file()
    assert main(["export", "peft", str(run), str(tmp_path / "adapter"), "--base", str(byo["hf"])]) == 0
    base = transformers.AutoModelForCausalLM.from_pretrained(str(byo["hf"]), torch_dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    tokens = np.array([byo["tok"].encode("upper value parse").ids], np.int32)
    cfg, _, params = load_model(run)
    ours = np.asarray(logits(params, tokens, cfg.model))
    with torch.no_grad():
        theirs = adapted(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)
    plain = np.asarray(logits(load_model(byo["hf"]).params, tokens, cfg.model))
    assert np.abs(plain - ours).max() > 1e-4  # the adapters trained: the comparison is not vacuous


def test_sft_with_the_models_chatml_template_trains_bitwise_as_the_builtin_chatml(tmp_path):
    """The tokenizer's own ChatML template (hf) and shipyard's built-in chatml render these
    conversations (each has a system message) identically, so the two SFT runs are the same bytes."""
    from chat_fixtures import QUIET, upper_task, write_chats, write_tokenizer
    from hf_fixtures import CHATML_TEMPLATE

    tok = write_tokenizer(
        tmp_path / "tok",
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    config = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML_TEMPLATE}))
    train = write_chats(tmp_path / "train.jsonl", upper_task(0, 64))
    losses = {}
    for template in ("hf", "chatml"):
        run = tmp_path / template
        chat = f"data.chat={{train: {train}, tokenizer: {tok}, template: {template}}}"
        args = ["train", "tiny", "model.vocab_size=259", "data.seq_len=128", chat, "train.steps=4", *QUIET]
        assert main([*args, "--run-dir", str(run)]) == 0
        losses[template] = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert losses["hf"] == losses["chatml"] and len(losses["hf"]) >= 1


def test_training_an_import_on_a_npy_keeps_its_tokenizer(byo, tmp_path, capsys):
    from chat_fixtures import QUIET

    ids = np.array([t for text in corpus(80) for t in byo["tok"].encode(text + "\n").ids], np.uint16)
    np.save(tmp_path / "ids.npy", ids)
    run = tmp_path / "run"
    base = ["train", str(byo["imported"] / "config.yaml"), f"data.train_tokens={tmp_path / 'ids.npy'}"]
    args = [*base, "data.seq_len=32", "train.steps=1", "train.global_batch_size=8", *QUIET]
    assert main([*args, "--run-dir", str(run)]) == 0
    assert (run / "tokenizer" / "tokenizer.json").read_bytes() == (byo["hf"] / "tokenizer.json").read_bytes()
    assert (run / "tokenizer" / "tokenizer_config.json").is_file()  # with the chat template
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "the model", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("--- 'the model'\nthe model")

    # ids the tokenizer does not have (the model's vocabulary may be padded past it): refused in one line
    from shipyard.config import load_config
    from shipyard.errors import DataError
    from shipyard.train.startup import check_ids_fit

    np.save(tmp_path / "bad.npy", np.append(ids, byo["tok"].get_vocab_size() + 5).astype(np.uint16))
    cfg = load_config(
        "tiny", [f"data.train_tokens={tmp_path / 'bad.npy'}"]
    )  # vocab 512 > the tokenizer's 320
    with pytest.raises(DataError, match=r"holds token id 325, but the model's tokenizer .* has 320 tokens"):
        check_ids_fit(cfg, byo["hf"])
    check_ids_fit(load_config("tiny", [f"data.train_tokens={tmp_path / 'ids.npy'}"]), byo["hf"])


def test_a_byte_level_run_has_no_tokenizer_and_says_how_to_give_one(tmp_path, byte_tokens, capsys):
    from chat_fixtures import QUIET

    run = tmp_path / "bytes"
    args = [
        "train",
        "tiny",
        f"data.train_tokens={byte_tokens}",
        "train.steps=1",
        *QUIET,
        "--run-dir",
        str(run),
    ]
    assert main(args) == 0
    assert not (run / "tokenizer").exists()
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "x"]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no tokenizer" in err and "--tokenizer DIR" in err, err


def test_chat_drops_the_oldest_exchanges_not_tokens_mid_turn(byo):
    from shipyard.inference.chat import ChatModel
    from shipyard.run.model_dir import chat_format_of, open_model_dir

    model_dir = open_model_dir(byo["hf"], "test")
    fmt = chat_format_of(model_dir.tokenizer(), "auto")
    chat = ChatModel(model_dir.config, None, fmt)
    history = []
    for i in range(6):
        history += [
            {"role": "user", "content": f"upper value {i} " * 3},
            {"role": "assistant", "content": "ok"},
        ]
    history.append({"role": "user", "content": "the model reads"})
    context = model_dir.config.model.max_seq_len  # 128
    assert len(fmt.prompt(history)) + 32 > context  # too long as it is
    prompt = chat.fit(history, 32)
    assert len(prompt) <= context - 32
    kept = next(history[i:] for i in range(0, len(history), 2) if fmt.prompt(history[i:]) == prompt)
    assert kept[-1]["content"] == "the model reads" and kept[0]["role"] == "user"  # whole exchanges went
    assert len(fmt.prompt(history[len(history) - len(kept) - 2 :])) > context - 32  # as few as needed
