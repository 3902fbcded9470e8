"""HF Llama interop: export loads in transformers with the same logits; import gives the same logits."""

import json
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_fixtures import noisy_params

from shipyard.config import load_config
from shipyard.errors import DataError
from shipyard.interop.hf import from_hf_tensors, read_safetensors, to_hf_tensors, write_safetensors
from shipyard.interop.hf_config import hf_config, model_config_from_hf
from shipyard.model.transformer import logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CASES = {
    "gqa-untied": [],
    "tied": ["model.tie_embeddings=true"],
    "rope-scaling": [
        "model.rope_scaling={factor: 8.0, original_max_position: 64}",
        "model.rope_theta=500000",
    ],
}


def _random_params(cfg):
    return noisy_params(cfg, key=1, seed=0, scale=0.05)


def _hf_model(config: dict, tensors: dict | None = None):
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures",)})
    hf_cfg._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    if tensors is not None:
        missing, unexpected = model.load_state_dict(
            {k: torch.from_numpy(v) for k, v in tensors.items()}, strict=False
        )
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        if config["tie_word_embeddings"]:
            model.tie_weights()
    return model


def _noisy_hf_model(model_cls, hf_cfg, seed: int, out_dir):
    """A transformers model (eager attention) with noise on every weight, biases included (they start
    at zero), saved as safetensors to out_dir."""
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(hf_cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return model


def _tokens():
    return np.random.default_rng(3).integers(0, 512, (2, 24))


@pytest.mark.parametrize("case", list(CASES))
def test_export_loads_in_transformers_with_equal_logits(case, tmp_path):
    cfg = load_config("tiny", CASES[case]).model
    params = _random_params(cfg)
    tensors = to_hf_tensors(params, cfg)
    write_safetensors(tensors, tmp_path)
    config = hf_config(cfg)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(torch.from_numpy(_tokens())).logits.numpy()
    ours = np.asarray(logits(params, jnp.asarray(_tokens()), cfg))
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)
    # and back: export -> import gives identical params
    back = from_hf_tensors(read_safetensors(tmp_path), model_config_from_hf(config))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        assert np.array_equal(np.asarray(a), b)


def test_import_of_a_transformers_model_gives_its_logits(tmp_path):
    config = {
        "vocab_size": 300,
        "hidden_size": 48,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
    }
    model = _noisy_hf_model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**config), 0, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    cfg = model_config_from_hf(saved)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.tie_embeddings) == (2, 8, False)
    params = from_hf_tensors(read_safetensors(tmp_path), cfg)
    tokens = np.random.default_rng(4).integers(0, 300, (2, 20))
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_allclose(
        np.asarray(logits(params, jnp.asarray(tokens), cfg)), theirs, atol=1e-4, rtol=1e-4
    )


def test_import_refuses_pickles_and_wrong_shapes(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(DataError, match="never loads"):
        read_safetensors(tmp_path)
    cfg = load_config("tiny").model
    tensors = to_hf_tensors(_random_params(cfg), cfg)
    good = tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.1.mlp.up_proj.weight"] = good[:, :10]
    with pytest.raises(DataError, match=r"up_proj.weight has shape \(192, 10\)"):
        from_hf_tensors(tensors, cfg)
    tensors["model.layers.1.mlp.up_proj.weight"] = good
    del tensors["model.norm.weight"]
    with pytest.raises(DataError, match="lacks tensor model.norm.weight"):
        from_hf_tensors(tensors, cfg)
    with pytest.raises(DataError, match="supported: LlamaForCausalLM"):
        model_config_from_hf({"architectures": ["GPT2LMHeadModel"]})


def test_sharded_safetensors_with_index(tmp_path):
    cfg = load_config("tiny").model
    tensors = to_hf_tensors(_random_params(cfg), cfg)
    names = write_safetensors(tensors, tmp_path, max_shard_bytes=100_000)
    assert len(names) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    back = read_safetensors(tmp_path)
    assert set(back) == set(tensors) and all(np.array_equal(back[k], tensors[k]) for k in tensors)


@pytest.mark.slow
def test_cli_export_of_a_run_and_import_to_continue_training(tmp_path, byte_tokens, capsys):
    from shipyard.cli.main import main
    from shipyard.run.model_dir import load_model

    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "tiny",
                f"data.train_tokens={byte_tokens}",
                "train.steps=3",
                "train.logging.progress=false",
                "--run-dir",
                str(run),
            ]
        )
        == 0
    )
    assert main(["export", "hf", str(run), str(tmp_path / "hf")]) == 0
    assert "exported checkpoint 3" in capsys.readouterr().out
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf"), torch_dtype=torch.float32
    ).eval()
    cfg, step, params = load_model(run)
    with torch.no_grad():
        theirs = model(torch.from_numpy(_tokens())).logits.numpy()
    np.testing.assert_allclose(
        np.asarray(logits(params, jnp.asarray(_tokens()), cfg.model)), theirs, atol=1e-4, rtol=1e-4
    )
    before = sorted((tmp_path / "hf").iterdir())
    assert main(["export", "hf", str(run), str(tmp_path / "hf")]) == 1  # never overwrites
    err = capsys.readouterr().err
    assert "error: export hf:" in err and "already exists; choose another output directory" in err
    assert "--overwrite" not in err and sorted((tmp_path / "hf").iterdir()) == before

    # import it back and continue training from it (a learning rate of ~0 keeps the params)
    assert main(["import", "hf", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
    cont = tmp_path / "cont"
    argv = [
        "train",
        str(tmp_path / "imported" / "config.yaml"),
        f"data.train_tokens={byte_tokens}",
        "train.steps=1",
    ]
    argv += [
        "train.optimizer.lr=1e-12",
        "train.schedule.warmup_steps=0",
        "train.logging.progress=false",
        "--run-dir",
        str(cont),
    ]
    assert main(argv) == 0
    assert "starting from the params" in capsys.readouterr().out
    _, _, again = load_model(cont)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again)):
        np.testing.assert_allclose(a, b, atol=1e-6)


MIXTRAL = [
    "model.moe.num_shared_experts=0",
    "model.moe.first_dense_layers=0",
    "model.moe.experts_per_token=3",
]


def _mixtral_params(cfg):
    params = _random_params(cfg)
    moe = params.moe_blocks.moe
    # Mixtral routing has no selection bias; a trained shipyard router_bias must be zero to export.
    return replace(
        params, moe_blocks=replace(params.moe_blocks, moe=replace(moe, router_bias=0 * moe.router_bias))
    )


def test_mixtral_export_loads_in_transformers_with_equal_logits(tmp_path):
    cfg = load_config("moe-tiny", MIXTRAL).model
    params = _mixtral_params(cfg)
    write_safetensors(to_hf_tensors(params, cfg), tmp_path)
    config = hf_config(cfg)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.float32).eval()
    assert type(model).__name__ == "MixtralForCausalLM"
    with torch.no_grad():
        theirs = model(torch.from_numpy(_tokens())).logits.numpy()
    ours = np.asarray(logits(params, jnp.asarray(_tokens()), cfg))
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)
    back = from_hf_tensors(read_safetensors(tmp_path), model_config_from_hf(config))
    assert back.blocks is None
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        assert np.array_equal(np.asarray(a), b)


def test_mixtral_import_of_a_transformers_model_gives_its_logits(tmp_path):
    hf_cfg = transformers.MixtralConfig(
        vocab_size=300,
        hidden_size=48,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    model = _noisy_hf_model(transformers.MixtralForCausalLM, hf_cfg, 0, tmp_path)
    cfg = model_config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert (cfg.moe.num_experts, cfg.moe.experts_per_token, cfg.moe.expert_intermediate_size) == (4, 2, 40)
    params = from_hf_tensors(read_safetensors(tmp_path), cfg)
    tokens = np.random.default_rng(4).integers(0, 300, (2, 20))
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_allclose(
        np.asarray(logits(params, jnp.asarray(tokens), cfg)), theirs, atol=1e-4, rtol=1e-4
    )


def test_moe_export_refuses_what_mixtral_cannot_represent():
    cfg = load_config("moe-tiny").model  # one shared expert, a leading dense layer
    with pytest.raises(DataError, match="1 shared experts .*first_dense_layers=1"):
        hf_config(cfg)
    cfg = load_config("moe-tiny", MIXTRAL).model
    with pytest.raises(DataError, match="selection bias"):
        to_hf_tensors(_random_params(cfg), cfg)


def test_qwen2_import_and_export_with_qkv_biases(tmp_path):
    hf_cfg = transformers.Qwen2Config(
        vocab_size=300,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    model = _noisy_hf_model(transformers.Qwen2ForCausalLM, hf_cfg, 1, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg = model_config_from_hf(config)
    assert cfg.qkv_bias and cfg.tie_embeddings
    params = from_hf_tensors(read_safetensors(tmp_path / "hf"), cfg)
    assert float(np.abs(params.blocks.bq).max()) > 0
    tokens = np.random.default_rng(5).integers(0, 300, (2, 20))
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_allclose(
        np.asarray(logits(params, jnp.asarray(tokens), cfg)), theirs, atol=1e-4, rtol=1e-4
    )
    # and out again: a Qwen2 directory transformers loads with the same logits
    out = tmp_path / "out"
    out.mkdir()
    write_safetensors(to_hf_tensors(params, cfg), out)
    (out / "config.json").write_text(json.dumps(hf_config(cfg)))
    again = transformers.AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    assert type(again).__name__ == "Qwen2ForCausalLM"
    with torch.no_grad():
        np.testing.assert_allclose(
            again(torch.from_numpy(tokens)).logits.numpy(), theirs, atol=1e-4, rtol=1e-4
        )


def test_mistral_sliding_window_import_and_export(tmp_path):
    hf_cfg = transformers.MistralConfig(
        vocab_size=300,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=128,
        sliding_window=6,
        tie_word_embeddings=False,
    )
    model = _noisy_hf_model(transformers.MistralForCausalLM, hf_cfg, 2, tmp_path / "hf")
    cfg = model_config_from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))
    assert cfg.sliding_window == 6 and cfg.global_attention_every is None
    params = from_hf_tensors(read_safetensors(tmp_path / "hf"), cfg)
    tokens = np.random.default_rng(6).integers(0, 300, (2, 24))  # 4x the window: the window matters
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens)).logits.numpy()
    ours = np.asarray(logits(params, jnp.asarray(tokens), cfg))
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)
    glob_cfg = cfg.model_copy(update={"sliding_window": None})
    assert np.abs(np.asarray(logits(params, jnp.asarray(tokens), glob_cfg)) - theirs).max() > 1e-2
    out = tmp_path / "out"
    out.mkdir()
    write_safetensors(to_hf_tensors(params, cfg), out)
    (out / "config.json").write_text(json.dumps(hf_config(cfg)))
    again = transformers.AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    assert type(again).__name__ == "MistralForCausalLM"
    with torch.no_grad():
        np.testing.assert_allclose(
            again(torch.from_numpy(tokens)).logits.numpy(), theirs, atol=1e-4, rtol=1e-4
        )
    interleaved = load_config("tiny", ["model.sliding_window=8", "model.global_attention_every=2"]).model
    with pytest.raises(DataError, match="interleaved local/global"):
        hf_config(interleaved)


def _corrupt(hf_dir, edit):
    """Rewrite model.safetensors's JSON header (8-byte little-endian length + JSON) with `edit`."""
    path = hf_dir / "model.safetensors"
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    new_header, body = edit(header, raw[8 + n :])
    text = json.dumps(new_header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + body)


def test_import_refuses_corrupt_safetensors_and_writes_nothing(tmp_path):
    from shipyard.interop.hf import import_hf

    cfg = load_config("tiny").model
    src = tmp_path / "hf"
    src.mkdir()
    write_safetensors(to_hf_tensors(_random_params(cfg), cfg), src)
    (src / "config.json").write_text(json.dumps(hf_config(cfg)))
    pristine = (src / "model.safetensors").read_bytes()

    def attempt(match):
        out = tmp_path / "out"
        with pytest.raises(DataError, match=match):
            import_hf(src, out)
        assert not out.exists() and not list(tmp_path.glob(".out*"))  # nothing written, no temp left
        (src / "model.safetensors").write_bytes(pristine)

    raw = bytearray(pristine)
    raw[:8] = (len(pristine) * 2).to_bytes(8, "little")  # header length beyond the file
    (src / "model.safetensors").write_bytes(bytes(raw))
    attempt("not a readable safetensors file")

    def out_of_range(header, body):
        name = "model.norm.weight"
        start, end = header[name]["data_offsets"]
        header[name]["data_offsets"] = [start, len(body) + 4096]
        return header, body

    _corrupt(src, out_of_range)
    attempt("not a readable safetensors file")

    def as_int(header, body):
        header["model.norm.weight"]["dtype"] = "I32"  # same byte size, wrong kind
        return header, body

    _corrupt(src, as_int)
    attempt("model.norm.weight has dtype int32; expected a float type")

    tensors = to_hf_tensors(_random_params(cfg), cfg)
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    write_safetensors(tensors, src)  # a well-formed file that lacks a tensor
    attempt("lacks tensor model.layers.0.self_attn.k_proj.weight")
    (src / "model.safetensors").unlink()
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    attempt("never loads")
