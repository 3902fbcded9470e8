"""NF4 (QLoRA's 4-bit base): the codec equals bitsandbytes', the weights' matmul, the quantized frozen base."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_fixtures import noisy_params

from shipyard.config import FinetuneConfig, LoraConfig, load_config
from shipyard.errors import ConfigError
from shipyard.model import nf4, quant
from shipyard.model.partition import Partition
from shipyard.model.transformer import logits

# Heavy compiles and end-to-end runs: the `make test-slow` tier (docs/testing.md: tiers).
pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
bnb = pytest.importorskip("bitsandbytes.functional")

# The NF4 data type as printed in the QLoRA paper (Dettmers et al. 2023, appendix E), to 4 decimals.
PUBLISHED = [-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0]
PUBLISHED += [0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0]
ALL = ["q", "k", "v", "o", "gate", "up", "down"]


def test_codebooks_equal_bitsandbytes_and_the_published_values():
    assert np.array_equal(nf4.NF4_CODE, bnb.get_4bit_type("nf4", device="cpu").numpy())
    np.testing.assert_allclose(nf4.NF4_CODE, PUBLISHED, atol=5e-5)
    # double quantization's 8-bit map, bit for bit
    assert np.array_equal(nf4.dynamic_code(), bnb.create_dynamic_map().numpy())


def _weight(out, inp, seed=0):
    return np.random.default_rng(seed).standard_normal((out, inp)).astype(np.float32)


@pytest.mark.parametrize("block", [64, 32])
def test_quantize_equals_bitsandbytes_on_the_torch_weight(block):
    """Ours on W [in, out] (blocks along the input axis per output channel) is bitsandbytes' quantize_4bit
    on the torch weight W^T [out, in]: the same packed bytes and absmax; dequantized, the same weights."""
    w_torch = _weight(96, 128)
    packed, state = bnb.quantize_4bit(torch.tensor(w_torch), blocksize=block, quant_type="nf4")
    ours = nf4.quantize(jnp.asarray(w_torch.T), (0,), block)
    assert ours.codes.dtype == jnp.uint8 and ours.codes.shape == (64, 96)  # two codes a byte
    assert np.array_equal(np.asarray(ours.codes).T.reshape(-1), packed.numpy().reshape(-1))
    assert np.array_equal(np.asarray(ours.absmax).T.reshape(-1), state.absmax.numpy())
    want = bnb.dequantize_4bit(packed, state).numpy()
    assert np.array_equal(np.asarray(nf4.dequantize(ours)).T, want)
    # a flat vector with a last, shorter block
    flat = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    p, s = bnb.quantize_4bit(torch.tensor(flat), blocksize=block, quant_type="nf4")
    ours_p, ours_a = nf4.quantize_flat(jnp.asarray(flat), block)
    assert np.array_equal(np.asarray(ours_p), p.numpy().reshape(-1))
    assert np.array_equal(np.asarray(ours_a), s.absmax.numpy())
    assert np.array_equal(
        np.asarray(nf4.dequantize_flat(ours_p, ours_a, block)), bnb.dequantize_4bit(p, s).numpy().reshape(-1)
    )


def test_blocks_span_heads_of_a_multi_axis_input_as_on_the_flattened_torch_weight():
    """wo [heads, head_dim, embed] with head_dim 16 < block 64: a block spans 4 heads, as bitsandbytes'
    blocks on o_proj [embed, heads * head_dim] do."""
    w = np.random.default_rng(2).standard_normal((8, 16, 48)).astype(np.float32)
    packed, state = bnb.quantize_4bit(
        torch.tensor(w.reshape(128, 48).T.copy()), blocksize=64, quant_type="nf4"
    )
    ours = nf4.quantize(jnp.asarray(w), (0, 1), 64)
    assert ours.codes.shape == (8, 8, 48) and ours.absmax.shape == (2, 1, 48)
    assert np.array_equal(np.asarray(ours.codes).reshape(64, 48).T.reshape(-1), packed.numpy().reshape(-1))
    assert np.array_equal(np.asarray(ours.absmax).reshape(2, 48).T.reshape(-1), state.absmax.numpy())
    want = bnb.dequantize_4bit(packed, state).numpy().T.reshape(8, 16, 48)
    assert np.array_equal(np.asarray(nf4.dequantize(ours)), want)


def _near_a_midpoint(values, code, frac=0.01):
    """Where a scaled value lies within `frac` of a code gap from a midpoint between two code values."""
    mids, gaps = (code[:-1] + code[1:]) / 2, np.diff(code)
    i = np.clip(np.searchsorted(mids, values), 1, len(mids) - 1)
    near = [np.abs(values - mids[j]) < frac * gaps[j] for j in (i - 1, i)]
    return near[0] | near[1]


@pytest.mark.parametrize("block", [64, 128])
def test_double_quantization_equals_bitsandbytes_compress_statistics(block):
    """The absmax as 8-bit codes of the dynamic map in blocks of 256 after subtracting their mean.

    Decoding bitsandbytes' own double-quantized state with ours gives its dequantize_4bit bit for bit.
    Encoding: the same offset and block scales up to torch's fp32 summation order (an ulp), and the
    same 8-bit codes except where a value lies within 1% of a code gap of a midpoint, where
    bitsandbytes' CPU kernel (a binary search) rounds either way: there the codes are neighbours."""
    w_torch = _weight(256, 512, seed=3)  # 2048 absmax values: 8 blocks of 256
    packed, state = bnb.quantize_4bit(
        torch.tensor(w_torch), blocksize=block, quant_type="nf4", compress_statistics=True
    )
    theirs = nf4.NF4Matrix(
        codes=jnp.asarray(packed.numpy().reshape(256, -1).T),
        absmax=jnp.asarray(state.absmax.numpy().reshape(256, -1).T),
        absmax2=jnp.asarray(state.state2.absmax.numpy()),
        offset=jnp.asarray(state.offset.numpy()),
        out_ndim=1,
        block=block,
    )
    assert np.array_equal(np.asarray(nf4.dequantize(theirs)).T, bnb.dequantize_4bit(packed, state).numpy())
    ours = nf4.quantize(jnp.asarray(w_torch.T), (0,), block, double_quant=True)
    assert np.array_equal(np.asarray(ours.codes), np.asarray(theirs.codes))
    np.testing.assert_allclose(np.asarray(ours.offset), state.offset.numpy(), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(ours.absmax2), state.state2.absmax.numpy(), rtol=1e-6)
    q_ours, q_theirs = np.asarray(ours.absmax).T.reshape(-1), state.absmax.numpy()
    _, plain = bnb.quantize_4bit(torch.tensor(w_torch), blocksize=block, quant_type="nf4")
    scaled = (plain.absmax.numpy() - state.offset.numpy()).reshape(-1, 256) / state.state2.absmax.numpy()[
        :, None
    ]
    differ = q_ours != q_theirs
    assert differ.mean() < 0.01 and np.all(_near_a_midpoint(scaled.reshape(-1)[differ], nf4.dynamic_code()))
    assert np.all(np.abs(q_ours.astype(int) - q_theirs.astype(int)) <= 1)


def test_packing_round_trips_and_halves_the_bytes():
    codes = jnp.asarray(np.random.default_rng(4).integers(0, 16, (6, 10)), jnp.uint8)
    packed = nf4.pack(codes)
    assert packed.shape == (6, 5) and packed.dtype == jnp.uint8
    assert np.array_equal(np.asarray(nf4.unpack(packed)), np.asarray(codes))
    assert int(packed[0, 0]) == int(codes[0, 0]) * 16 + int(codes[0, 1])  # the first code: high nibble


def test_nf4_matmul_is_the_dot_with_the_dequantized_weight_and_differentiates_in_x():
    w = nf4.quantize(jnp.asarray(_weight(128, 96, seed=5)), (0,), 64, double_quant=True)
    x = jnp.asarray(np.random.default_rng(6).standard_normal((3, 7, 128)), jnp.float32)
    dense = nf4.dequantize(w)
    np.testing.assert_allclose(nf4.matmul(x, w), x @ dense, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose((x @ w), x @ dense, rtol=1e-5, atol=1e-5)  # `@` on an NF4Matrix
    g = jax.grad(lambda x: jnp.sum(jnp.sin(nf4.matmul(x, w))))(x)
    want = jax.grad(lambda x: jnp.sum(jnp.sin(x @ dense)))(x)
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5)
    # in the compute dtype: the weight is dequantized to bf16 inside the dot
    y = nf4.matmul(x.astype(jnp.bfloat16), w)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), x @ dense, rtol=0.05, atol=0.1)


def test_int8_matmul_differentiates_in_x_through_the_dequantized_weight():
    """The int8 base's CPU dot rounds the activations (zero derivative); its custom gradient is
    dy @ dequantize(w)^T, as QLoRA's backward pass through a frozen int8 weight needs."""
    w = quant.quantize(jnp.asarray(_weight(128, 96, seed=7)), (0,))
    x = jnp.asarray(np.random.default_rng(8).standard_normal((5, 128)), jnp.float32)
    dense, c = (
        quant.dequantize(w),
        jnp.asarray(np.random.default_rng(9).standard_normal((5, 96)), jnp.float32),
    )
    g = jax.grad(lambda x: jnp.sum(quant.matmul(x, w) * c))(x)  # linear: the gradient is c @ w^T exactly
    np.testing.assert_allclose(g, c @ dense.T, rtol=1e-5, atol=1e-5)


def test_compute_params_cast_the_adapters_and_norms_and_leave_the_codes():
    cfg = load_config("tiny").model
    params = jax.tree.map(jnp.asarray, noisy_params(cfg, 0, 2, 0.05))
    part = Partition(cfg, _qlora("nf4", double_quant=True))
    frozen = part.frozen(params)
    p = part.compute_params(part.initial(params, jax.random.key(0)), frozen, jnp.bfloat16)
    assert p.blocks.lora.a["q"].dtype == jnp.bfloat16 and p.blocks.attn_norm.dtype == jnp.bfloat16
    assert p.embed.dtype == jnp.bfloat16
    for got, kept in zip(jax.tree.leaves(p.blocks.wq), jax.tree.leaves(frozen.blocks.wq)):
        assert got.dtype == kept.dtype and np.array_equal(got, kept)  # uint8 codes, fp32 block scales


def _qlora(mode, **kw):
    return FinetuneConfig(lora=LoraConfig(rank=4, alpha=8.0, targets=ALL), quantize_base=mode, **kw)


@pytest.mark.parametrize("mode", ["nf4", "int8"])
def test_qlora_forward_is_the_dequantized_model_and_near_the_unquantized_one(mode):
    """The QLoRA forward (codes dequantized inside each matmul, layout changes applied to the codes) is
    exactly the model with the dequantized weights (1e-5); and it stays near the unquantized model:
    for Gaussian weights NF4's blockwise rounding is ~9% relative RMS per weight (int8 per channel:
    ~0.6%), which through this untrained 2-layer model moves the logits by < 25% (int8: < 2%) of their
    RMS spread. Those are the stated tolerances."""
    cfg = load_config("tiny").model
    params = jax.tree.map(jnp.asarray, noisy_params(cfg, 0, 2, 0.05))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 24)))
    part = Partition(cfg, _qlora(mode))
    frozen = part.frozen(params)
    run = jax.jit(lambda p: logits(p, tokens, cfg))
    assert isinstance(frozen.blocks.wq, nf4.NF4Matrix if mode == "nf4" else quant.QuantizedMatrix)
    assert not quant.is_any_quantized(frozen.embed) and frozen.blocks.attn_norm.dtype == jnp.float32
    q = run(part.merge(part.initial(params, jax.random.key(0)), frozen))
    np.testing.assert_allclose(q, run(quant.dequantize_params(frozen)), atol=1e-5 if mode == "nf4" else 2e-4)

    def rel(a, b):
        return float(jnp.sqrt(jnp.mean((a - b) ** 2) / jnp.mean((b - b.mean(-1, keepdims=True)) ** 2)))

    weight_err = rel(quant.dequantize_any(frozen.blocks.w_up), params.blocks.w_up)
    base = run(params)
    assert weight_err < (0.1 if mode == "nf4" else 0.01)
    assert 0 < rel(q, base) < (0.25 if mode == "nf4" else 0.02)


def test_quantizing_the_base_is_deterministic_and_a_bad_block_is_one_line():
    cfg = load_config("tiny").model
    params = jax.tree.map(jnp.asarray, noisy_params(cfg, 0, 2, 0.05))
    part = Partition(cfg, _qlora("nf4", double_quant=True))
    a, b = part.frozen(params), part.frozen(jax.tree.map(jnp.copy, params))
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    with pytest.raises(ConfigError, match=r"train.finetune.quant_block: 48 does not fit"):
        Partition(cfg, _qlora("nf4", quant_block=48)).frozen_specs()


def test_the_step_takes_the_codes_and_never_the_fp32_base():
    """The train step's frozen arguments are the NF4 codes and scales: no fp32 block weight reaches it,
    so there is nothing a step could re-quantize (quantization happens once, in Partition.frozen)."""
    from shipyard.train.program import build_program

    cfg = load_config(
        "tiny", ["train.finetune={lora: {rank: 4}, quantize_base: nf4}", "train.global_batch_size=8"]
    )
    program = build_program(cfg)
    frozen = program.abstract_frozen
    assert frozen.blocks.wq.codes.dtype == jnp.uint8 and frozen.blocks.wq.codes.shape == (2, 32, 4, 16)
    state, batch, frozen_args = program.lower_train_step().args_info[0][:3]
    args = [(a.shape, a.dtype) for a in jax.tree.leaves(frozen_args)]
    assert ((2, 32, 4, 16), jnp.uint8) in args  # the wq codes are the step's argument
    assert not any(
        dtype == jnp.float32 and shape == (2, 64, 4, 16) for shape, dtype in args
    )  # fp32 wq is not
    quantized = [a for a in jax.tree.leaves(frozen_args) if a.dtype == jnp.uint8]
    assert len(quantized) == 7  # codes of wq, wk, wv, wo, w_gate, w_up, w_down


def test_plan_counts_the_quantized_base():
    """`shipyard plan` for llama3-8b QLoRA: the attention + MLP weights at 0.5 B codes + 4 B / 64 absmax
    = 0.5625 B/param (double quantization: 0.5 + 1/64 + 4/(64 * 256) + ...), not 4 B."""
    from shipyard.plan import Device, analytic, render

    lora = "train.finetune={lora: {rank: 16, targets: [q, k, v, o, gate, up, down]}"
    sizes = {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1}
    device = Device("h100", 80 * 2**30, 989e12)
    plans = {
        extra: analytic(load_config("llama3-8b", [lora + extra + "}"]), sizes, device, None, 0.4)
        for extra in ("", ", quantize_base: nf4", ", quantize_base: nf4, double_quant: true")
    }
    plain, nf, dq = plans.values()
    q = nf["quantized_base"]
    assert plain["quantized_base"] is None and q["params"] > 0.85 * plain["params_total"]
    assert q["bytes"] / q["params"] == pytest.approx(0.5625, abs=1e-4)
    assert dq["quantized_base"]["bytes"] / q["params"] == pytest.approx(0.5 + 1 / 64 + 4 / 64 / 256, abs=1e-3)
    assert plain["bytes"]["params"] - nf["bytes"]["params"] == pytest.approx(4 * q["params"] - q["bytes"])
    text = render({**nf, "fits": True, "advice": []})
    assert "of which the nf4 base (attention + MLP weights)" in text and "0.562 B/param" in text
