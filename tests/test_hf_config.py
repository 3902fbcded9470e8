"""`import hf` checks config.json before reading a tensor: one line naming the key, exit 3, nothing written."""

import json

import numpy as np
import pytest

from shipyard.cli.main import main
from shipyard.config import load_config
from shipyard.interop.hf import to_hf_tensors, write_safetensors
from shipyard.interop.hf_config import hf_config, model_config_from_hf


def _good() -> dict:
    return hf_config(load_config("tiny").model)


def _without(key):
    def edit(c):
        del c[key]

    return edit


def _set(key, value):
    def edit(c):
        c[key] = value

    return edit


# (case, edit of a valid Llama config.json, what the one line must say)
CASES = [
    ("missing vocab_size", _without("vocab_size"), "vocab_size is missing; expected an integer"),
    ("missing layers", _without("num_hidden_layers"), "num_hidden_layers is missing"),
    ("missing architectures", _without("architectures"), "architectures is missing"),
    ("string hidden size", _set("hidden_size", "64"), "hidden_size is '64'; expected an integer > 0"),
    ("bool as int", _set("intermediate_size", True), "intermediate_size is True; expected an integer"),
    ("zero heads", _set("num_attention_heads", 0), "num_attention_heads is 0; expected an integer > 0"),
    (
        "heads not dividing hidden",
        lambda c: (c.update(num_attention_heads=5, num_key_value_heads=5), c.pop("head_dim")),
        "num_attention_heads is 5; expected a divisor of hidden_size=64",
    ),
    (
        "kv heads not dividing heads",
        _set("num_key_value_heads", 3),
        "num_key_value_heads is 3; expected a divisor of num_attention_heads=4",
    ),
    ("negative eps", _set("rms_norm_eps", -1e-5), "rms_norm_eps is -1e-05; expected a number > 0"),
    (
        "unknown rope type",
        _set("rope_parameters", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}),
        "rope_parameters.rope_type is 'yarn'; expected default or llama3",
    ),
    (
        "llama3 rope lacking a key",
        _set("rope_parameters", {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}),
        "low_freq_factor is missing",
    ),
    ("unknown architecture", _set("architectures", ["GPT2LMHeadModel"]), "is a GPT2LMHeadModel; supported"),
    ("mlp bias", _set("mlp_bias", True), "mlp_bias is True; expected false"),
    ("gelu", _set("hidden_act", "gelu"), "hidden_act is 'gelu'; expected silu"),
    (
        "tie as string",
        _set("tie_word_embeddings", "yes"),
        "tie_word_embeddings is 'yes'; expected true or false",
    ),
    (
        "mixtral top-k above experts",
        lambda c: c.update(architectures=["MixtralForCausalLM"], num_local_experts=4, num_experts_per_tok=6),
        "num_experts_per_tok is 6; expected at most num_local_experts=4",
    ),
    ("not an object", lambda c: None, "holds list; expected a JSON object"),
]


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A valid model.safetensors of `tiny` (only the files next to it differ between cases)."""
    cfg = load_config("tiny").model
    out = tmp_path_factory.mktemp("weights")
    write_safetensors(to_hf_tensors(_zeros(cfg), cfg), out)
    return out / "model.safetensors"


@pytest.mark.parametrize("case, edit, message", CASES, ids=[c[0] for c in CASES])
def test_bad_config_json_is_one_line_exit_3_nothing_written(tmp_path, capsys, weights, case, edit, message):
    src = tmp_path / "hf"
    src.mkdir()
    (src / "model.safetensors").symlink_to(weights)
    config = _good()
    edit(config)
    if case == "not an object":
        config = [config]
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    assert main(["import", "hf", str(src), str(out)]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: import hf: "), err
    assert message in err, err
    assert str(src / "config.json") in err
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_a_valid_config_round_trips():
    cfg = load_config("tiny").model  # fields HF has no key for (e.g. scan_unroll) take their defaults
    assert hf_config(model_config_from_hf(hf_config(cfg))) == hf_config(cfg)


def _zeros(cfg):
    import jax

    from shipyard.model.params import init_params
    from shipyard.model.transformer import param_specs

    return jax.tree.map(np.asarray, init_params(param_specs(cfg), jax.random.key(0)))


# (case, file, its text, what the one line must say): the files that travel with the weights
SIDE_CASES = [
    ("generation config not JSON", "generation_config.json", "{", "generation_config.json is not valid JSON"),
    ("eos as a string", "generation_config.json", '{"eos_token_id": "</s>"}', "eos_token_id is '</s>'"),
    ("top_p above 1", "generation_config.json", '{"do_sample": true, "top_p": 2}', "top_p is 2; expected"),
    ("tokenizer config not JSON", "tokenizer_config.json", "[1,", "tokenizer_config.json: not valid JSON"),
    (
        "template does not parse",
        "tokenizer_config.json",
        json.dumps({"chat_template": "{% for m in messages %}{{ m.content }"}),
        "does not parse",
    ),
    (
        "template raises",
        "tokenizer_config.json",
        json.dumps({"chat_template": "{{ raise_exception('Conversation roles must alternate') }}"}),
        "raise_exception: Conversation roles must alternate",
    ),
]


@pytest.mark.parametrize("case, name, text, message", SIDE_CASES, ids=[c[0] for c in SIDE_CASES])
def test_bad_side_files_are_one_line_exit_3_nothing_written(
    tmp_path, capsys, weights, case, name, text, message
):
    src = tmp_path / "hf"
    src.mkdir()
    (src / "model.safetensors").symlink_to(weights)
    (src / "config.json").write_text(json.dumps(_good()))
    (src / name).write_text(text)
    out = tmp_path / "out"
    assert main(["import", "hf", str(src), str(out)]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: import hf: "), err
    assert message in err, err
    assert not out.exists() and not list(tmp_path.glob(".out*"))
