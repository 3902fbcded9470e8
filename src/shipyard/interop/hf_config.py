"""Hugging Face config.json <-> shipyard ModelConfig, with every key checked before a tensor is read.

Import: `model_config_from_hf` checks each key it reads (present when required,
of the right JSON type, in range), the consistency rules between them (KV
heads dividing query heads, a head size that divides the hidden size, top-k
within the experts) and the features shipyard cannot represent (biases other
than Qwen2's q/k/v, activations other than SiLU, unknown RoPE types), and
says what is wrong in one line: the file, the key, the value and what is
expected. Export: `hf_config` writes the architecture that holds a model
exactly (Llama; Qwen2 with q/k/v biases; Mistral with one window; Mixtral MoE)
or refuses with the reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from shipyard.config import ModelConfig, MoEConfig, RopeScaling, format_validation_error
from shipyard.errors import DataError

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM")


def check_mixtral(cfg: ModelConfig) -> None:
    """Refuse an MoE that Mixtral cannot hold exactly, naming every difference."""
    m = cfg.moe
    bad = [
        (m.score != "softmax", f"score={m.score} (Mixtral: softmax)"),
        (not m.normalize_weights, "normalize_weights=false (Mixtral renormalises the top-k weights)"),
        (m.routed_scale != 1.0, f"routed_scale={m.routed_scale} (Mixtral: 1)"),
        (m.num_shared_experts > 0, f"{m.num_shared_experts} shared experts (Mixtral has none)"),
        (m.first_dense_layers > 0, f"first_dense_layers={m.first_dense_layers} (Mixtral: every layer MoE)"),
    ]
    reasons = [why for cond, why in bad if cond]
    if reasons:
        raise DataError(
            "export hf: this MoE has no exact Hugging Face architecture: "
            + "; ".join(reasons)
            + " (only Mixtral-style MoE exports; DeepseekV3 has these features but MLA attention)"
        )


def _check_exportable(cfg: ModelConfig) -> None:
    """Refuse, with the reason, a model no Hugging Face architecture holds exactly."""
    if cfg.qk_norm:
        raise DataError(
            "export hf: models with qk_norm have no Llama equivalent (Llama has no query/key norms)"
        )
    if cfg.moe is not None:
        check_mixtral(cfg)
    if cfg.sliding_window is not None and (cfg.global_attention_every is not None or cfg.qkv_bias):
        raise DataError(
            "export hf: interleaved local/global attention (global_attention_every) or a sliding window with "
            "qkv_bias has no Hugging Face architecture shipyard exports; Mistral/Mixtral windows every layer"
        )
    if cfg.qkv_bias and cfg.moe is not None:
        raise DataError(
            "export hf: an MoE model with qkv_bias has no Hugging Face architecture (Mixtral has no biases)"
        )


def _rope_parameters(cfg: ModelConfig) -> dict:
    if cfg.rope_scaling is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    s = cfg.rope_scaling
    return {
        "rope_type": "llama3",
        "rope_theta": cfg.rope_theta,
        "factor": s.factor,
        "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor,
        "original_max_position_embeddings": s.original_max_position,
    }


def _architecture_fields(cfg: ModelConfig) -> tuple[dict, tuple[str, ...]]:
    """(fields to set, Llama fields to drop) for the architecture that holds `cfg`: Llama, Qwen2
    (Llama + q/k/v biases), Mixtral (MoE) or Mistral (one sliding window on every layer)."""
    if cfg.qkv_bias:
        qwen2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False}
        return qwen2, ("attention_bias", "mlp_bias")
    if cfg.moe is not None:
        mixtral = {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "intermediate_size": cfg.moe.expert_intermediate_size,
            "num_local_experts": cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.experts_per_token,
            "router_aux_loss_coef": cfg.moe.aux_loss,
            "output_router_logits": False,
            "sliding_window": cfg.sliding_window,
        }
        return mixtral, ("mlp_bias",)
    if cfg.sliding_window is not None:
        mistral = {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}
        return {**mistral, "sliding_window": cfg.sliding_window}, ("attention_bias", "mlp_bias")
    return {}, ()


def hf_config(cfg: ModelConfig, bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """config.json for LlamaForCausalLM (dense), Qwen2 / Mistral (biases / windows) or MixtralForCausalLM (MoE)."""
    _check_exportable(cfg)
    rope = _rope_parameters(cfg)
    max_pos = cfg.max_seq_len
    if cfg.rope_scaling:
        max_pos = max(cfg.max_seq_len, cfg.rope_scaling.original_max_position + 1)
    out = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": cfg.norm_eps,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": "float32",
        # both spellings: transformers >= 5 reads rope_parameters, 4.x rope_theta + rope_scaling
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_scaling is None else rope,
        "rope_parameters": rope,
    }
    fields, drop = _architecture_fields(cfg)
    out.update(fields)
    for key in drop:
        out.pop(key)
    if bos_id is not None:
        out["bos_token_id"] = bos_id
    if eos_id is not None:
        out["eos_token_id"] = eos_id
    return out


# ----------------------------------------------------------------------------- import: checking config.json

_MISSING = object()
_TYPES = {
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "number": (lambda v: isinstance(v, int | float) and not isinstance(v, bool), "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
}


class _Keys:
    """Typed reads of one JSON object, each failure one line naming the file, key, value and expectation."""

    def __init__(self, obj: dict, where: str, what: str):
        self.obj, self.where, self.what = obj, where, what

    def fail(self, key: str, value, expected: str):
        shown = "missing" if value is _MISSING else f"{value!r}"
        raise DataError(f"{self.what}: {self.where}: {key} is {shown}; expected {expected}")

    def get(self, key: str, kind: str, default=_MISSING, *, minimum=None, exclusive: bool = True):
        """obj[key] checked against `kind` and a lower bound; null or absent gives `default` (or fails
        when there is none: a required key)."""
        value = self.obj.get(key)
        if value is None:
            if default is _MISSING:
                self.fail(key, self.obj.get(key, _MISSING), _TYPES[kind][1])
            return default
        ok, what = _TYPES[kind]
        if minimum is not None:
            what += f" {'>' if exclusive else '>='} {minimum}"
        if not ok(value) or (minimum is not None and (value <= minimum if exclusive else value < minimum)):
            self.fail(key, value, what)
        return value


def _rope_scaling(keys: _Keys) -> tuple[float, RopeScaling | None]:
    """(rope_theta, Llama-3 scaling or None) from rope_parameters (transformers 5) or rope_scaling (4.x)."""
    rope = keys.obj.get("rope_parameters") or keys.obj.get("rope_scaling") or {}
    name = "rope_parameters" if keys.obj.get("rope_parameters") else "rope_scaling"
    if not isinstance(rope, dict):
        keys.fail(name, rope, "an object (or null)")
    theta = _Keys(rope, keys.where, keys.what).get(
        "rope_theta", "number", keys.get("rope_theta", "number", 10000.0, minimum=0)
    )
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("default", None):
        return theta, None
    if kind != "llama3":
        keys.fail(f"{name}.rope_type", kind, "default or llama3 (the RoPE variants shipyard implements)")
    r = _Keys(rope, f"{keys.where} {name}", keys.what)
    return theta, RopeScaling(
        factor=r.get("factor", "number", minimum=0),
        low_freq_factor=r.get("low_freq_factor", "number", minimum=0),
        high_freq_factor=r.get("high_freq_factor", "number", minimum=0),
        original_max_position=r.get("original_max_position_embeddings", "int", minimum=0),
    )


def _check_supported(keys: _Keys, arch: str) -> None:
    """Features of the HF model that shipyard's architecture cannot represent."""
    for key in ("attention_bias", "mlp_bias"):
        if keys.get(key, "bool", False):
            keys.fail(key, True, "false (shipyard has biases only on q/k/v, Qwen2 style)")
    if arch == "Qwen2ForCausalLM" and keys.get("use_sliding_window", "bool", False):
        keys.fail("use_sliding_window", True, "false (shipyard runs Qwen2 with global attention)")
    act = keys.get("hidden_act", "str", "silu")
    if act != "silu":
        keys.fail("hidden_act", act, "silu (SwiGLU MLPs)")


def _heads(keys: _Keys, hidden: int) -> tuple[int, int, int]:
    """(query heads, KV heads, head size), consistent with each other and the hidden size."""
    heads = keys.get("num_attention_heads", "int", minimum=0)
    kv = keys.get("num_key_value_heads", "int", heads, minimum=0)
    if heads % kv:
        keys.fail("num_key_value_heads", kv, f"a divisor of num_attention_heads={heads}")
    head_dim = keys.get("head_dim", "int", None, minimum=0)
    if head_dim is None:
        if hidden % heads:
            keys.fail(
                "num_attention_heads", heads, f"a divisor of hidden_size={hidden} (or an explicit head_dim)"
            )
        head_dim = hidden // heads
    return heads, kv, head_dim


def _mixtral(keys: _Keys, intermediate: int) -> MoEConfig:
    experts = keys.get("num_local_experts", "int", minimum=0)
    top_k = keys.get("num_experts_per_tok", "int", minimum=0)
    if top_k > experts:
        keys.fail("num_experts_per_tok", top_k, f"at most num_local_experts={experts}")
    return MoEConfig(
        num_experts=experts,
        experts_per_token=top_k,
        expert_intermediate_size=intermediate,
        aux_loss=keys.get("router_aux_loss_coef", "number", 0.01, minimum=0, exclusive=False),
    )


def model_config_from_hf(config, where: str = "config.json", what: str = "import hf") -> ModelConfig:
    """A shipyard ModelConfig for a Llama / Mistral / Qwen2 / Mixtral config.json; anything missing,
    mistyped, inconsistent or unsupported is one DataError line naming the key."""
    if not isinstance(config, dict):
        raise DataError(f"{what}: {where} holds {type(config).__name__}; expected a JSON object")
    keys = _Keys(config, where, what)
    archs = config.get("architectures")
    if not (isinstance(archs, list) and archs and all(isinstance(a, str) for a in archs)):
        keys.fail(
            "architectures",
            archs if "architectures" in config else _MISSING,
            'a list like ["LlamaForCausalLM"]',
        )
    arch = archs[0]
    if arch not in ARCHITECTURES:
        raise DataError(f"{what}: {where} is a {arch}; supported: {', '.join(ARCHITECTURES)}")
    _check_supported(keys, arch)
    hidden = keys.get("hidden_size", "int", minimum=0)
    intermediate = keys.get("intermediate_size", "int", minimum=0)
    heads, kv, head_dim = _heads(keys, hidden)
    theta, scaling = _rope_scaling(keys)
    max_pos = keys.get("max_position_embeddings", "int", 2048, minimum=0)
    window = None
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        window = keys.get("sliding_window", "int", None, minimum=0)
        if window is not None and window >= max_pos:  # a window as long as the context is no window
            window = None
    fields = dict(
        vocab_size=keys.get("vocab_size", "int", minimum=0),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=keys.get("num_hidden_layers", "int", minimum=0),
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        max_seq_len=max_pos,
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=keys.get("rms_norm_eps", "number", 1e-6, minimum=0),
        tie_embeddings=keys.get("tie_word_embeddings", "bool", False),
        qkv_bias=arch == "Qwen2ForCausalLM",
        sliding_window=window,
        moe=_mixtral(keys, intermediate) if arch == "MixtralForCausalLM" else None,
    )
    try:
        return ModelConfig(**fields)
    except ValidationError as e:  # a rule of shipyard's own schema; named in shipyard's terms
        raise DataError(f"{what}: {where}: {format_validation_error(e, ModelConfig)}") from e


# ----------------------------------------------------------------------------- generation_config.json


@dataclass(frozen=True)
class GenerationDefaults:
    """A model's own decoding settings (Hugging Face generation_config.json), used unless overridden."""

    eos_ids: tuple[int, ...] = ()
    """Every id that ends a reply (Llama 3 has several: <|end_of_text|>, <|eot_id|>, ...)."""
    bos_id: int | None = None
    """The begin-of-sequence id, if the model has one."""
    temperature: float | None = None
    """Sampling temperature; None: the command's default. 0 when do_sample is false."""
    top_p: float | None = None
    """Nucleus sampling mass."""
    top_k: int | None = None
    """Sample among the k likeliest tokens (0 or None: all)."""
    max_length: int | None = None
    """Prompt + reply tokens at most."""


def read_generation_config(path: Path, what: str) -> GenerationDefaults:
    """generation_config.json at `path`, every key it sets checked (one DataError line on a bad one)."""
    try:
        obj = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{what}: {path} is not valid JSON ({e.msg}, line {e.lineno})") from e
    if not isinstance(obj, dict):
        raise DataError(f"{what}: {path} holds {type(obj).__name__}; expected a JSON object")
    keys = _Keys(obj, str(path), what)
    eos = obj.get("eos_token_id")
    eos_list = [eos] if not isinstance(eos, list) else eos
    if eos is not None and not all(_TYPES["int"][0](e) and e >= 0 for e in eos_list):
        keys.fail("eos_token_id", eos, "a token id or a list of token ids")
    sample = keys.get("do_sample", "bool", False)
    top_p = keys.get("top_p", "number", None, minimum=0)
    if top_p is not None and top_p > 1:
        keys.fail("top_p", top_p, "a number in (0, 1]")
    return GenerationDefaults(
        eos_ids=tuple(eos_list) if eos is not None else (),
        bos_id=keys.get("bos_token_id", "int", None, minimum=0, exclusive=False),
        temperature=keys.get("temperature", "number", None, minimum=0, exclusive=False) if sample else 0.0,
        top_p=top_p if sample else None,
        top_k=keys.get("top_k", "int", None, minimum=0, exclusive=False) if sample else None,
        max_length=keys.get("max_length", "int", None, minimum=0),
    )
