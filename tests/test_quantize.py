"""int8 weight-only inference (model.quant) and the KV-cache dtype: rounding, layouts, accuracy on a
trained model, both decode paths, and the --quantize / --kv-dtype flags of generate and eval.

The trained model is the tiny preset fitted (150 AdamW steps, a few seconds) to a Markov chain over
its 512 tokens: each token is followed by one fixed successor half of the time, by a second fixed one
30% of the time, by a uniformly random token otherwise. Its next-token distributions are peaked the
way a trained model's are (top-2 margin about 0.5 nats), unlike a random model's, where the argmax
is decided by noise and no low-precision inference could keep it.
"""

from __future__ import annotations

import dataclasses
import json
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from engine_fixtures import complete, generate
from model_fixtures import noisy_params

from shipyard.config import load_config
from shipyard.inference import cpu_decode
from shipyard.inference.engine import Engine, decode_compiler_options, engine_for
from shipyard.model import attention, layers, quant, quantize
from shipyard.model.transformer import logits, output_weights

# Heavy compiles and end-to-end runs: the `make test-slow` tier (docs/testing.md: tiers).
pytestmark = pytest.mark.slow

VOCAB, STEPS, BATCH, SEQ = 512, 150, 16, 64
PROMPTS = [[5, 17, 99, 3], [42], [7, 8, 9, 10, 11, 12, 13]]


def _chain_batch(step: int, succ: np.ndarray, alt: np.ndarray) -> np.ndarray:
    r = np.random.default_rng([7, step])
    x = np.empty((BATCH, SEQ + 1), np.int32)
    x[:, 0] = r.integers(0, VOCAB, BATCH)
    u, rand = r.random((BATCH, SEQ + 1)), r.integers(0, VOCAB, (BATCH, SEQ + 1))
    for t in range(1, SEQ + 1):
        prev = x[:, t - 1]
        x[:, t] = np.where(u[:, t] < 0.5, succ[prev], np.where(u[:, t] < 0.8, alt[prev], rand[:, t]))
    return x


@pytest.fixture(scope="module")
def trained():
    """(full config, params) of the tiny model fitted to the Markov chain (see the module docstring)."""
    cfg = load_config("tiny", [f"model.vocab_size={VOCAB}"])
    rng = np.random.default_rng(0)
    succ, alt = rng.permutation(VOCAB), rng.permutation(VOCAB)
    params = jax.tree.map(jnp.asarray, noisy_params(cfg.model, key=0, seed=0, scale=0.0))
    opt = optax.adamw(1e-2, weight_decay=0.0)

    def loss(p, x):
        out = logits(p, x[:, :-1], cfg.model)
        return optax.softmax_cross_entropy_with_integer_labels(out, x[:, 1:]).mean()

    @jax.jit
    def step(p, s, x):
        g = jax.grad(loss)(p, x)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    state = opt.init(params)
    for i in range(STEPS):
        params, state = step(params, state, jnp.asarray(_chain_batch(i, succ, alt)))
    # the chain's entropy is 2.27 nats, a model that knows nothing scores ln(512) = 6.24
    assert float(loss(params, jnp.asarray(_chain_batch(10**6, succ, alt)))) < 2.7
    return cfg, params


def test_round_trip_error_is_at_most_half_a_step_per_output_channel():
    rng = np.random.default_rng(0)
    cases = [((64, 48), (0,)), ((3, 64, 4, 16), (1,)), ((3, 4, 16, 64), (1, 2))]  # [in, out], wq, wo
    for shape, in_axes in cases:
        w = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 2.0, shape[-1])
        w[..., 0] = 0.0  # an all-zero channel stays exactly zero
        qw = quant.quantize(jnp.asarray(w), in_axes)
        assert qw.q.dtype == jnp.int8 and qw.scale.dtype == jnp.float32
        assert qw.scale.shape == tuple(1 if i in in_axes else n for i, n in enumerate(shape))
        err = np.abs(np.asarray(quant.dequantize(qw)) - w)
        assert np.all(err <= np.asarray(qw.scale) / 2 * (1 + 1e-6))
        # each channel's largest |w| maps to +-127: the whole int8 range is used
        assert np.all(np.max(np.abs(np.asarray(qw.q)), axis=in_axes)[..., 1:] == 127)
        assert not np.any(np.asarray(qw.q)[..., 0])


def test_both_matmul_formulations_equal_the_dequantized_product():
    rng = np.random.default_rng(1)
    w = quant.quantize(jnp.asarray(rng.standard_normal((96, 40)).astype(np.float32)), (0,))
    x = jnp.asarray(
        rng.standard_normal((5, 96)).astype(np.float32) * np.array([[1], [100], [1e-3], [0], [3]])
    )
    want = np.asarray(x @ quant.dequantize(w))
    scale = np.abs(want).max(axis=1, keepdims=True) + 1e-30
    for dot in (quant.int8_dot, quant.dequantized_dot):  # the CPU path, the GPU/TPU path
        got = np.asarray(dot(x, w))
        assert np.all(np.abs(got - want) <= 1e-4 * scale), dot.__name__
    # the model's entry points: layers.dense, `@`, 3-D inputs
    x3 = x.reshape(1, 5, 96)
    np.testing.assert_allclose(np.asarray(layers.dense(x3, w))[0], want, atol=1e-4 * float(scale.max()))
    np.testing.assert_allclose(np.asarray(x3 @ w)[0], want, atol=1e-4 * float(scale.max()))


@pytest.mark.parametrize("group", [None, 32])
def test_quantized_weights_take_the_models_layouts_exactly(group):
    """Fusing q|k|v and gate|up, regrouping heads, the out projection, a tied head: done on the int8
    values and the scales alike, the result dequantizes to the same layout of the dequantized weights.
    Group-wise too (groups of 32 inputs: 2 per embed row of `tiny`, and wo's [4 heads, 16] inputs
    merged into one axis keep their groups of two heads)."""
    cfg = load_config("tiny", ["model.tie_embeddings=true"]).model
    params = quantize.quantize_params(
        jax.tree.map(jnp.asarray, noisy_params(cfg, 1, 1, 0.1)), cfg, embed=True, group=group
    )
    if group is not None:
        assert params.blocks.wq.scale.shape[1] == 2 and params.blocks.wo.scale.shape[1:3] == (2, 1)
    deq = jax.tree.map(
        lambda w: quant.dequantize(w) if quant.is_quantized(w) else w, params, is_leaf=quant.is_quantized
    )
    block, plain = jax.tree.map(lambda a: a[0], params.blocks), jax.tree.map(lambda a: a[0], deq.blocks)
    pairs = [
        (
            attention.attention_weights(block, cfg.num_kv_heads),
            attention.attention_weights(plain, cfg.num_kv_heads),
        ),
        (
            attention.attention_weights(block, cfg.num_kv_heads, fused=False).qkv,
            attention.attention_weights(plain, cfg.num_kv_heads, fused=False).qkv,
        ),
        (layers.fuse_gate_up(block.w_gate, block.w_up), layers.fuse_gate_up(plain.w_gate, plain.w_up)),
        (output_weights(params), output_weights(deq)),
    ]
    for got, want in pairs:
        got = jax.tree.map(quant.dequantize, got, is_leaf=quant.is_quantized)
        assert jax.tree.all(
            jax.tree.map(lambda a, b: a.shape == b.shape and bool(jnp.all(a == b)), got, want)
        )
    assert quant.is_quantized(params.embed) and params.lm_head is None  # tied: the head is embed.T
    tokens = jnp.asarray([[3, 9, 500]])
    np.testing.assert_array_equal(
        quant.embed_lookup(params.embed, tokens), jnp.take(deq.embed, tokens, axis=0)
    )


def test_int8_logits_and_greedy_continuations_on_a_trained_model(trained):
    cfg, params = trained
    qparams = quantize.quantize_params(params, cfg.model)
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, VOCAB, (8, 48)))
    ref, got = np.asarray(logits(params, tokens, cfg.model)), np.asarray(logits(qparams, tokens, cfg.model))
    rel = np.abs(got - ref) / ref.std()
    prompts = [rng.integers(0, VOCAB, int(rng.integers(1, 12))).tolist() for _ in range(16)]
    want = generate(params, cfg.model, prompts, 16)
    outs = generate(qparams, cfg.model, prompts, 16)
    identical = sum(a == b for a, b in zip(outs, want))
    print(
        f"int8 vs fp32: max |dlogit|/std {rel.max():.4f}, mean {rel.mean():.5f}; greedy identical {identical}/16"
    )
    assert rel.max() < 0.1 and rel.mean() < 0.02  # measured 0.021 and 0.0037
    assert identical >= 0.75 * len(prompts)  # measured 15/16
    assert np.mean(got.argmax(-1) == ref.argmax(-1)) >= 0.98


def _greedy_full_forward(params, cfg, prompts, n):
    """Greedy tokens by re-running the whole causal forward per step, all prompts in one right-padded
    batch (causal attention keeps each row blind to the padding after it)."""
    width = max(map(len, prompts)) + n
    forward = jax.jit(lambda toks: logits(params, toks, cfg))
    seqs = [list(p) for p in prompts]
    for _ in range(n):
        out = forward(jnp.asarray([s + [0] * (width - len(s)) for s in seqs]))
        for b, s in enumerate(seqs):
            s.append(int(jnp.argmax(out[b, len(s) - 1])))
    return [s[len(p) :] for s, p in zip(seqs, prompts)]


@pytest.mark.parametrize("config", ["tiny", "moe-tiny"])
def test_quantized_generator_on_both_decode_paths(config):
    """Dense models decode with cpu_decode (int8 gate|up, q|k|v and head), MoE models with
    forward_cached: both give the full forward's greedy tokens on the same int8 weights."""
    cfg = load_config(config).model
    params = quantize.quantize_params(jax.tree.map(jnp.asarray, noisy_params(cfg, 2, 1, 0.2)), cfg)
    engine = engine_for(params, cfg, PROMPTS, 8)
    if config == "tiny":
        assert cpu_decode.supported(params, cfg) and engine.uses_cpu_decode
        layer = engine.decode_weights.layers[0]
        assert quant.is_quantized(layer.gate_up) and quant.is_quantized(layer.attn.qkv)
        assert quant.is_quantized(engine.decode_weights.head)
        assert decode_compiler_options(params) == {
            "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"
        }
    else:
        assert not cpu_decode.supported(params, cfg) and engine.decode_weights is engine.params
        assert not quant.is_quantized(params.moe_blocks.moe.w_gate)  # experts stay fp32
    assert complete(engine, PROMPTS, 8) == _greedy_full_forward(params, cfg, PROMPTS, 8)


def test_cpu_decode_step_on_int8_weights_equals_forward_cached():
    from shipyard.inference.decode import forward_cached, init_cache

    cfg = load_config("tiny").model
    params = quantize.quantize_params(jax.tree.map(jnp.asarray, noisy_params(cfg, 3, 2, 0.2)), cfg)
    tokens = jnp.asarray([[5, 17, 99], [0, 42, 8]])
    start = jnp.asarray([0, 1], jnp.int32)
    _, cache = forward_cached(params, tokens, init_cache(cfg, 2, 8), 0, start, cfg)
    step = jnp.asarray([[3], [77]], jnp.int32)
    want, _ = jax.jit(partial(forward_cached, cfg=cfg))(params, step, cache, np.int32(3), start)
    weights = jax.jit(partial(cpu_decode.prepare_weights, cfg=cfg))(params)
    got, _ = jax.jit(partial(cpu_decode.decode_step, cfg=cfg))(
        weights, step, cpu_decode.to_layer_caches(cache), np.int32(3), start
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("quantized", [False, True])
def test_bfloat16_kv_cache_keeps_greedy_output(trained, quantized):
    cfg, params = trained
    if quantized:
        params = quantize.quantize_params(params, cfg.model)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, VOCAB, int(rng.integers(1, 12))).tolist() for _ in range(16)]
    engine = engine_for(params, cfg.model, prompts, 16, kv_dtype="bfloat16")
    assert {leaf.dtype for leaf in jax.tree.leaves(engine._caches)} == {jnp.dtype(jnp.bfloat16)}
    want = generate(params, cfg.model, prompts, 16)
    identical = sum(a == b for a, b in zip(complete(engine, prompts, 16), want))
    print(f"bf16 KV cache (int8 weights: {quantized}): greedy identical {identical}/16")
    assert identical >= 0.75 * len(prompts)


def test_bfloat16_kv_cache_on_forward_cached():
    cfg = load_config("moe-tiny").model
    params = jax.tree.map(jnp.asarray, noisy_params(cfg, 2, 1, 0.2))
    got = generate(params, cfg, PROMPTS, 6, engine_options={"kv_dtype": jnp.bfloat16})
    assert [len(t) for t in got] == [6, 6, 6]
    assert Engine(params, cfg, max_batch=1, max_len=16).kv_dtype == jnp.float32


@pytest.fixture(scope="module")
def run_dir(trained, tmp_path_factory):
    """The trained model as a run directory with a tokenizer (trained on pseudo-word prose) and token shards."""
    from data_fixtures import prose, write_jsonl

    from shipyard.config import to_yaml
    from shipyard.data.configs import ReadConfig, TokenizeConfig, TokenizerTrainConfig
    from shipyard.data.tokenize import run_tokenize
    from shipyard.data.tokenizer import run_tokenizer_train
    from shipyard.model.transformer import param_specs
    from shipyard.run.checkpoint import Checkpointer
    from shipyard.train.optim import build_optimizer
    from shipyard.train.step import init_state

    cfg, params = trained
    d = tmp_path_factory.mktemp("quantize")
    docs = write_jsonl(d / "docs.jsonl", [prose(s, words=120) for s in range(12)])
    run = d / "run"
    run_tokenizer_train([str(docs)], run / "tokenizer", TokenizerTrainConfig(vocab_size=400), ReadConfig())
    run_tokenize([str(docs)], d / "shards", run / "tokenizer", TokenizeConfig(), ReadConfig(), workers=1)
    state = init_state(cfg, params, build_optimizer(cfg.train, param_specs(cfg.model)))
    (run / "config.yaml").write_text(to_yaml(cfg))
    ckpt = Checkpointer(run, cfg.train.checkpoint, cfg.train.steps)
    ckpt.save(1, state, wait=True)
    ckpt.close()
    return run, d / "shards"


@pytest.fixture
def generators(monkeypatch):
    """Records (int8 weights?, KV dtype) of every generation engine the commands build."""
    import shipyard.inference.engine as engine

    made = []

    class Recording(engine.Engine):
        def __init__(self, params, cfg, **kw):
            super().__init__(params, cfg, **kw)
            made.append((quant.is_quantized(params.blocks.wq), self.kv_dtype))

    monkeypatch.setattr(engine, "Engine", Recording)
    return made


def test_generate_cli_with_int8_weights_and_a_bfloat16_cache(trained, run_dir, capsys, generators):
    from shipyard.cli.main import main
    from shipyard.data.tokenizer import load_tokenizer

    cfg, params = trained
    run, _ = run_dir
    tok = load_tokenizer(run / "tokenizer")
    prompts = ["Kabel lodor", "Mi"]
    ids = [tok.encode(p, add_special_tokens=False).ids for p in prompts]
    qparams = quantize.quantize_params(params, cfg.model)
    outs = generate(qparams, cfg.model, ids, 6, engine_options={"kv_dtype": "bfloat16"})
    want = [tok.decode(t, skip_special_tokens=False) for t in outs]
    args = ["generate", str(run), "--max-new-tokens", "6", "--quantize", "int8", "--kv-dtype", "bfloat16"]
    capsys.readouterr()
    assert main([*args, "--prompt", prompts[0], "--prompt", prompts[1]]) == 0
    out = capsys.readouterr().out
    for prompt, text in zip(prompts, want):
        assert f"--- {prompt!r}\n{prompt}{text}\n" in out
    assert generators[-1] == (True, jnp.dtype(jnp.bfloat16))
    assert main(["generate", str(run), "--max-new-tokens", "2", "--prompt", "Mi"]) == 0
    assert generators[-1] == (False, jnp.dtype(jnp.float32))  # the defaults: as stored


def test_chat_cli_builds_its_generator_with_the_flags(run_dir, monkeypatch, generators, capsys):
    import io

    from shipyard.cli.main import main

    run, _ = run_dir
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # the conversation ends at once (EOF)
    assert main(["chat", str(run), "--quantize", "int8", "--kv-dtype", "bfloat16"]) == 0
    assert generators == [(True, jnp.dtype(jnp.bfloat16))]


@pytest.mark.parametrize(
    "argv, bad",
    [
        (["generate", "RUN", "--prompt", "x", "--quantize", "int4"], "int4"),
        (["generate", "RUN", "--prompt", "x", "--kv-dtype", "float16"], "float16"),
        (["chat", "RUN", "--quantize", "fp8"], "fp8"),
        (["eval", "RUN", "--quantize", "int2"], "int2"),
    ],
)
def test_bad_quantize_and_kv_dtype_values_are_one_line_errors(run_dir, capsys, argv, bad):
    from shipyard.cli.main import main

    run, _ = run_dir
    assert main([str(run) if a == "RUN" else a for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and bad in err and ("--quantize" in err or "--kv-dtype" in err)


def test_eval_cli_with_int8_weights(run_dir, tmp_path, capsys):
    from shipyard.cli.main import main

    run, shards = run_dir
    losses = {}
    for mode in ("fp32", "int8"):
        out = tmp_path / f"{mode}.json"
        flags = ["--quantize", "int8"] if mode == "int8" else []
        assert (
            main(
                [
                    "eval",
                    str(run),
                    "--tokens",
                    f"prose={shards}",
                    "--max-sequences",
                    "4",
                    "--out",
                    str(out),
                    *flags,
                ]
            )
            == 0
        )
        losses[mode] = json.loads(out.read_text())["domains"]["prose"]["loss"]
    # close, and not identical: the flag really scored the int8 weights
    assert 0 < abs(losses["int8"] - losses["fp32"]) < 0.01 * losses["fp32"]


def test_quantize_params_keeps_what_it_should_and_refuses_unknown_modes():
    cfg = load_config("tiny", ["model.qkv_bias=true", "model.qk_norm=true"]).model
    params = jax.tree.map(jnp.asarray, noisy_params(cfg, 1, 1, 0.1))
    q = quantize.quantize_params(params, cfg, head=False)
    for name in quant.BLOCK_WEIGHTS:
        assert quant.is_quantized(getattr(q.blocks, name))
    for name in ("attn_norm", "mlp_norm", "q_norm", "k_norm", "bq", "bk", "bv"):
        assert getattr(q.blocks, name) is getattr(params.blocks, name)
    assert q.lm_head is params.lm_head and q.embed is params.embed and q.final_norm is params.final_norm
    again = quantize.quantize_params(q, cfg)  # already-quantized weights are left as they are
    assert again.blocks.wq is q.blocks.wq and quant.is_quantized(again.lm_head)
    assert dataclasses.replace(quantize.maybe_quantize(params, cfg, None)) == params
    with pytest.raises(ValueError, match="int8"):
        quantize.maybe_quantize(params, cfg, "int4")
    with pytest.raises(ValueError, match="embedding"):  # the decode steps' lookups take arrays only
        Engine(quantize.quantize_params(params, cfg, embed=True), cfg, max_batch=1, max_len=16)


# ----------------------------------------------------------------------------- group-wise scales (int8-g128)


def _group_scales(w: np.ndarray, in_axes: tuple[int, ...], g: int) -> np.ndarray:
    """What group-wise scales mean, by numpy: the input axes moved to the front and flattened, cut into
    runs of g consecutive inputs, largest |w| / 127 per run and output position -> [n_in / g, *rest]."""
    front = np.moveaxis(w, in_axes, tuple(range(len(in_axes))))
    flat = front.reshape(-1, *front.shape[len(in_axes) :])
    return np.abs(flat).reshape(-1, g, *flat.shape[1:]).max(axis=1) / 127


@pytest.mark.parametrize(
    "shape, in_axes, group_size",
    [
        ((512, 48), (0,), 128),  # [in, out]
        ((3, 256, 4, 16), (1,), 128),  # a wq stack
        ((3, 4, 64, 256), (1, 2), 128),  # a wo stack, head_dim 64: two heads per group
        ((2, 12, 32, 40), (1, 2), 128),  # head_dim 32: four heads per group
        ((576, 40), (0,), 96),  # 576 = 4.5 x 128: the largest divisor in [64, 128]
        ((131, 8), (0,), None),  # no divisor in [64, 128]: per channel
        ((100, 8), (0,), None),  # at most 128 inputs: per channel
    ],
)
def test_group_wise_round_trip_error_is_at_most_half_a_step_per_group(shape, in_axes, group_size):
    rng = np.random.default_rng(5)
    w = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 2.0, shape[-1])
    w[..., 0] = 0.0  # an all-zero channel stays exactly zero
    qw = quant.quantize(jnp.asarray(w), in_axes, group=128)
    factors = quant.group_factors(shape, in_axes, 128)
    assert (factors and int(np.prod(list(factors.values())))) == (group_size or None)
    g = group_size or int(np.prod([shape[a] for a in in_axes]))
    want = _group_scales(w, in_axes, g)
    got = np.asarray(qw.scale)
    got = np.moveaxis(got, in_axes, tuple(range(len(in_axes)))).reshape(want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-6)  # one scale per run of g consecutive inputs
    step = np.asarray(quant.expand_scale(qw.scale, shape))
    err = np.abs(np.asarray(quant.dequantize(qw)) - w)
    assert np.all(err <= step / 2 * (1 + 1e-6))
    # each group's largest |w| maps to +-127: the whole int8 range is used in every group
    q = np.abs(np.asarray(qw.q)).astype(np.float32)
    assert np.all(_group_scales(q, in_axes, g)[..., 1:] * 127 == 127)
    assert not np.any(np.asarray(qw.q)[..., 0])


def test_group_wise_error_is_at_most_the_per_channel_error_on_a_weight_with_outlier_rows():
    """An input row 30x larger than the rest (the embedding dimension a trained model's residual stream
    blows up) sets every column's per-channel scale; group-wise it costs its own group only."""
    rng = np.random.default_rng(6)
    w = rng.standard_normal((512, 64)).astype(np.float32) * 0.02
    w[5] = rng.choice([-1.0, 1.0], 64) * 1.8  # 30x the others' typical largest |w| (3 sigma)
    per_channel = quant.quantize(jnp.asarray(w), (0,))
    grouped = quant.quantize(jnp.asarray(w), (0,), group=128)
    err_c = np.abs(np.asarray(quant.dequantize(per_channel)) - w)
    err_g = np.abs(np.asarray(quant.dequantize(grouped)) - w)
    assert np.all(err_g.max(axis=0) <= err_c.max(axis=0))  # per column, the worst element
    # the group holding the outlier row rounds exactly as per channel; the other three far finer
    np.testing.assert_array_equal(err_g[:128], err_c[:128])
    ratio = float(np.sqrt((err_g[128:] ** 2).mean() / (err_c[128:] ** 2).mean()))
    print(f"an outlier row: rms error of the other groups, group-wise / per channel = {ratio:.3f}")
    assert ratio < 0.1
    x = rng.standard_normal((8, 512)).astype(np.float32)
    out_err_c = np.abs(x @ np.asarray(quant.dequantize(per_channel)) - x @ w).mean()
    out_err_g = np.abs(x @ np.asarray(quant.dequantize(grouped)) - x @ w).mean()
    assert out_err_g < 0.5 * out_err_c


def test_group_wise_matmul_and_forward_match_the_dequantized_fp32_weights(trained):
    """Both matmul formulations, then the whole forward (fused q|k|v and gate|up, the head) on group-wise
    weights against the same forward on their dequantized fp32 copy: only int8_dot's activation
    rounding (about 1/32000 of a row's largest value) separates them."""
    rng = np.random.default_rng(7)
    w = quant.quantize(jnp.asarray(rng.standard_normal((384, 40)).astype(np.float32)), (0,), group=128)
    assert quant.groups(w) == 3
    x = jnp.asarray(
        rng.standard_normal((5, 384)).astype(np.float32) * np.array([[1], [100], [1e-3], [0], [3]])
    )
    want = np.asarray(x @ quant.dequantize(w))
    scale = np.abs(want).max(axis=1, keepdims=True) + 1e-30
    for dot in (quant.int8_dot, quant.dequantized_dot):
        assert np.all(np.abs(np.asarray(dot(x, w)) - want) <= 1e-4 * scale), dot.__name__
    cfg, params = trained
    qparams = quantize.quantize_params(params, cfg.model, group=32)
    assert quant.groups(qparams.lm_head) == 2 and qparams.blocks.w_down.scale.shape[1] == 6
    deq = quant.dequantize_params(qparams)
    tokens = jnp.asarray(rng.integers(0, VOCAB, (4, 48)))
    got, ref = np.asarray(logits(qparams, tokens, cfg.model)), np.asarray(logits(deq, tokens, cfg.model))
    rel = np.abs(got - ref).max() / ref.std()
    print(f"group-wise int8 vs its dequantized fp32 weights: max |dlogit|/std {rel:.2e}")
    assert rel < 1e-3
    fp32 = np.asarray(logits(params, tokens, cfg.model))
    assert np.abs(got - fp32).max() / fp32.std() > 10 * rel  # the weights' own rounding dominates


def test_engine_greedy_on_group_wise_weights_equals_the_dequantized_weights(trained):
    """Engine.generate (the CPU decode step: q|k|v and gate|up fused from group-wise matrices, the
    group-wise head) gives the greedy tokens of the same engine on the dequantized fp32 weights."""
    cfg, params = trained
    qparams = quantize.quantize_params(params, cfg.model, group=32)
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, VOCAB, int(rng.integers(1, 12))).tolist() for _ in range(16)]
    engine = engine_for(qparams, cfg.model, prompts, 16)
    assert engine.uses_cpu_decode
    layer = engine.decode_weights.layers[0]
    assert quant.groups(layer.gate_up) == 2 and quant.groups(engine.decode_weights.head) == 2
    assert quant.groups(layer.down) == 6 and layer.attn.qkv.scale.shape[0] == 2
    got = complete(engine, prompts, 16)
    want = generate(quant.dequantize_params(qparams), cfg.model, prompts, 16)
    assert got == want


def test_quantize_modes_are_the_flags_choices(capsys):
    from shipyard.cli.main import main

    assert quantize.QUANTIZE_MODES == ("int8", "int8-g128")
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for mode in quantize.QUANTIZE_MODES:
        assert f"{mode} with one" in help_text


def test_generate_and_eval_clis_take_int8_g128(trained, run_dir, tmp_path, capsys, monkeypatch):
    """`--quantize int8-g128` reaches the engine of `generate` (tiny's 192-wide w_down inputs: two groups
    of 96) and the weights `eval` scores."""
    import shipyard.inference.engine as engine
    from shipyard.cli.main import main
    from shipyard.data.tokenizer import load_tokenizer

    made = []

    class Recording(engine.Engine):
        def __init__(self, params, cfg, **kw):
            super().__init__(params, cfg, **kw)
            made.append(params.blocks.w_down.scale.shape[1])

    monkeypatch.setattr(engine, "Engine", Recording)
    cfg, params = trained
    run, shards = run_dir
    tok = load_tokenizer(run / "tokenizer")
    ids = tok.encode("Kabel lodor", add_special_tokens=False).ids
    outs = generate(quantize.quantize_params(params, cfg.model, group=128), cfg.model, [ids], 6)
    capsys.readouterr()
    assert (
        main(
            [
                "generate",
                str(run),
                "--max-new-tokens",
                "6",
                "--quantize",
                "int8-g128",
                "--prompt",
                "Kabel lodor",
            ]
        )
        == 0
    )
    assert f"Kabel lodor{tok.decode(outs[0], skip_special_tokens=False)}\n" in capsys.readouterr().out
    assert made[-1] == 2
    losses = {}
    for mode in ("int8", "int8-g128"):
        out = tmp_path / f"{mode}.json"
        argv = ["eval", str(run), "--tokens", f"prose={shards}", "--max-sequences", "4", "--out", str(out)]
        assert main([*argv, "--quantize", mode]) == 0
        losses[mode] = json.loads(out.read_text())["domains"]["prose"]["loss"]
    # close, and not identical: the flag really scored other weights than per-channel int8's
    assert 0 < abs(losses["int8-g128"] - losses["int8"]) < 0.01 * losses["int8"]
