"""Hugging Face Llama / Mistral / Qwen2 / Mixtral checkpoints: shipyard params <-> safetensors + config.json.

Models with q/k/v biases (`model.qkv_bias`) map to Qwen2ForCausalLM.

Dense models map to LlamaForCausalLM; mixture-of-experts models to
MixtralForCausalLM, which represents ours exactly when routing is Mixtral's
(softmax scores, top-k weights renormalised, no shared experts, every layer
MoE, no selection bias). Other MoE shapes (shared experts, sigmoid routing,
leading dense layers: DeepSeek-V3 style) are refused at export with the reason:
the HF architecture that has them (DeepseekV3) also changes attention (MLA),
so it cannot hold our GQA layers.

The mapping is exact: HF's Llama stores projections as [out, in] matrices
with heads flattened into the out (q, k, v) or in (o) dimension; shipyard keeps
heads as their own axis ([layers, embed, heads, head_dim]) so they can be
sharded. RoPE uses the same rotate-half pairing, RMSNorm the same formula, so
logits agree to float rounding (tested against transformers).

Only safetensors are read or written: a `.bin` (pickle) checkpoint is refused,
never unpickled.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from shipyard.config import ModelConfig
from shipyard.errors import DataError
from shipyard.interop.hf_config import check_mixtral, hf_config, model_config_from_hf


def _layer_slices(params):
    """(stacked blocks, index within the stack) for every layer, in order."""
    return [(blocks, j) for blocks, _ in params.stacks() for j in range(blocks.attn_norm.shape[0])]


def iter_hf_tensors(params, cfg: ModelConfig):
    """(name, numpy) pairs of the HF Llama / Mixtral state dict, one tensor at a time, in file order.

    `params` may be sharded device arrays: each tensor (one layer's matrix, one
    expert's) is copied to the host only when it is yielded, so an export
    holds at most the safetensors shard being written (see write_safetensors).
    """
    E, H, K, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if cfg.moe is not None:
        check_mixtral(cfg)

    def host(x):
        return np.ascontiguousarray(np.asarray(x), dtype=np.float32)

    yield "model.embed_tokens.weight", host(params.embed)
    yield "model.norm.weight", host(params.final_norm)
    for i, (b, j) in enumerate(_layer_slices(params)):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", host(b.attn_norm[j])
        yield p + "post_attention_layernorm.weight", host(b.mlp_norm[j])
        yield p + "self_attn.q_proj.weight", host(np.asarray(b.wq[j]).reshape(E, H * D).T)
        yield p + "self_attn.k_proj.weight", host(np.asarray(b.wk[j]).reshape(E, K * D).T)
        yield p + "self_attn.v_proj.weight", host(np.asarray(b.wv[j]).reshape(E, K * D).T)
        yield p + "self_attn.o_proj.weight", host(np.asarray(b.wo[j]).reshape(H * D, E).T)
        if b.bq is not None:
            yield p + "self_attn.q_proj.bias", host(np.asarray(b.bq[j]).reshape(H * D))
            yield p + "self_attn.k_proj.bias", host(np.asarray(b.bk[j]).reshape(K * D))
            yield p + "self_attn.v_proj.bias", host(np.asarray(b.bv[j]).reshape(K * D))
        if b.moe is None:
            yield p + "mlp.gate_proj.weight", host(np.asarray(b.w_gate[j]).T)
            yield p + "mlp.up_proj.weight", host(np.asarray(b.w_up[j]).T)
            yield p + "mlp.down_proj.weight", host(np.asarray(b.w_down[j]).T)
            continue
        if np.any(np.asarray(b.moe.router_bias[j])):
            raise DataError(
                "export hf: the router's selection bias (aux-loss-free balancing) is non-zero; "
                "Mixtral routing has no bias, so the exported model would route differently"
            )
        # Mixtral on disk: block_sparse_moe.gate [experts, embed]; experts.N.w1 (gate) and
        # w3 (up) [F, embed], w2 (down) [embed, F] (transformers 5 fuses them when loading).
        yield p + "block_sparse_moe.gate.weight", host(np.asarray(b.moe.router[j]).T)
        for x in range(b.moe.w_gate.shape[1]):
            q = f"{p}block_sparse_moe.experts.{x}."
            yield q + "w1.weight", host(np.asarray(b.moe.w_gate[j, x]).T)
            yield q + "w3.weight", host(np.asarray(b.moe.w_up[j, x]).T)
            yield q + "w2.weight", host(np.asarray(b.moe.w_down[j, x]).T)
    if not cfg.tie_embeddings:
        yield "lm_head.weight", host(np.asarray(params.lm_head).T)


def to_hf_tensors(params, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The whole HF state dict in memory (tests, small models); exports stream `iter_hf_tensors`."""
    return dict(iter_hf_tensors(params, cfg))


class _TensorReader:
    """An HF state dict read tensor by tensor: each name present, its shape what config.json implies,
    its dtype a float type; fp32 numpy out."""

    LAYER = "model.layers.{}."

    def __init__(self, tensors: dict[str, np.ndarray], num_layers: int, where: str, what: str):
        self.tensors, self.num_layers, self.where, self.what = tensors, num_layers, where, what

    def get(self, name: str, shape: tuple) -> np.ndarray:
        if name not in self.tensors:
            raise DataError(f"{self.what}: {self.where} lacks tensor {name}")
        t = self.tensors[name]
        if tuple(t.shape) != shape:
            raise DataError(
                f"{self.what}: {self.where}: {name} has shape {tuple(t.shape)}, config.json implies {shape}"
            )
        if not np.issubdtype(t.dtype, np.floating) and t.dtype.name != "bfloat16":
            raise DataError(f"{self.what}: {self.where}: {name} has dtype {t.dtype}; expected a float type")
        return np.asarray(t, dtype=np.float32)

    def stack(self, name: str, shape: tuple, transform=lambda t: t) -> np.ndarray:
        """`model.layers.{i}.<name>` of every layer, transformed, stacked on a leading layers axis."""
        return np.stack(
            [transform(self.get((self.LAYER + name).format(i), shape)) for i in range(self.num_layers)]
        )


def _hf_block(r: _TensorReader, cfg: ModelConfig, mlp: dict):
    """A layer stack's attention (and norms) from HF names, with the given MLP fields."""
    from shipyard.model.transformer import BlockParams

    E, H, K, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    biases = {}
    if cfg.qkv_bias:
        biases = dict(
            bq=r.stack("self_attn.q_proj.bias", (H * D,), lambda t: t.reshape(H, D)),
            bk=r.stack("self_attn.k_proj.bias", (K * D,), lambda t: t.reshape(K, D)),
            bv=r.stack("self_attn.v_proj.bias", (K * D,), lambda t: t.reshape(K, D)),
        )
    return BlockParams(
        attn_norm=r.stack("input_layernorm.weight", (E,)),
        wq=r.stack("self_attn.q_proj.weight", (H * D, E), lambda t: t.T.reshape(E, H, D)),
        wk=r.stack("self_attn.k_proj.weight", (K * D, E), lambda t: t.T.reshape(E, K, D)),
        wv=r.stack("self_attn.v_proj.weight", (K * D, E), lambda t: t.T.reshape(E, K, D)),
        wo=r.stack("self_attn.o_proj.weight", (E, H * D), lambda t: t.T.reshape(H, D, E)),
        q_norm=None,
        k_norm=None,
        mlp_norm=r.stack("post_attention_layernorm.weight", (E,)),
        **mlp,
        **biases,
    )


def _hf_moe(r: _TensorReader, cfg: ModelConfig):
    """Mixtral's block_sparse_moe of every layer as MoEParams (no shared experts, zero selection bias)."""
    from shipyard.model.moe import MoEParams

    E, L = cfg.hidden_size, cfg.num_layers
    X, F = cfg.moe.num_experts, cfg.moe.expert_intermediate_size
    q = r.LAYER + "block_sparse_moe."

    def experts(name: str, shape: tuple) -> np.ndarray:
        per_layer = [
            [r.get(f"{q.format(i)}experts.{x}.{name}.weight", shape).T for x in range(X)] for i in range(L)
        ]
        return np.stack([np.stack(layer) for layer in per_layer])

    return MoEParams(
        router=r.stack("block_sparse_moe.gate.weight", (X, E), lambda t: t.T),
        router_bias=np.zeros((L, X), np.float32),
        w_gate=experts("w1", (F, E)),
        w_up=experts("w3", (F, E)),
        w_down=experts("w2", (E, F)),
        shared_gate=None,
        shared_up=None,
        shared_down=None,
    )


def from_hf_tensors(
    tensors: dict[str, np.ndarray], cfg: ModelConfig, where: str = "checkpoint", what: str = "import hf"
):
    """shipyard params (numpy fp32) from an HF Llama / Mixtral state dict; names and shapes are checked."""
    from shipyard.model.transformer import TransformerParams

    r = _TensorReader(tensors, cfg.num_layers, where, what)
    E, M = cfg.hidden_size, cfg.intermediate_size
    if cfg.moe is None:
        mlp = dict(
            w_gate=r.stack("mlp.gate_proj.weight", (M, E), lambda t: t.T),
            w_up=r.stack("mlp.up_proj.weight", (M, E), lambda t: t.T),
            w_down=r.stack("mlp.down_proj.weight", (E, M), lambda t: t.T),
        )
        dense, moe_blocks = _hf_block(r, cfg, mlp), None
    else:
        dense = None
        moe_blocks = _hf_block(r, cfg, dict(w_gate=None, w_up=None, w_down=None, moe=_hf_moe(r, cfg)))
    lm_head = None if cfg.tie_embeddings else r.get("lm_head.weight", (cfg.vocab_size, E)).T
    return TransformerParams(
        embed=r.get("model.embed_tokens.weight", (cfg.vocab_size, E)),
        blocks=dense,
        final_norm=r.get("model.norm.weight", (E,)),
        lm_head=lm_head,
        moe_blocks=moe_blocks,
    )


def write_safetensors(tensors, out_dir: Path, max_shard_bytes: int = 5 << 30) -> list[str]:
    """model.safetensors, or model-0000i-of-0000n.safetensors + index when larger than max_shard_bytes.

    `tensors` is a dict or an iterable of (name, array) pairs; each shard is
    written as soon as it is full, so only one shard's tensors are in memory.
    Shards get their final names once their count is known.
    """
    from safetensors.numpy import save_file

    items = tensors.items() if isinstance(tensors, dict) else tensors
    written: list[tuple[Path, list[str]]] = []
    shard: dict[str, np.ndarray] = {}
    size = total = 0

    def flush():
        path = out_dir / f".shard-{len(written):05d}.safetensors"
        save_file(shard, str(path), metadata={"format": "pt"})
        written.append((path, list(shard)))

    for name, t in items:
        if shard and size + t.nbytes > max_shard_bytes:
            flush()
            shard, size = {}, 0
        shard[name] = t
        size += t.nbytes
        total += t.nbytes
    flush()
    if len(written) == 1:
        written[0][0].rename(out_dir / "model.safetensors")
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(written):05d}.safetensors" for i in range(len(written))]
    weight_map = {}
    for name, (path, keys) in zip(names, written):
        path.rename(out_dir / name)
        weight_map.update(dict.fromkeys(keys, name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return names


def read_safetensors(hf_dir: Path, what: str = "import hf") -> dict[str, np.ndarray]:
    """Every tensor of an HF directory's safetensors files (refusing pickle-based .bin checkpoints)."""
    from safetensors.numpy import load_file

    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        if list(Path(hf_dir).glob("*.bin")) or list(Path(hf_dir).glob("*.pt")):
            raise DataError(
                f"{what}: {hf_dir} holds only .bin/.pt (pickle) weights, which shipyard never loads; "
                "convert them to safetensors first"
            )
        raise DataError(f"{what}: {hf_dir} has no .safetensors files")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except Exception as e:  # safetensors raises its own error types for a bad header
            raise DataError(f"{what}: {f} is not a readable safetensors file ({e})") from e
    return tensors


def is_hf_dir(path: Path) -> bool:
    """A Hugging Face model directory: config.json next to safetensors (or pickle) weights."""
    path = Path(path)
    weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
    return (path / "config.json").is_file() and weights


def read_hf_config(hf_dir: Path, what: str = "import hf") -> ModelConfig:
    """The checked ModelConfig of an HF directory's config.json (nothing else is read)."""
    config_path = Path(hf_dir) / "config.json"
    if not config_path.is_file():
        raise DataError(f"{what}: {hf_dir} has no config.json")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{what}: {config_path} is not valid JSON ({e.msg}, line {e.lineno})") from e
    return model_config_from_hf(config, str(config_path), what)


def read_hf_dir(hf_dir: Path, what: str = "import hf"):
    """(ModelConfig, params as host fp32 numpy) of an HF directory: config.json checked first, then
    every tensor's name, shape and dtype."""
    model = read_hf_config(hf_dir, what)
    return model, from_hf_tensors(read_safetensors(hf_dir, what), model, str(hf_dir), what)


def check_side_files(hf_dir: Path, what: str) -> None:
    """The files that travel with the weights, checked before anything is written: generation_config.json
    (every key it sets) and the chat template (it parses and renders a one-message conversation)."""
    from shipyard.data.hf_template import load_hf_template
    from shipyard.interop.hf_config import read_generation_config

    if (Path(hf_dir) / "generation_config.json").is_file():
        read_generation_config(Path(hf_dir) / "generation_config.json", what)
    try:
        template = load_hf_template(hf_dir)
        if template is not None:
            template.text([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    except DataError as e:
        raise DataError(f"{what}: {e}") from e


def run_config_for(model: ModelConfig, init_from: Path) -> dict:
    """The config a model read from elsewhere trains with by default (what `import hf` writes)."""
    return {
        "model": model.model_dump(mode="json"),
        "data": {"seq_len": min(model.max_seq_len, 2048)},
        "train": {"steps": 1000, "global_batch_size": 8, "init_from": str(Path(init_from).absolute())},
    }


# ----------------------------------------------------------------------------- directories


def write_hf_dir(
    params,
    cfg: ModelConfig,
    out: Path,
    tokenizer_dir: Path | None,
    max_shard_bytes: int = 5 << 30,
    generation_file: Path | None = None,
) -> list[str]:
    """Write a transformers-loadable Llama (or Mixtral, Qwen2, Mistral) directory, atomically: the
    safetensors shards, config.json, generation_config.json (the model's own `generation_file` when it
    has one) and the tokenizer files with its chat template. `params` may be sharded device arrays:
    tensors reach the host one at a time. Returns the safetensors file names."""
    import shutil

    from shipyard.output import atomic_dir

    ids = {}
    if tokenizer_dir is not None:
        from shipyard.data.tokenizer import load_tokenizer, special_token_ids

        ids = special_token_ids(tokenizer_dir, load_tokenizer(tokenizer_dir))
    with atomic_dir(Path(out), "export hf") as tmp:
        files = write_safetensors(iter_hf_tensors(params, cfg), tmp, max_shard_bytes)
        config = hf_config(cfg, ids.get("bos_token"), ids.get("eos_token"))
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        generation = {
            "bos_token_id": ids.get("bos_token"),
            "eos_token_id": ids.get("eos_token"),
            "do_sample": False,
        }
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        if generation_file is not None:
            shutil.copy(generation_file, tmp / "generation_config.json")
        if tokenizer_dir is not None:
            for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
                if (tokenizer_dir / name).is_file():
                    shutil.copy(tokenizer_dir / name, tmp / name)
    return files


def import_hf(hf_dir: Path, out: Path) -> dict:
    """An HF Llama / Mistral / Mixtral safetensors directory -> <out>/params (Orbax) + <out>/config.yaml to train from."""
    import shutil

    import orbax.checkpoint as ocp
    import yaml

    from shipyard.output import atomic_dir, refuse_existing

    hf_dir, out = Path(hf_dir), Path(out)
    refuse_existing(out, "import hf")  # before reading gigabytes
    model = read_hf_config(hf_dir)  # config.json, then the side files, then the tensors: cheap checks first
    check_side_files(hf_dir, "import hf")
    params = from_hf_tensors(read_safetensors(hf_dir), model, str(hf_dir))
    with atomic_dir(out, "import hf") as tmp:
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save((tmp / "params").absolute(), params)
        header = f"# imported from {hf_dir}; set data.train_tokens (same tokenizer!) and train settings\n"
        run_config = run_config_for(model, out / "params")
        (tmp / "config.yaml").write_text(header + yaml.safe_dump(run_config, sort_keys=False))
        for name in (
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
            "chat_template.jinja",
        ):
            if (hf_dir / name).is_file():
                shutil.copy(hf_dir / name, tmp / name)
    return {"params": str(out / "params"), "config": str(out / "config.yaml"), "model": model}
