"""`shipyard export stablehlo` and the artifact runner: the same tokens as the generation engine, in a process
that never imports the model code; versions checked, outputs never half written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from engine_fixtures import complete, generate
from hf_fixtures import write_bpe
from model_fixtures import noisy_params

from shipyard.cli.main import main
from shipyard.config import load_config
from shipyard.errors import ConfigError, RunDirError
from shipyard.inference.artifact import Artifact, is_artifact
from shipyard.inference.engine import Engine
from shipyard.inference.export import portable_config
from shipyard.interop.hf import write_hf_dir
from shipyard.run.model_dir import open_model_dir

# Heavy compiles and end-to-end runs: the `make test-slow` tier (docs/testing.md: tiers).
pytestmark = pytest.mark.slow

BATCH = 2
# token ids of different lengths, more prompts than the artifact's batch (three calls, the last one short)
PROMPTS = [[5, 17, 99, 3], [42], [7, 8, 9, 10, 11, 12, 13], [250, 1, 64], [300, 301]]
TEXTS = ["the model reads", "def", "a token and writes the next one", "upper lower"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """{hf: a small random Hugging Face directory with a BPE tokenizer, art: its artifact, params, cfg,
    gen: an engine over the same params, greedy: its 12 greedy tokens for PROMPTS}."""
    root = tmp_path_factory.mktemp("stablehlo")
    cfg = load_config("tiny", ["model.vocab_size=320", "model.max_seq_len=64", "data.seq_len=64"]).model
    params = noisy_params(cfg, key=2, seed=1, scale=0.2)
    write_hf_dir(params, cfg, root / "hf", write_bpe(root / "tok"))
    art = root / "art"
    assert (
        main(["export", "stablehlo", str(root / "hf"), str(art), "--batch", str(BATCH), "--max-len", "48"])
        == 0
    )
    params = open_model_dir(root / "hf", "test").load().params  # what `shipyard generate` runs
    gen = Engine(params, cfg, max_batch=len(PROMPTS), max_len=48)
    return {"hf": root / "hf", "art": art, "gen": gen, "greedy": complete(gen, PROMPTS, 12)}


def test_the_artifact_generates_the_generators_tokens(model):
    art, gen, greedy = Artifact(model["art"]), model["gen"], model["greedy"]
    assert art.batch == BATCH and art.max_len == 48
    assert art.generate(PROMPTS, 12) == greedy
    assert art.generate(PROMPTS[2:3], 12) == greedy[2:3]  # one prompt, one dummy row
    # sampling settings are inputs of the programs and their picker is the engine's: the same seed gives
    # the engine's draws, whatever the batch (three calls of the artifact, one engine batch)
    sampling = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 3}
    sampled = art.generate(PROMPTS, 12, **sampling)
    assert sampled == complete(gen, PROMPTS, 12, **sampling)
    assert sampled[:2] != greedy[:2]
    everything = {"temperature": 1.0, "seed": 4}  # top_k / top_p unset keep every token
    assert art.generate(PROMPTS, 12, **everything) == art.generate(PROMPTS, 12, top_k=320, **everything)
    stop_at = greedy[2][3]
    stopped = art.generate(PROMPTS, 12, stop_ids=(stop_at,), stop=lambda toks: len(toks) == 6)
    for row, full in zip(stopped, greedy):
        assert row == full[: min(full.index(stop_at) + 1 if stop_at in full else 12, 6)]


def test_a_mixture_of_experts_model_exports_too(tmp_path, capsys):
    """MoE experts run as ragged_dot in the artifact (shape-polymorphic, the GPU's grouped matmul), the
    engine's CPU path runs them blocked: the same tokens. Capacity routing is refused."""
    overrides = ["model.vocab_size=320", "model.moe.num_shared_experts=0", "model.moe.first_dense_layers=0"]
    cfg = load_config("moe-tiny", overrides).model
    params = jax.tree_util.tree_map_with_path(  # Mixtral routing has no selection bias
        lambda path, x: 0 * x if "router_bias" in jax.tree_util.keystr(path) else x,
        noisy_params(cfg, key=3, seed=1, scale=0.2),
    )
    write_hf_dir(params, cfg, tmp_path / "hf", write_bpe(tmp_path / "tok"))
    assert main(["export", "stablehlo", str(tmp_path / "hf"), str(tmp_path / "art"), "--max-len", "32"]) == 0
    params = open_model_dir(tmp_path / "hf", "test").load().params
    assert Artifact(tmp_path / "art").generate(PROMPTS[:3], 8) == generate(params, cfg, PROMPTS[:3], 8)
    capacity = cfg.model_copy(update={"moe": cfg.moe.model_copy(update={"capacity_factor": 1.5})})
    with pytest.raises(ConfigError, match="capacity_factor=1.5"):
        portable_config(capacity)


def test_a_fresh_process_runs_it_without_the_model_code(model):
    code = f"""
import json, sys
from shipyard.inference.artifact import Artifact
from shipyard.cli.main import main
tokens = Artifact({str(model["art"])!r}).generate({PROMPTS!r}, 12)
assert main(["generate", {str(model["art"])!r}, "--prompt", "the model", "--max-new-tokens", "4"]) == 0
loaded = [m for m in ("shipyard.model", "shipyard.inference.decode", "shipyard.inference.engine",
                      "shipyard.train", "shipyard.run.model_dir", "shipyard.interop") if m in sys.modules]
print(json.dumps({{"tokens": tokens, "loaded": loaded}}))
"""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"tokens": model["greedy"], "loaded": []}


@pytest.mark.parametrize(
    "key, value, named",
    [
        ("jax_version", "0.4.1", ["JAX version 0.4.1", jax.__version__]),
        ("format_version", 99, ["format version 99", "runner's 2"]),
        ("stablehlo_version", "99.0.0", ["StableHLO version 99.0.0"]),
        ("calling_convention_version", 1, ["calling convention version 1"]),
    ],
)
def test_another_version_is_refused_with_one_line(model, tmp_path, capsys, key, value, named):
    art = tmp_path / "art"
    shutil.copytree(model["art"], art)
    manifest = json.loads((art / "manifest.json").read_text())
    (art / "manifest.json").write_text(json.dumps({**manifest, key: value}))
    assert main(["generate", str(art), "--prompt", "the model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: generate: ") and err.count("\n") == 1
    assert all(n in err for n in named), err


def test_a_damaged_program_or_a_flag_that_does_not_apply_is_one_line(model, tmp_path, capsys):
    art = tmp_path / "art"
    shutil.copytree(model["art"], art)
    assert main(["generate", str(art), "--prompt", "x", "--step", "3"]) == 2
    assert "--step does not apply" in capsys.readouterr().err
    assert main(["generate", str(art), "--prompt", "x", "--max-new-tokens", "48"]) == 2
    assert "exceeds the artifact's cache of 48 slots" in capsys.readouterr().err
    manifest = json.loads((art / "manifest.json").read_text())
    (art / "manifest.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != "batch"}))
    assert main(["generate", str(art), "--prompt", "x"]) == 3
    assert "manifest.json lacks batch" in capsys.readouterr().err
    (art / "manifest.json").write_text(json.dumps(manifest))
    (art / "decode.stablehlo").write_bytes(b"not a program")
    assert main(["generate", str(art), "--prompt", "x"]) == 3
    err = capsys.readouterr().err
    assert "decode.stablehlo cannot be read" in err and err.count("\n") == 1


def test_an_existing_or_failed_output_is_never_half_written(model, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    args = ["export", "stablehlo", str(model["hf"])]
    assert main([*args, str(out)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert main([*args, str(tmp_path / "a"), "--max-len", "65"]) == 2  # past the model's context
    assert main([*args, str(tmp_path / "a"), "--platforms", "cpu,vax"]) == 2
    assert main([*args, str(tmp_path / "a"), "--batch", "0"]) == 2

    def full_disk(*a, **k):  # the programs are written, then the weights fail
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("safetensors.numpy.save_file", full_disk)
    assert main([*args, str(tmp_path / "a")]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no OUT, no temporary directory


def test_shipyard_generate_prints_the_models_text_from_the_artifact(model, capsys):
    args = ["--max-new-tokens", "12", "--stop", "the"]
    for text in TEXTS:
        args += ["--prompt", text]
    assert main(["generate", str(model["hf"]), *args]) == 0
    from_model = capsys.readouterr().out
    assert main(["generate", str(model["art"]), *args]) == 0
    assert capsys.readouterr().out == from_model
    assert from_model.count("--- ") == len(TEXTS)


def test_an_artifact_and_a_model_directory_are_told_apart(model, tmp_path):
    assert is_artifact(model["art"]) and not is_artifact(model["hf"])
    with pytest.raises(RunDirError, match="is a StableHLO artifact.*only `shipyard generate` runs it"):
        open_model_dir(model["art"], "chat")
    shards = tmp_path / "shards"  # token shards have a manifest.json of their own
    shards.mkdir()
    (shards / "manifest.json").write_text(json.dumps({"vocab_size": 320, "shards": []}))
    assert not is_artifact(shards)
    manifest = json.loads((model["art"] / "manifest.json").read_text())
    assert {"prefill.stablehlo", "decode.stablehlo", "weights.safetensors", "tokenizer"} <= {
        p.name for p in Path(model["art"]).iterdir()
    }
    assert manifest["platforms"] == ["cpu", "cuda"] and manifest["stop_ids"] == [manifest["eos_id"]]
    assert manifest["prefill"]["inputs"][1] == {"name": "tokens", "shape": [BATCH, "p"], "dtype": "int32"}
