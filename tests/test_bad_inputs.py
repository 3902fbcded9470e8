"""A corpus of bad inputs, one per row: config values, YAML files, CLI flags, data files, shard
directories and manifests, tokenizers, Hugging Face directories, checkpoints, chat JSONL and pipeline
files. Every row must give exactly one line on stderr naming the problem (no traceback), the exit code
of its kind (shipyard.errors), and leave every file that existed unchanged with nothing new written.

Each row builds its own broken input from a shared, correct `world` (a tokenizer, token shards, a
trained-looking run, an HF directory, chat data), so what breaks is the one thing the row names. The
CLI runs in-process (`shipyard.cli.main.main`), which is what `shipyard` runs after its re-exec."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from shipyard.cli.main import main

CONFIG, DATA, RUNDIR, FS = 2, 3, 4, 1  # exit codes (shipyard.errors, main's OSError branch)


@dataclass(frozen=True)
class World:
    """Correct inputs every row starts from (read-only: rows copy what they break)."""

    root: Path
    docs: Path
    tokenizer: Path
    shards: Path
    run: Path
    hf: Path
    chats: Path


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    from hf_fixtures import corpus, write_bpe, write_hf_model
    from model_fixtures import noisy_params, save_run

    from shipyard.config import load_config
    from shipyard.data.configs import ReadConfig, TokenizeConfig
    from shipyard.data.tokenize import run_tokenize

    root = tmp_path_factory.mktemp("world")
    docs = root / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus(120)))
    tok = write_bpe(root / "tok")
    run_tokenize([str(docs)], root / "shards", tok, TokenizeConfig(), ReadConfig(), workers=1)
    cfg = load_config("tiny", [f"data.train_tokens={root / 'shards'}", "model.vocab_size=320"])
    save_run(root / "run", cfg, noisy_params(cfg.model, key=0, seed=0, scale=0.0))
    shutil.copytree(tok, root / "run" / "tokenizer")
    write_hf_model(root / "hf")
    chats = root / "chats.jsonl"
    turn = {"messages": [{"role": "user", "content": "say a"}, {"role": "assistant", "content": "a"}]}
    chats.write_text(json.dumps(turn) + "\n")
    return World(root, docs, tok, root / "shards", root / "run", root / "hf", chats)


# -- ways to break things -------------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
    return dst


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if offset is None else offset
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def _shard_file(shards: Path) -> Path:
    return shards / json.loads((shards / "manifest.json").read_text())["shards"][0]["file"]


def _edit_json(path: Path, change: Callable[[dict], None]) -> None:
    value = json.loads(path.read_text())
    change(value)
    path.write_text(json.dumps(value))


def _broken_shards(t: Path, w: World, how: str) -> Path:
    shards = _copy(w.shards, t / "shards")
    manifest = shards / "manifest.json"
    if how == "no manifest":
        manifest.unlink()
    elif how == "manifest json":
        _write(manifest, '{"shards": [')
    elif how == "missing shard":
        _shard_file(shards).unlink()
    elif how == "truncated":
        f = _shard_file(shards)
        f.write_bytes(f.read_bytes()[:-100])
    elif how == "manifest field":
        _edit_json(manifest, lambda m: m.pop("shards"))
    return shards


def _broken_hf(t: Path, w: World, how: str) -> Path:
    hf = _copy(w.hf, t / "hf")
    if how == "no config":
        (hf / "config.json").unlink()
    elif how == "config json":
        _write(hf / "config.json", "{not json")
    elif how == "model type":
        _edit_json(
            hf / "config.json", lambda c: c.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
        )
    elif how == "truncated weights":
        f = hf / "model.safetensors"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif how == "no weights":
        (hf / "model.safetensors").unlink()
    elif how == "heads":
        _edit_json(hf / "config.json", lambda c: c.update(num_key_value_heads=3))
    return hf


def _yaml(t: Path, text: str, name: str = "c.yaml") -> str:
    return str(_write(t / name, text))


def _pipeline(t: Path, w: World, steps: str) -> str:
    return _yaml(t, f"root: {t / 'root'}\nsteps:\n{steps}", "p.yaml")


def _chat_cfg(t: Path, w: World, conversations: str) -> list[str]:
    chats = _write(t / "chats.jsonl", conversations)
    return [
        "train",
        "tiny",
        "--run-dir",
        str(t / "out"),
        "data.train_tokens=null",
        f"data.chat.train={chats}",
        f"data.chat.tokenizer={w.tokenizer}",
        "data.chat.template=chatml",
        "model.vocab_size=320",
        "train.steps=2",
    ]


def _pairs_cfg(t: Path, w: World, pairs: str, *overrides: str) -> list[str]:
    """A DPO run on the pairs JSONL `pairs` (text) with the world's tokenizer."""
    return [
        "train",
        "tiny",
        "--run-dir",
        str(t / "out"),
        "data.train_tokens=null",
        f"data.preference.train={_write(t / 'pairs.jsonl', pairs)}",
        f"data.preference.tokenizer={w.tokenizer}",
        "data.preference.template=chatml",
        "train.preference={loss: dpo}",
        "model.vocab_size=320",
        "train.steps=2",
        *overrides,
    ]


_PAIR = '{"prompt": "say a", "chosen": "A", "rejected": "a"}\n'


def _train(t: Path, *overrides: str) -> list[str]:
    return ["train", "tiny", "--run-dir", str(t / "out"), *overrides]


# -- the corpus -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    argv: Callable[[Path, World], list[str]]
    """Builds the broken input under the row's directory and returns the command line."""
    code: int
    says: str
    """A phrase the one line must contain (lower-cased): what is wrong or what is expected."""


C = Case
# One row per line: a table reads better than a reflowed one.
# fmt: off
CASES = [
    # config values and overrides
    C("negative steps", lambda t, w: _train(t, "train.steps=-1"), CONFIG, "train.steps"),
    C("unknown key", lambda t, w: _train(t, "model.hidden_sizee=64"), CONFIG, "hidden_sizee"),
    C("not a number", lambda t, w: _train(t, "train.optimizer.lr=fast"), CONFIG, "train.optimizer.lr"),
    C("unknown preset", lambda t, w: ["train", "nosuchpreset"], CONFIG, "nosuchpreset"),
    C("heads do not divide", lambda t, w: _train(t, "model.num_heads=5"), CONFIG, "num_heads"),
    C("kv heads do not divide", lambda t, w: _train(t, "model.num_kv_heads=3"), CONFIG, "num_kv_heads"),
    C("seq_len past context", lambda t, w: _train(t, "data.seq_len=1024"), CONFIG, "seq_len"),
    C("zero batch", lambda t, w: _train(t, "train.global_batch_size=0"), CONFIG, "global_batch_size"),
    C("unknown schedule", lambda t, w: _train(t, "train.schedule.kind=linear"), CONFIG, "train.schedule.kind: Input should be 'constant', 'cosine' or 'wsd' (got 'linear')"),
    C("override without =", lambda t, w: _train(t, "train.steps"), CONFIG, "train.steps"),
    C("batch over the mesh", lambda t, w: _train(t, f"data.train_tokens={w.shards}", "model.vocab_size=320", "mesh.data=3"), CONFIG, "mesh: axis sizes multiply to 3 but 8 devices are available"),
    C("attention kernel off its backend", lambda t, w: _train(t, f"data.train_tokens={w.shards}", "model.vocab_size=320", "model.attention_impl=splash"), CONFIG, "attention_impl"),
    C("context seq_len", lambda t, w: _train(t, f"data.train_tokens={w.shards}", "model.vocab_size=320", "mesh.context=2", "data.seq_len=30"), CONFIG, "data.seq_len=30"),
    C("context -1", lambda t, w: _train(t, f"data.train_tokens={w.shards}", "model.vocab_size=320", "mesh.context=-1", "mesh.data=1"), CONFIG, "mesh.context=-1"),
    C("pipeline without schedule", lambda t, w: _train(t, f"data.train_tokens={w.shards}", "model.vocab_size=320", "mesh.pipeline=2"), CONFIG, "mesh.pipeline=2 needs train.pipeline.microbatches"),
    C("pipeline layers", lambda t, w: _train(t, f"data.train_tokens={w.shards}", "model.vocab_size=320", "mesh.pipeline=2", "train.pipeline.microbatches=2", "train.pipeline.repeats=2"), CONFIG, "2 layers do not split into mesh.pipeline=2 x repeats=2"),
    C("pipeline microbatches", lambda t, w: _train(t, f"data.train_tokens={w.shards}", "model.vocab_size=320", "mesh.pipeline=2", "train.pipeline.microbatches=3"), CONFIG, "train.pipeline.microbatches=3 does not divide"),
    C("both sources", lambda t, w: _train(t, "data.mixture=[{path: a, weight: 1}]", "data.train_tokens=b"), CONFIG, "mixture"),
    C("no data", lambda t, w: _train(t), CONFIG, "train_tokens"),
    # YAML files
    C("yaml syntax", lambda t, w: ["train", _yaml(t, "model: {hidden_size: 64\n")], CONFIG, "c.yaml: not valid YAML (line 2, column 1)"),
    C("yaml not a mapping", lambda t, w: ["train", _yaml(t, "- a\n- b\n")], CONFIG, "c.yaml: expected a YAML mapping at top level, got list"),
    C("yaml unknown section", lambda t, w: ["train", _yaml(t, "base: tiny\nmodle: {}\n")], CONFIG, "modle"),
    C("yaml missing base", lambda t, w: ["train", _yaml(t, "base: nothere.yaml\n")], CONFIG, "nothere"),
    C("yaml base cycle", lambda t, w: ["train", _yaml(t, f"base: {t / 'c.yaml'}\n")], CONFIG, "c.yaml': `base:` chain loops"),
    C("yaml missing file", lambda t, w: ["train", str(t / "absent.yaml")], CONFIG, "absent.yaml': no such file and no preset of that name"),
    # CLI flags
    C("no command", lambda t, w: [], CONFIG, "the following arguments are required: command"),
    C("unknown command", lambda t, w: ["trian"], CONFIG, "trian"),
    C("no config", lambda t, w: ["train"], CONFIG, "the following arguments are required: config"),
    C("unknown flag", lambda t, w: ["train", "tiny", "--fast"], CONFIG, "--fast"),
    C("no prompt", lambda t, w: ["generate", str(w.run)], CONFIG, "--prompt"),
    C("tokens not int", lambda t, w: ["generate", str(w.run), "--prompt", "a", "--max-new-tokens", "many"], CONFIG, "--max-new-tokens"),
    C("quantize choice", lambda t, w: ["generate", str(w.run), "--prompt", "a", "--quantize", "int4"], CONFIG, "int4"),
    C("profile steps", lambda t, w: _train(t, "--profile-steps", "5"), CONFIG, "--profile-steps: '5'; expected A:B with 0 <= A <= B < train.steps=200"),
    C("eval task kind", lambda t, w: ["eval", str(w.run), "--task", f"nokind:{w.docs}"], DATA, "nokind"),
    C("eval tokens flag", lambda t, w: ["eval", str(w.run), "--tokens", str(w.shards)], CONFIG, "--tokens"),
    C("plan mesh", lambda t, w: ["plan", "tiny", "--mesh", "fsdp=x"], CONFIG, "fsdp"),
    C("serve batch", lambda t, w: ["serve", str(w.run), "--max-batch", "0"], CONFIG, "--max-batch"),
    C("no such step", lambda t, w: ["generate", str(w.run), "--prompt", "a", "--step", "99"], RUNDIR, "has no checkpoint 99 (available: 1)"),
    # data files
    C("missing documents", lambda t, w: ["data", "filter", str(t / "none.jsonl"), "--out", str(t / "o")], DATA, "none.jsonl: no such file or directory"),
    C("malformed documents", lambda t, w: ["data", "filter", str(_write(t / "d.jsonl", "{oops\n[1]\n")), "--out", str(t / "o")], DATA, "2 of 2 records were bad (1 not valid JSON, 1 missing or non-string field 'text')"),
    C("text field", lambda t, w: ["data", "filter", str(w.docs), "--out", str(t / "o"), "--text-field", "body"], DATA, "missing or non-string field 'body'"),
    C("stage setting", lambda t, w: ["data", "dedup", str(w.docs), "--out", str(t / "o"), "--set", "threshold=2"], CONFIG, "threshold"),
    C("extract setting", lambda t, w: ["data", "extract", str(w.docs), "--out", str(t / "o"), "--set", "list_link_fraction=1.5"], CONFIG, "list_link_fraction"),
    C("tiny vocab", lambda t, w: ["data", "tokenizer-train", str(w.docs), "--out", str(t / "o"), "--set", "vocab_size=10"], CONFIG, "vocab_size"),
    C("output exists", lambda t, w: ["data", "filter", str(w.docs), "--out", str(_copy(w.shards, t / "o"))], DATA, "already exists; pass --overwrite or choose another --out"),
    C("input scheme", lambda t, w: ["data", "filter", "htp://bucket/docs.jsonl", "--out", str(t / "o")], DATA, "scheme 'htp'"),
    C("ray address shape", lambda t, w: ["data", "filter", str(w.docs), "--out", str(t / "o"), "--ray", "headnode"], DATA, "expected host:port"),
    C("ray address dead", lambda t, w: ["data", "dedup", str(w.docs), "--out", str(t / "o"), "--ray", _dead_address()], DATA, "no ray cluster answers"),
    C("ray and workers", lambda t, w: ["data", "filter", str(w.docs), "--out", str(t / "o"), "--ray", "local", "--workers", "2"], CONFIG, "not allowed with"),
    C("resumed with other settings", lambda t, w: ["data", "dedup", str(w.docs), "--out", str(_partial_dedup(t, w)), "--set", "threshold=0.7"], DATA, "threshold: 0.8 -> 0.7"),
    C("missing input object", lambda t, w: ["data", "filter", "memory://shipyard-bad/none.jsonl", "--out", str(t / "o")], DATA, "none.jsonl: no such object or prefix"),
    C("unpublished input prefix", lambda t, w: ["data", "dedup", _half_published(), "--out", str(t / "o")], DATA, "not a complete stage output (no _success)"),
    C("no tokenizer", lambda t, w: ["data", "tokenize", str(w.docs), "--tokenizer", str(t), "--out", str(t / "o")], DATA, "no such file (expected a tokenizer.json or a directory holding one)"),
    C("folder of source files", lambda t, w: ["data", "filter", str(_write(t / "code" / "a.py", "x = 1\n").parent), "--out", str(t / "o")], DATA, "no readable document files found (expected files named *.jsonl, *.jsonl.gz"),
    C("missing tokens", lambda t, w: _train(t, f"data.train_tokens={t / 'none'}"), DATA, "none does not exist (expected a 1-D .npy of token ids)"),
    C("float tokens", lambda t, w: _train(t, f"data.train_tokens={_npy(t, np.zeros(4096, np.float32))}"), DATA, "t.npy holds a float32 array of shape (4096,); expected a 1-D integer array of token ids"),
    C("tokens scheme", lambda t, w: _train(t, "data.train_tokens=htp://b/shards", "model.vocab_size=320"), DATA, "data: htp://b/shards has scheme 'htp'"),
    C("ids past vocab", lambda t, w: _train(t, f"data.train_tokens={_npy(t, np.full(4096, 900, np.int32))}"), DATA, "has token id 900 at position 0, outside model.vocab_size=512"),
    C("vocab below tokenizer", lambda t, w: _train(t, f"data.train_tokens={w.shards}", "model.vocab_size=100"), DATA, "tokenized with a vocabulary of 320, larger than model.vocab_size=100"),
    # shard directories and manifests
    C("no manifest", lambda t, w: _train(t, f"data.train_tokens={_broken_shards(t, w, 'no manifest')}"), DATA, "no manifest.json (expected the output of `shipyard data tokenize`)"),
    C("manifest json", lambda t, w: _train(t, f"data.train_tokens={_broken_shards(t, w, 'manifest json')}"), DATA, "manifest.json: not valid JSON"),
    C("manifest field", lambda t, w: _train(t, f"data.train_tokens={_broken_shards(t, w, 'manifest field')}"), DATA, "manifest lacks shards"),
    C("missing shard", lambda t, w: _train(t, f"data.train_tokens={_broken_shards(t, w, 'missing shard')}", "model.vocab_size=320"), DATA, "shard-00000.npy is missing (the manifest lists it)"),
    C("truncated shard", lambda t, w: _train(t, f"data.train_tokens={_broken_shards(t, w, 'truncated')}", "model.vocab_size=320"), DATA, "bytes, expected 4204 for its 2038 tokens (truncated or appended to)"),
    C("verify corrupt", lambda t, w: ["data", "verify", str(_corrupt_shards(t, w))], DATA, "shard-00000.npy is corrupt (sha256"),
    # tokenizer files
    C("tokenizer json", lambda t, w: ["generate", str(w.run), "--prompt", "a", "--tokenizer", str(_bad_tokenizer(t))], DATA, "tokenizer.json: not a valid tokenizer.json"),
    C("tokenizer dir empty", lambda t, w: ["generate", str(w.run), "--prompt", "a", "--tokenizer", str(t)], DATA, "holds no tokenizer.json"),
    C("tokenizer too big", lambda t, w: ["generate", str(w.run), "--prompt", "a", "--tokenizer", str(_big_tokenizer(t))], DATA, "has 321 tokens, more than the model's vocabulary of 320"),
    # Hugging Face directories
    C("hf no config", lambda t, w: ["import", "hf", str(_broken_hf(t, w, "no config")), str(t / "o")], DATA, "hf has no config.json"),
    C("hf config json", lambda t, w: ["import", "hf", str(_broken_hf(t, w, "config json")), str(t / "o")], DATA, "config.json is not valid JSON"),
    C("hf model type", lambda t, w: ["import", "hf", str(_broken_hf(t, w, "model type")), str(t / "o")], DATA, "gpt2"),
    C("hf heads", lambda t, w: ["import", "hf", str(_broken_hf(t, w, "heads")), str(t / "o")], DATA, "num_key_value_heads is 3; expected a divisor of num_attention_heads=4"),
    C("hf truncated weights", lambda t, w: ["import", "hf", str(_broken_hf(t, w, "truncated weights")), str(t / "o")], DATA, "model.safetensors is not a readable safetensors file"),
    C("hf no weights", lambda t, w: ["generate", str(_broken_hf(t, w, "no weights")), "--prompt", "a"], RUNDIR, "hf has neither config.yaml nor config.json + *.safetensors"),
    C("import into existing", lambda t, w: ["import", "hf", str(w.hf), str(_copy(w.shards, t / "o"))], FS, "already exists; choose another output directory"),
    # checkpoints and run directories
    C("not a model dir", lambda t, w: ["export", "hf", str(t), str(t / "o")], RUNDIR, "has neither config.yaml nor config.json + *.safetensors"),
    C("no checkpoints", lambda t, w: ["generate", str(_no_checkpoints(t, w)), "--prompt", "a"], RUNDIR, "has no complete checkpoint (train it, or wait for its first save)"),
    C("resume another model", lambda t, w: ["train", "tiny", "--run-dir", str(_copy(w.run, t / "run")), "--resume", f"data.train_tokens={w.shards}", "model.vocab_size=320", "model.hidden_size=32"], RUNDIR, "hidden_size"),
    C("run dir exists", lambda t, w: ["train", "tiny", "--run-dir", str(_copy(w.run, t / "run")), f"data.train_tokens={w.shards}", "model.vocab_size=320"], RUNDIR, "already holds a run"),
    C("init_from another shape", lambda t, w: _train(t, f"data.train_tokens={w.shards}", "model.vocab_size=320", "model.hidden_size=32", f"train.init_from={w.run}"), CONFIG, "init_from"),
    C("checkpoint flipped", lambda t, w: ["export", "hf", str(_flipped_run(t, w)), str(t / "o")], RUNDIR, "does not match its recorded sha256 (truncated or corrupted); it is the run's only checkpoint"),
    C("checkpoint flipped generate", lambda t, w: ["generate", str(_flipped_run(t, w)), "--prompt", "a"], RUNDIR, "does not match its recorded sha256 (truncated or corrupted); it is the run's only checkpoint"),
    C("init_from vocab size", lambda t, w: _train(t, f"data.train_tokens={w.shards}", "model.vocab_size=400", f"train.init_from={w.run}"), CONFIG, "train.resize_vocab: true"),
    C("init_from other tokenizer", lambda t, w: [*_chat_cfg(t, w, '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n'), f"data.chat.tokenizer={_byte_tokenizer(t)}", "data.chat.template=shipyard", f"train.init_from={w.run}"], CONFIG, "another vocabulary"),
    C("resize_vocab under lora", lambda t, w: _train(t, f"data.train_tokens={w.shards}", "model.vocab_size=400", f"train.init_from={w.run}", "train.resize_vocab=true", "train.finetune={lora: {rank: 4}}"), CONFIG, "train.finetune"),
    C("init_from flipped", lambda t, w: _train(t, f"data.train_tokens={w.shards}", "model.vocab_size=320", f"train.init_from={_flipped_run(t, w)}"), RUNDIR, "does not match its recorded sha256 (truncated or corrupted); it is the run's only checkpoint"),
    C("sidecar unreadable", lambda t, w: ["eval", str(_bad_sidecar(t, w)), "--tokens", f"v={w.shards}"], RUNDIR, "1.sha256.json is unreadable (JSONDecodeError)"),
    C("resume another seed", lambda t, w: ["train", "tiny", "--run-dir", str(_copy(w.run, t / "run")), "--resume", f"data.train_tokens={w.shards}", "model.vocab_size=320", "train.seed=5"], RUNDIR, "train.seed"),
    C("resume another batch", lambda t, w: ["train", "tiny", "--run-dir", str(_copy(w.run, t / "run")), "--resume", f"data.train_tokens={w.shards}", "model.vocab_size=320", "train.global_batch_size=16"], RUNDIR, "global_batch_size"),
    C("shard flipped", lambda t, w: _train(t, f"data.train_tokens={_corrupt_shards(t, w)}", "model.vocab_size=320"), DATA, "shard-00000.npy is corrupt (sha256"),
    # preference pairs and QLoRA
    C("pairs not json", lambda t, w: _pairs_cfg(t, w, "hello\n"), DATA, "pairs.jsonl line 1: not valid JSON"),
    C("pairs no rejected", lambda t, w: _pairs_cfg(t, w, '{"prompt": "say a", "chosen": "A"}\n'), DATA, "line 1: missing 'rejected'"),
    C("pairs all identical", lambda t, w: _pairs_cfg(t, w, '{"prompt": "say a", "chosen": "a", "rejected": "a"}\n'), DATA, "none of the 1 pairs is usable (1 identical)"),
    C("pairs without a loss", lambda t, w: [a for a in _pairs_cfg(t, w, _PAIR) if not a.startswith("train.preference")], CONFIG, "train.preference"),
    C("pairs with document masking", lambda t, w: _pairs_cfg(t, w, _PAIR, "data.document_masking=true"), CONFIG, "document_masking"),
    C("simpo negative gamma", lambda t, w: _pairs_cfg(t, w, _PAIR, "train.preference.loss=simpo", "train.preference.gamma=-1"), CONFIG, "gamma"),
    C("orpo with label smoothing", lambda t, w: _pairs_cfg(t, w, _PAIR, "train.preference.loss=orpo", "train.preference.label_smoothing=0.1"), CONFIG, "label_smoothing: 0.1 does not apply to orpo"),
    C("pairs with offloaded params", lambda t, w: _pairs_cfg(t, w, _PAIR, "train.offload.params=true"), CONFIG, "train.offload.params"),
    C("quantize_base without lora", lambda t, w: _train(t, f"data.train_tokens={w.shards}", "model.vocab_size=320", "train.finetune={train_last_layers: 1, quantize_base: nf4}"), CONFIG, "train.finetune.quantize_base: nf4 quantizes the frozen base for QLoRA; set lora too"),
    C("nf4 block does not divide", lambda t, w: _train(t, f"data.train_tokens={w.shards}", "model.vocab_size=320", "train.finetune={lora: {rank: 4}, quantize_base: nf4, quant_block: 48}"), CONFIG, "quant_block"),
    # chat JSONL
    C("chat role", lambda t, w: _chat_cfg(t, w, '{"messages": [{"role": "bot", "content": "x"}]}\n'), DATA, "has role 'bot'; expected one of system, user, assistant"),
    C("chat not json", lambda t, w: _chat_cfg(t, w, "hello\n"), DATA, "chats.jsonl line 1: not valid JSON"),
    C("chat empty", lambda t, w: _chat_cfg(t, w, ""), DATA, "chats.jsonl holds no conversations"),
    C("chat no assistant", lambda t, w: _chat_cfg(t, w, '{"messages": [{"role": "user", "content": "x"}]}\n'), DATA, "none of the 1 conversations fits in data.seq_len + 1 = 129 tokens with an assistant reply to train on"),
    C("chat missing file", lambda t, w: [*_chat_cfg(t, w, ""), f"data.chat.train={t / 'none.jsonl'}"], DATA, 'none.jsonl does not exist (expected a JSONL file of {"messages": [...]})'),
    # pipeline YAML
    C("pipeline kind", lambda t, w: ["run", _pipeline(t, w, "  - {name: a, kind: nosuch}\n")], CONFIG, "nosuch"),
    C("pipeline reference", lambda t, w: ["run", _pipeline(t, w, "  - {name: a, kind: filter, inputs: {documents: '@nope'}}\n")], CONFIG, "inputs name unknown steps ['nope']"),
    C("pipeline duplicate", lambda t, w: ["run", _pipeline(t, w, "  - {name: a, kind: stdlib}\n  - {name: a, kind: stdlib}\n")], CONFIG, "step names must be unique; repeated: a"),
    C("pipeline cycle", lambda t, w: ["run", _pipeline(t, w, "  - {name: a, kind: filter, inputs: {documents: '@b'}}\n  - {name: b, kind: filter, inputs: {documents: '@a'}}\n")], CONFIG, "the inputs of steps ['a', 'b'] form a cycle"),
    C("pipeline step config", lambda t, w: ["run", _pipeline(t, w, "  - {name: a, kind: filter, inputs: {documents: x}, config: {profil: prose}}\n")], CONFIG, "profil"),
    C("pipeline missing", lambda t, w: ["run", str(t / "none.yaml")], CONFIG, "none.yaml does not exist"),
    C("pipeline input url", lambda t, w: ["run", _pipeline(t, w, "  - {name: a, kind: filter, inputs: {documents: 's3://b/raw'}}\n")], CONFIG, "input documents s3://b/raw is a url"),
    C("pipeline root scheme", lambda t, w: ["run", _pipeline(t, w, "  - {name: a, kind: stdlib}\n"), "--root", "htp://b/x"], DATA, "scheme 'htp'; expected a local path"),
    C("reproduce nothing", lambda t, w: ["reproduce", str(t), "--root", str(t / "again")], DATA, "has no provenance.json (not a finished pipeline step)"),
    C("prepare yaml", lambda t, w: ["data", "prepare", _yaml(t, "inputs: [a.jsonl]\nout: o\nfiltr: {}\n")], CONFIG, "filtr"),
    # serving, export and planning flags
    C("serve port", lambda t, w: ["serve", str(w.run), "--port", "70000"], CONFIG, "--port"),
    C("serve max len", lambda t, w: ["serve", str(w.run), "--max-len", "100000"], CONFIG, "--max-len"),
    C("serve body limit", lambda t, w: ["serve", str(w.run), "--max-body-mb", "0"], CONFIG, "--max-body-mb"),
    C("stablehlo batch", lambda t, w: ["export", "stablehlo", str(w.run), str(t / "o"), "--batch", "0"], CONFIG, "--batch"),
    C("stablehlo platform", lambda t, w: ["export", "stablehlo", str(w.run), str(t / "o"), "--platforms", "gpu9"], CONFIG, "gpu9"),
    C("export into existing", lambda t, w: ["export", "hf", str(w.run), str(_copy(w.shards, t / "o"))], FS, "already exists; choose another output directory"),
    C("plan device", lambda t, w: ["plan", "tiny", "--mesh", "fsdp=1", "--device", "tpu-v9"], CONFIG, "tpu-v9"),
    C("plan mfu", lambda t, w: ["plan", "tiny", "--mesh", "fsdp=1", "--mfu", "2"], CONFIG, "--mfu"),
    C("eval sequences", lambda t, w: ["eval", str(w.run), "--tokens", f"v={w.shards}", "--max-sequences", "0"], CONFIG, "--max-sequences"),
    C("bytes max", lambda t, w: ["data", "bytes", "--out", str(t / "b.npy"), "--max-bytes", "-5"], CONFIG, "--max-bytes"),
    C("bad fraction", lambda t, w: ["data", "filter", str(w.docs), "--out", str(t / "o"), "--max-bad-fraction", "2"], CONFIG, "--max-bad-fraction"),
    C("zero workers", lambda t, w: ["data", "filter", str(w.docs), "--out", str(t / "o"), "--workers", "0"], CONFIG, "--workers"),
    C("shard size", lambda t, w: ["export", "hf", str(w.run), str(t / "o"), "--max-shard-gb", "0"], CONFIG, "--max-shard-gb"),
    C("plan tokens", lambda t, w: ["plan", "tiny", "--mesh", "fsdp=1", "--tokens", "-1"], CONFIG, "--tokens"),
    C("plan layers", lambda t, w: ["plan", "tiny", "--mesh", "fsdp=1", "--compile-layers", "0"], CONFIG, "--compile-layers"),
    C("launch devices", lambda t, w: ["launch", "--processes", "2", "--devices-per-process", "0", "tiny"], CONFIG, "--devices-per-process"),
    C("serve tokens per call", lambda t, w: ["serve", str(w.run), "--tokens-per-call", "0"], CONFIG, "--tokens-per-call"),
    C("eval task file", lambda t, w: ["eval", str(w.run), "--task", f"mc:{_write(t / 'mc.jsonl', '{oops')}"], DATA, "mc.jsonl:1: not valid JSON"),
    C("run url unpublished", lambda t, w: ["generate", "memory://shipyard-none/runs/x", "--prompt", "a"], RUNDIR, "holds no published run"),
    # shipyard rl: settings, reward functions, prompt files
    C("rl group of one", lambda t, w: ["rl", str(w.run), str(t / "o"), "group_size=1"], CONFIG, "group_size"),
    C("rl unknown setting", lambda t, w: ["rl", str(w.run), str(t / "o"), "groupsize=4"], CONFIG, "groupsize"),
    C("rl greedy rollouts", lambda t, w: ["rl", str(w.run), str(t / "o"), "temperature=0"], CONFIG, "temperature"),
    C("rl task and prompts", lambda t, w: ["rl", str(w.run), str(t / "o"), f"prompts={_write(t / 'p.jsonl', '{}')}"], CONFIG, "not both or neither"),
    C("rl prompts without reward", lambda t, w: ["rl", str(w.run), str(t / "o"), "task=null", f"prompts={_write(t / 'p.jsonl', '{}')}"], CONFIG, "reward: a prompts file needs a reward function"),
    C("rl reward does not import", lambda t, w: _rl(t, w, "def f(:\n"), CONFIG, "r.py failed: SyntaxError"),
    C("rl reward signature", lambda t, w: _rl(t, w, "def f(prompt):\n    return 0\n"), CONFIG, "must take (prompt, completion, metadata)"),
    C("rl reward missing", lambda t, w: _rl(t, w, "def g(prompt, completion, metadata):\n    return 0\n"), CONFIG, "has no function 'f'"),
    C("rl reward file absent", lambda t, w: _rl(t, w, None), CONFIG, "does not exist"),
    C("rl prompt line", lambda t, w: _rl(t, w, "def f(p, c, m):\n    return 0\n", '{"prompt": "a"}\n{oops\n'), DATA, "p.jsonl line 2: not valid JSON"),
    C("rl prompt field", lambda t, w: _rl(t, w, "def f(p, c, m):\n    return 0\n", '{"text": "a"}\n'), DATA, "needs 'prompt'"),
    C("rl into existing", lambda t, w: ["rl", str(w.run), str(_copy(w.shards, t / "o"))], FS, "already exists"),
    C("rl bad mesh axis", lambda t, w: ["rl", str(w.run), str(t / "o"), "mesh={tensor: 2}"], CONFIG, "data and fsdp only"),
    C("rl rows off the mesh", lambda t, w: ["rl", str(w.run), str(t / "o"), "mesh={data: 8}", "prompts_per_step=3", "group_size=2"], CONFIG, "do not split over"),
    C("rl reward timeout", lambda t, w: ["rl", str(w.run), str(t / "o"), "reward_timeout=0"], CONFIG, "reward_timeout"),
    # shipyard browse: roots, static outputs, flags
    C("browse root absent", lambda t, w: ["browse", str(t / "none"), "--static", str(t / "s")], DATA, "is not a directory"),
    C("browse root of nothing", lambda t, w: ["browse", str(_write(t / "r" / "a.txt", "a").parent), "--static", str(t / "s")], DATA, "holds no pipeline steps"),
    C("browse bad provenance", lambda t, w: ["browse", str(_browse_root(t, "{oops")), "--static", str(t / "s")], DATA, "not valid JSON"),
    C("browse static exists", lambda t, w: ["browse", str(_browse_root(t)), "--static", str(_write(t / "s" / "x", "").parent)], DATA, "already exists"),
    C("browse static in root", lambda t, w: ["browse", str(_browse_root(t)), "--static", str(t / "r" / "site")], DATA, "inside ROOT"),
    C("browse empty bucket root", lambda t, w: ["browse", "memory://shipyard-none/qs", "--static", str(t / "s")], DATA, "memory://shipyard-none/qs cannot be listed (listing memory://shipyard-none/qs: not found); expected a pipeline root"),
    C("browse bad port", lambda t, w: ["browse", str(_browse_root(t)), "--port", "0"], CONFIG, "--port"),
]


def _browse_root(t: Path, provenance: str = '{"step": {"name": "a", "kind": "filter"}}') -> Path:
    """A pipeline root of one step directory holding `provenance` as its provenance.json."""
    return _write(t / "r" / "a-0123" / "provenance.json", provenance).parent.parent


def _rl(t: Path, w: World, reward: str | None, prompts: str = '{"prompt": "a"}\n') -> list[str]:
    """`shipyard rl` on a prompt file with the reward function `reward` (None: its file is absent)."""
    if reward is not None:
        _write(t / "r.py", reward)
    return ["rl", str(w.run), str(t / "o"), "task=null", f"prompts={_write(t / 'p.jsonl', prompts)}", f"reward={t / 'r.py'}:f"]
# fmt: on


def _half_published() -> str:
    """A stage output prefix whose publication was cut off: its tag and a part, no marker (memory://)."""
    from shipyard import storage

    url = "memory://shipyard-bad/half"
    storage.write_bytes(f"{url}/_SHIPYARD_STAGE", b"{}")
    storage.write_bytes(f"{url}/part-00000.jsonl", b'{"text": "a"}\n')
    return url


def _npy(t: Path, array: np.ndarray) -> Path:
    np.save(t / "t.npy", array)
    return t / "t.npy"


def _corrupt_shards(t: Path, w: World) -> Path:
    shards = _copy(w.shards, t / "shards")
    _flip_byte(_shard_file(shards))
    return shards


def _bad_tokenizer(t: Path) -> Path:
    (t / "tok").mkdir()
    _write(t / "tok" / "tokenizer.json", '{"model": ')
    return t / "tok"


def _big_tokenizer(t: Path) -> Path:
    from hf_fixtures import write_bpe

    return write_bpe(t / "tok", vocab_size=700)  # more ids than the run's 320-entry vocabulary


def _byte_tokenizer(t: Path) -> Path:
    from chat_fixtures import write_tokenizer

    return write_tokenizer(t / "bytes")  # 263 tokens, ids other than the run's BPE gives the same strings


def _flipped_run(t: Path, w: World) -> Path:
    run = _copy(w.run, t / "run")
    biggest = max(
        (p for p in (run / "checkpoints").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
    )
    _flip_byte(biggest)
    return run


def _bad_sidecar(t: Path, w: World) -> Path:
    run = _copy(w.run, t / "run")
    _write(run / "checkpoints" / "1.sha256.json", '{"default/": ')
    return run


def _no_checkpoints(t: Path, w: World) -> Path:
    run = _copy(w.run, t / "run")
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").mkdir()
    return run


def _dead_address() -> str:
    from shipyard.parallel.launch import free_port

    return f"127.0.0.1:{free_port()}"


def _partial_dedup(t: Path, w: World) -> Path:
    """An output a dedup with the default settings was building when it was cut off."""
    from shipyard.data.configs import DedupConfig, ReadConfig
    from shipyard.data.resume import header, open_partial
    from shipyard.data.stage import config_record, plan

    out = t / "o"
    config = config_record(ReadConfig(), dedup=DedupConfig())
    open_partial(out, header("dedup", [str(w.docs)], config, plan([str(w.docs)])), False, "data dedup")
    return out


def _snapshot(*roots: Path) -> dict[str, str]:
    """Every file under `roots` with its sha256, and every directory (so a new empty one shows); the
    user's cache directory (fetched copies of bucket data) and the in-memory store (memory:// URLs)
    too. Left out there: JAX's compilation cache, and the sha256 verdicts of files a command read
    before it failed (facts about files that did not change, which the next command reuses)."""
    import fsspec

    seen = {}
    cache = Path(os.environ["XDG_CACHE_HOME"])
    for root in (*roots, cache):
        for p in sorted(root.rglob("*")):
            if root == cache and _not_an_output(p.relative_to(cache).parts):
                continue
            seen[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    store = fsspec.filesystem("memory").store
    seen.update({f"memory://{k}": hashlib.sha256(bytes(v.getbuffer())).hexdigest() for k, v in store.items()})
    return seen


def _not_an_output(parts: tuple[str, ...]) -> bool:
    """Cache entries `_snapshot` leaves out: JAX's compilation cache, the hash verdicts, and the
    directory holding those."""
    return parts[:1] == ("xla",) or parts[:2] == ("shipyard", "sha256") or parts == ("shipyard",)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_gives_one_line_and_changes_nothing(case, world, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a command that writes a relative default would write here
    argv = case.argv(tmp_path, world)
    capsys.readouterr()
    before = _snapshot(world.root, tmp_path)
    code = main(argv)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == case.code, f"exit {code}, expected {case.code}; stderr: {err!r}"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"not one line: {err!r}"
    assert "Traceback" not in err + out
    assert case.says.lower() in lines[0].lower(), f"{lines[0]!r} does not name {case.says!r}"
    assert _snapshot(world.root, tmp_path) == before, "a file changed or a partial output was left"


def test_the_corpus_covers_every_kind_of_input():
    assert len(CASES) >= 128 and len({c.id for c in CASES}) == len(CASES)  # README: 128
