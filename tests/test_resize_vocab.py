"""Domain tokenizer swap (train.resize_vocab): a base trained with tokenizer A is fine-tuned on data
tokenized with tokenizer B (another BPE, trained by shipyard's own trainer on other text, sharing the
byte and special tokens and some merges).

The embedding and the untied head are resized to the run's model.vocab_size: rows of tokens whose
strings both tokenizers hold are copied bitwise, the others start at the mean of the base's token
rows; without the flag the mismatch is one line and nothing is written. The expected rows are worked
out here from the two tokenizer.json vocabularies directly, not with shipyard's plan.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from data_fixtures import prose
from hf_fixtures import corpus

from shipyard.cli.main import main
from shipyard.config import load_config
from shipyard.run.model_dir import load_model

# Heavy compiles and end-to-end runs: the `make test-slow` tier (docs/testing.md: tiers).
pytestmark = pytest.mark.slow

QUIET = ["train.logging.progress=false", "train.logging.tensorboard=false", "train.logging.log_every=1"]
PADDING = 4  # the resized model's vocabulary is B's size plus this many padding rows
BASE_PADDING = 8  # the base's padding rows past A's tokens: the mean leaves them out


def _tokenizer(root: Path, name: str, texts: list[str], vocab_size: int) -> Path:
    from shipyard.data.configs import ReadConfig, TokenizerTrainConfig
    from shipyard.data.tokenizer import run_tokenizer_train

    docs = root / f"{name}.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = TokenizerTrainConfig(vocab_size=vocab_size, min_frequency=1)
    run_tokenizer_train([str(docs)], root / f"tok-{name}", cfg, ReadConfig())
    return root / f"tok-{name}"


def _shards(root: Path, name: str, tok: Path) -> Path:
    from shipyard.data.configs import ReadConfig, TokenizeConfig
    from shipyard.data.tokenize import run_tokenize

    run_tokenize(
        [str(root / f"{name}.jsonl")], root / f"shards-{name}", tok, TokenizeConfig(), ReadConfig(), 1
    )
    return root / f"shards-{name}"


def _vocab(tok: Path) -> dict[str, int]:
    return json.loads((tok / "tokenizer.json").read_text())["model"]["vocab"] | {
        t["content"]: t["id"] for t in json.loads((tok / "tokenizer.json").read_text())["added_tokens"]
    }


def _train_args(run_dir: Path, shards: Path, vocab: int, *extra: str) -> list[str]:
    return [
        "train",
        "tiny",
        "--run-dir",
        str(run_dir),
        f"data.train_tokens={shards}",
        f"model.vocab_size={vocab}",
        "model.tie_embeddings=false",
        *QUIET,
        *extra,
    ]


@pytest.fixture(scope="module")
def swap(tmp_path_factory):
    """Tokenizers A (code-like text) and B (prose), their shards, a 20-step base on A (with padding
    rows) and a 12-step resized run on B (checkpoints 6 and 12)."""
    root = tmp_path_factory.mktemp("resize")
    tok_a = _tokenizer(root, "a", corpus(300), 300)
    tok_b = _tokenizer(root, "b", [prose(i, 120) for i in range(120)] + corpus(40), 340)
    shards_a, shards_b = _shards(root, "a", tok_a), _shards(root, "b", tok_b)
    size_a = len(_vocab(tok_a))
    size_b = len(_vocab(tok_b)) + PADDING
    base = root / "base"
    base_args = _train_args(
        base, shards_a, size_a + BASE_PADDING, "train.steps=20", "train.checkpoint.every=20"
    )
    assert main(base_args) == 0
    resized_args = [
        f"train.init_from={base}",
        "train.resize_vocab=true",
        "train.steps=12",
        "train.checkpoint.every=6",
        "train.schedule.warmup_steps=2",
    ]
    run = root / "resized"
    assert main(_train_args(run, shards_b, size_b, *resized_args)) == 0
    return {
        "root": root,
        "tok_a": tok_a,
        "tok_b": tok_b,
        "shards_b": shards_b,
        "size_a": size_a,
        "size_b": size_b,
        "base": base,
        "run": run,
        "args": _train_args(run, shards_b, size_b, *resized_args),
    }


def _expected_rows(swap) -> tuple[dict[int, int], list[int]]:
    """{new id: base id} of the tokens both vocabularies hold, and the base's token ids (the mean's rows)."""
    a, b = _vocab(swap["tok_a"]), _vocab(swap["tok_b"])
    return {i: a[t] for t, i in b.items() if t in a}, sorted(a.values())


def test_shared_rows_are_copied_bitwise_and_new_rows_start_at_the_mean(swap):
    from shipyard.train.program import build_program
    from shipyard.train.trainer import initial_state

    cfg = load_config(str(swap["run"] / "config.yaml"))
    program = build_program(cfg)
    lines = []
    # the step-0 state exactly as the trainer builds it (main=False: nothing is written)
    _, state, _ = initial_state(program, swap["run"], False, False, lines.append)
    new = jax.tree.map(np.asarray, state.params)
    old = load_model(swap["base"]).params
    copied, token_rows = _expected_rows(swap)
    assert 200 < len(copied) < len(_vocab(swap["tok_b"]))  # the two vocabularies overlap, not fully
    mean_embed = old.embed[token_rows].mean(axis=0)
    mean_head = old.lm_head[:, token_rows].mean(axis=1)
    assert new.embed.shape == (swap["size_b"], 64) and new.lm_head.shape == (64, swap["size_b"])
    for i in range(swap["size_b"]):
        if i in copied:
            assert np.array_equal(new.embed[i], old.embed[copied[i]]), f"row {i}"
            assert np.array_equal(new.lm_head[:, i], old.lm_head[:, copied[i]]), f"head column {i}"
        else:  # a token A lacks, or one of the padding rows
            np.testing.assert_allclose(new.embed[i], mean_embed, rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(new.lm_head[:, i], mean_head, rtol=1e-6, atol=1e-7)
    # every other weight is the base's, bitwise
    for name in ("final_norm", "blocks"):
        for x, y in zip(jax.tree.leaves(getattr(new, name)), jax.tree.leaves(getattr(old, name))):
            assert np.array_equal(x, y)
    fresh = swap["size_b"] - len(copied)
    sizes = f"{swap['size_a'] + BASE_PADDING} -> {swap['size_b']}"
    expected = f"resized the vocabulary {sizes}: {len(copied)} rows copied, {fresh} new"
    assert any(expected in line for line in lines), lines


def test_the_run_header_records_the_resize_and_the_loss_on_b_falls(swap):
    prov = json.loads((swap["run"] / "provenance.json").read_text())["vocab_resize"]
    copied, _ = _expected_rows(swap)
    assert prov["rows_copied"] == len(copied) and prov["padding_rows"] == PADDING
    assert prov["rows_new"] == swap["size_b"] - len(copied)
    assert (
        prov["from_vocab_size"] == swap["size_a"] + BASE_PADDING and prov["to_vocab_size"] == swap["size_b"]
    )
    assert Path(prov["to_tokenizer"]["path"]) == swap["shards_b"]
    losses = [json.loads(x)["loss"] for x in (swap["run"] / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 12 and np.isfinite(losses).all()
    assert np.mean(losses[-3:]) < losses[0] - 0.3, losses
    # the run speaks B: its tokenizer/ is B's
    assert (swap["run"] / "tokenizer" / "tokenizer.json").read_bytes() == (
        swap["tok_b"] / "tokenizer.json"
    ).read_bytes()


def test_without_the_flag_one_line_and_no_run_directory(swap, tmp_path, capsys):
    args = [a for a in swap["args"] if a != "train.resize_vocab=true"]
    args[args.index("--run-dir") + 1] = str(tmp_path / "refused")
    capsys.readouterr()
    assert main(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "train.resize_vocab: true" in err[0], err
    assert f"{swap['size_a'] + BASE_PADDING}" in err[0] and f"{swap['size_b']}" in err[0]
    assert not (tmp_path / "refused").exists()


def test_resume_of_a_resized_run_is_bitwise(swap, tmp_path):
    run, copy = swap["run"], tmp_path / "resized"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "checkpoints" / "12")  # as if killed between checkpoints 6 and 12
    args = list(swap["args"])
    args[args.index("--run-dir") + 1] = str(copy)
    assert main([*args, "--resume"]) == 0
    losses = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    again = [json.loads(x)["loss"] for x in (copy / "metrics.jsonl").read_text().splitlines()]
    assert losses == again
    assert json.loads((copy / "provenance.json").read_text())["vocab_resize"]["rows_new"] > PADDING
    a, b = load_model(run).params, load_model(copy).params
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_export_hf_of_the_resized_run_loads_in_transformers(swap, tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shipyard.model.transformer import logits

    out = tmp_path / "hf"
    assert main(["export", "hf", str(swap["run"]), str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.vocab_size == swap["size_b"] and len(tokenizer) == swap["size_b"] - PADDING
    ids = tokenizer(prose(999, 30))["input_ids"][:64]
    assert max(ids) >= swap["size_a"]  # the text uses ids past A's vocabulary
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].numpy()
    weights = load_model(swap["run"])
    ours = np.asarray(logits(weights.params, np.asarray([ids]), weights.config.model))[0]
    np.testing.assert_allclose(theirs, ours, atol=2e-4)


def test_on_a_tensor_mesh_the_resize_is_the_one_device_one(swap):
    """tensor=8 shards the run's vocabulary (344 rows) but not the base's (308): the base is read
    with that axis dropped (`fitted`) and the resized tables land on the run's shardings. Copied
    rows and every other weight are bitwise the one-device ones; the mean rows agree to rounding
    (the partitioned mean may add in another order)."""
    from shipyard.model.params import param_shardings
    from shipyard.model.transformer import param_specs
    from shipyard.train.program import build_program
    from shipyard.train.startup import base_params

    cfg = load_config(str(swap["run"] / "config.yaml"), ["mesh.data=1", "mesh.tensor=8"])
    program = build_program(cfg)
    specs = param_specs(cfg.model)
    shardings = param_shardings(specs, program.mesh, program.rules)
    assert shardings.embed.spec[0] == "tensor" and (swap["size_a"] + BASE_PADDING) % 8
    sharded = base_params(cfg, specs, shardings)
    assert sharded.embed.sharding == shardings.embed and sharded.lm_head.sharding == shardings.lm_head
    plain = base_params(cfg, specs, None)
    copied = np.asarray(sorted(_expected_rows(swap)[0]))
    for name in ("embed", "lm_head"):
        x, y = np.asarray(getattr(sharded, name)), np.asarray(getattr(plain, name))
        axis = 0 if name == "embed" else 1
        assert np.array_equal(x.take(copied, axis), y.take(copied, axis))
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-9)
    for x, y in zip(jax.tree.leaves(sharded.blocks), jax.tree.leaves(plain.blocks)):
        assert np.array_equal(np.asarray(x), np.asarray(y))


def test_a_tied_model_of_the_same_size_remaps_its_embedding(swap):
    """Same vocabulary size, other tokenizer: rows move to the ids B gives the same strings; a tied
    model has no head to resize."""
    from model_fixtures import noisy_params

    from shipyard.train.resize_vocab import plan_resize, resize_params

    size = swap["size_b"]
    cfg = load_config("tiny", [f"model.vocab_size={size}", "model.tie_embeddings=true"]).model
    params = jax.tree.map(jax.numpy.asarray, noisy_params(cfg, 0, 5, 0.05))
    assert params.lm_head is None
    plan = plan_resize(swap["tok_a"], swap["tok_b"], size, size)
    resized = np.asarray(resize_params(params, plan).embed)
    copied, token_rows = _expected_rows(swap)
    old = np.asarray(params.embed)
    assert any(i != j for i, j in copied.items())  # some shared tokens have other ids in B
    for i in range(size):
        if i in copied:
            assert np.array_equal(resized[i], old[copied[i]])
        else:
            np.testing.assert_allclose(resized[i], old[token_rows].mean(axis=0), rtol=1e-6, atol=1e-7)
