"""`shipyard export stablehlo`: a model's prefill and decode steps as a deployable artifact.

The two programs are what `inference.engine.Engine` runs for a batch, on the
portable path (`decode.forward_cached`, not the CPU-specialised decode step,
so one artifact runs on CPU and GPU): the prefill writes left-padded prompts
into a fresh cache and chooses the first new token; the decode step feeds one
token per row, `DECODE_CHUNK` steps per call in a loop on the device,
choosing each next token there. Sampling settings are inputs, not constants,
so one artifact serves greedy and sampled requests; the choice is the
engine's own picker (`sampling.pick_tokens`, traced into the programs at
export), each row keyed by the seed as an engine request is.

The weights are arguments, not constants baked into the program: they are
stored once, as safetensors, next to the programs (`inference.artifact`
describes the directory and runs it).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import shipyard
from shipyard.errors import ConfigError
from shipyard.inference import artifact
from shipyard.inference.decode import KVCache, forward_cached, init_cache
from shipyard.inference.sampling import pick_tokens
from shipyard.output import atomic_dir, refuse_existing, write_json

DECODE_CHUNK = 8
"""Decode steps per call, as the engine's default `tokens_per_call`: one host dispatch per 8 tokens."""
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
"""The jax.export platform names; an artifact holds one lowering per platform it was exported for."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _prefill(weights, tokens, start, seed, temperature, top_k, top_p, *, unflatten, cfg, max_len):
    """(first new token [batch], cache k, cache v, key data) for left-padded prompts in a fresh cache."""
    params = unflatten(weights)
    cache = init_cache(cfg, tokens.shape[0], max_len, params.embed.dtype)
    logits, cache = forward_cached(params, tokens, cache, jnp.int32(0), start, cfg, last_only=True)
    # every row its own key from `seed`, as the engine seeds each request: row b of a call draws what
    # a request with this seed would
    keys = jax.vmap(jax.random.key)(jnp.full(tokens.shape[0], seed))
    token, keys = pick_tokens(logits[:, -1], keys, temperature, top_k, top_p)
    return token, cache.k, cache.v, jax.random.key_data(keys)


def _decode(weights, token, k, v, pos, start, key, steps, temperature, top_k, top_p, *, unflatten, cfg):
    """`steps` (<= DECODE_CHUNK) decode steps from cache slot `pos`: (tokens [chunk, batch], row i from
    step i; the last token [batch]; k; v; key data). `steps` is traced: a shorter last call compiles
    nothing new."""
    params = unflatten(weights)

    def body(i, carry):
        out, token, k, v, key = carry
        logits, cache = forward_cached(params, token[:, None], KVCache(k, v), pos + i, start, cfg)
        token, key = pick_tokens(logits[:, -1], key, temperature, top_k, top_p)
        return out.at[i].set(token), token, cache.k, cache.v, key

    out = jnp.zeros((DECODE_CHUNK, token.shape[0]), jnp.int32)
    carry = (out, token, k, v, jax.random.wrap_key_data(key))
    out, token, k, v, key = jax.lax.fori_loop(0, steps, body, carry)
    return out, token, k, v, jax.random.key_data(key)


def flat_weights(params) -> tuple[dict[str, np.ndarray], Callable]:
    """Params as {name: host array} (names from the tree paths, e.g. "blocks.wq") and the function that
    rebuilds the params tree from such a dict (traced arrays too)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    names = [jax.tree_util.keystr(path).lstrip(".") for path, _ in leaves]
    # contiguous: safetensors writes an array's buffer as it lies in memory, strides ignored
    flat = {n: np.ascontiguousarray(x) for n, (_, x) in zip(names, leaves)}

    def unflatten(weights: dict) -> object:
        return jax.tree.unflatten(treedef, [weights[n] for n in names])

    return flat, unflatten


def _spec(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _described(avals, names: list[str]) -> list[dict]:
    """Inputs or outputs as {name, shape, dtype}; a symbolic dimension is written as its name."""
    return [
        {"name": n, "shape": [d if isinstance(d, int) else str(d) for d in a.shape], "dtype": str(a.dtype)}
        for n, a in zip(names, avals)
    ]


_SAMPLING_NAMES = ["temperature", "top_k", "top_p"]
_PREFILL_IN = ["tokens", "start", "seed", *_SAMPLING_NAMES]
_PREFILL_OUT = ["token", "k", "v", "key"]
_DECODE_IN = ["token", "k", "v", "pos", "start", "key", "steps", *_SAMPLING_NAMES]
_DECODE_OUT = ["tokens", "token", "k", "v", "key"]


def export_programs(params, cfg, batch: int, max_len: int, platforms: tuple[str, ...]):
    """(prefill, decode) as `jax.export.Exported`, and the flat weights they take as first argument."""
    cfg = portable_config(cfg)
    flat, unflatten = flat_weights(params)
    weights = {n: _spec(x) for n, x in flat.items()}
    (p,) = jax.export.symbolic_shape("p", constraints=(f"p <= {max_len}",))
    i32, f32 = jnp.int32, jnp.float32
    scalar = partial(jax.ShapeDtypeStruct, ())
    sampling = (scalar(f32), scalar(i32), scalar(f32))
    prefill = jax.jit(partial(_prefill, unflatten=unflatten, cfg=cfg, max_len=max_len))
    prefill_args = (weights, jax.ShapeDtypeStruct((batch, p), i32), jax.ShapeDtypeStruct((batch,), i32))
    prefill_exp = jax.export.export(prefill, platforms=platforms)(*prefill_args, scalar(i32), *sampling)
    _, k, v, key = prefill_exp.out_avals
    decode = jax.jit(partial(_decode, unflatten=unflatten, cfg=cfg))
    row = jax.ShapeDtypeStruct((batch,), i32)
    decode_args = (weights, row, _spec(k), _spec(v), scalar(i32), row, _spec(key), scalar(i32))
    decode_exp = jax.export.export(decode, platforms=platforms)(*decode_args, *sampling)
    return prefill_exp, decode_exp, flat


def _signature(exp, inputs: list[str], outputs: list[str], n_weights: int, file: str) -> dict:
    return {
        "file": file,
        "inputs": [{"name": "weights", "tensors": n_weights}, *_described(exp.in_avals[n_weights:], inputs)],
        "outputs": _described(exp.out_avals, outputs),
    }


def portable_config(cfg, what: str = "export stablehlo"):
    """The model config the programs are traced with: one trace serves every platform and any prompt
    length, so choices made in Python at trace time must suit them all.

    MoE: the dropless experts run as `jax.lax.ragged_dot` (the GPU's grouped
    matmul; CPU runs every expert on every row, slower but the same result),
    since the CPU's blocked layout needs the token count at trace time.
    Capacity routing needs it too, so it is refused.
    """
    if cfg.moe is None:
        return cfg
    if cfg.moe.capacity_factor is not None:
        raise ConfigError(
            f"{what}: model.moe.capacity_factor={cfg.moe.capacity_factor}: capacity-limited routing depends "
            "on the number of prompt tokens, which the exported prefill leaves open; only dropless MoE "
            "models (capacity_factor null) export"
        )
    return cfg.model_copy(update={"moe": cfg.moe.model_copy(update={"grouped_matmul": "ragged"})})


def _check_args(cfg, batch: int, max_len: int | None, platforms: tuple[str, ...], what: str) -> int:
    """The cache length to export (default: the model's context); ConfigError on a bad flag."""
    if batch < 1:
        raise ConfigError(f"{what}: --batch {batch}: expected at least 1 row")
    max_len = cfg.max_seq_len if max_len is None else max_len
    if not 2 <= max_len <= cfg.max_seq_len:
        raise ConfigError(
            f"{what}: --max-len {max_len}: expected 2 to the model's context of {cfg.max_seq_len} "
            "cache slots (model.max_seq_len)"
        )
    unknown = [p for p in platforms if p not in PLATFORMS]
    if unknown or not platforms:
        raise ConfigError(
            f"{what}: --platforms {','.join(platforms)}: expected some of {', '.join(PLATFORMS)}"
        )
    return max_len


def export_stablehlo(
    model_dir,
    out: Path,
    *,
    batch: int = 1,
    max_len: int | None = None,
    step: int | None = None,
    platforms: tuple[str, ...] = ("cpu", "cuda"),
    what: str = "export stablehlo",
) -> dict:
    """Write the artifact of `model_dir` (a `runs.ModelDir`) to `out`, atomically; returns the manifest.

    The tokenizer is required (the artifact generates text) and is read, with
    the model's stop ids and generation settings, before the weights are.
    """
    from shipyard.data.tokenizer import load_tokenizer, special_token_ids

    cfg = portable_config(model_dir.config.model, what)
    max_len = _check_args(cfg, batch, max_len, platforms, what)
    refuse_existing(out, what)  # before the params are read: refusing should be instant
    tok_dir = model_dir.require_tokenizer(what)
    eos = special_token_ids(tok_dir, load_tokenizer(tok_dir))["eos_token"]
    gen = model_dir.generation(what)
    weights = model_dir.load(step, to_host=True, what=what)
    prefill, decode, flat = export_programs(weights.params, cfg, batch, max_len, platforms)
    source = {"model": str(model_dir.path), "kind": model_dir.kind, "step": weights.step}
    manifest = _manifest(prefill, decode, flat, cfg, batch, max_len, eos, gen, tok_dir, source)
    _write(out, manifest, prefill, decode, flat, tok_dir, model_dir.generation_file(), what)
    return manifest


def _manifest(prefill, decode, flat: dict, cfg, batch, max_len, eos, gen, tok_dir: Path, source) -> dict:
    """manifest.json: versions, shapes, the tokenizer's stop ids and the model's sampling defaults."""
    return {
        "format": artifact.FORMAT,
        "format_version": artifact.FORMAT_VERSION,
        "shipyard_version": shipyard.__version__,
        "jax_version": jax.__version__,
        "stablehlo_version": _stablehlo_target_version(),
        "calling_convention_version": prefill.calling_convention_version,
        "platforms": list(prefill.platforms),
        "batch": batch,
        "max_len": max_len,
        "decode_chunk": DECODE_CHUNK,
        "vocab_size": cfg.vocab_size,
        "eos_id": eos,
        "stop_ids": list(dict.fromkeys(i for i in (eos, *gen.eos_ids) if i is not None)),
        "bos_id": gen.bos_id,
        "sampling": {"temperature": gen.temperature, "top_k": gen.top_k, "top_p": gen.top_p},
        "max_length": gen.max_length,
        "padding": (
            "left: prompts are right-aligned in tokens [batch, p]; start[b] counts row b's pad slots, "
            "which are masked, and positions count from the row's first real token"
        ),
        "sampling_inputs": "temperature f32 (0: greedy), top_k i32 (0: every token), top_p f32 (> 1: off)",
        "weights": {
            "file": artifact.WEIGHTS,
            "names": list(flat),
            "argument": "the programs' first input: a dict of these tensors, passed in sorted-name order",
            "bytes": sum(x.nbytes for x in flat.values()),
        },
        "dimensions": {"p": f"the padded prompt length, 1 to max_len ({max_len})"},
        "tokenizer": {
            "dir": artifact.TOKENIZER,
            "files": [n for n in TOKENIZER_FILES if (tok_dir / n).is_file()],
            "chat_template": _has_chat_template(tok_dir),
        },
        "prefill": _signature(prefill, _PREFILL_IN, _PREFILL_OUT, len(flat), artifact.PREFILL),
        "decode": _signature(decode, _DECODE_IN, _DECODE_OUT, len(flat), artifact.DECODE),
        "source": source,
        "model": cfg.model_dump(mode="json"),
    }


def _has_chat_template(tok_dir: Path) -> bool:
    """A template travels in chat_template.jinja or under "chat_template" in tokenizer_config.json."""
    import json

    if (tok_dir / "chat_template.jinja").is_file():
        return True
    config = tok_dir / "tokenizer_config.json"
    try:
        return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))
    except (ValueError, AttributeError):
        return False


def _stablehlo_target_version() -> str:
    """The StableHLO version jax.export writes: the newest that JAX releases four weeks older read."""
    from jax.extend.mlir.dialects import stablehlo

    return stablehlo.get_version_from_compatibility_requirement(
        stablehlo.StablehloCompatibilityRequirement.WEEK_4
    )


def _write(out: Path, manifest, prefill, decode, flat, tok_dir: Path, generation_file, what: str) -> None:
    from safetensors.numpy import save_file

    with atomic_dir(Path(out), what) as tmp:
        (tmp / artifact.PREFILL).write_bytes(prefill.serialize())
        (tmp / artifact.DECODE).write_bytes(decode.serialize())
        save_file(flat, str(tmp / artifact.WEIGHTS))
        (tmp / artifact.TOKENIZER).mkdir()
        for name in TOKENIZER_FILES:
            if (tok_dir / name).is_file():
                shutil.copy(tok_dir / name, tmp / artifact.TOKENIZER / name)
        if generation_file is not None:
            shutil.copy(generation_file, tmp / "generation_config.json")
        write_json(tmp / artifact.MANIFEST, manifest)
