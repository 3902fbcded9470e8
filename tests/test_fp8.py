"""fp8 training matmuls (model/fp8.py): the emulation on CPU equals a float64 reference of the same
quantise-dequantise, gradients included; the tiny preset trains with fp8 as with bf16 within a stated
bound; XLA:GPU compiles them as fp8 GEMMs for an H100 and a TPU refuses them (tests/test_targets.py)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from shipyard.config import load_config
from shipyard.model import fp8

# Heavy compiles and end-to-end runs: the `make test-slow` tier (docs/testing.md: tiers).
pytestmark = pytest.mark.slow


def _quantized(a, dtype, largest):
    """float64 reference of fp8.quantize: (the dequantized values, the scale)."""
    a = np.asarray(a, np.float32)
    scale = np.float32(largest / np.abs(a).max())
    q = np.clip(a * scale, -largest, largest).astype(dtype)
    return q.astype(np.float64) / np.float64(scale), scale


def test_the_forward_is_the_fp8_quantised_product_exactly():
    x = jax.random.normal(jax.random.key(0), (3, 8, 48), jnp.float32) * 3
    w = jax.random.normal(jax.random.key(1), (48, 24), jnp.float32) * 0.05
    got = np.asarray(fp8.matmul(x, fp8.FP8Weight(w)), np.float64)
    xq, _ = _quantized(x, ml_dtypes.float8_e4m3fn, 448.0)
    wq, _ = _quantized(w, ml_dtypes.float8_e4m3fn, 448.0)
    want = xq @ wq
    # products of e4m3 values are exact in fp32; what is left is fp32 accumulation
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    # and it is not the unquantised product: e4m3 keeps 3 mantissa bits
    plain = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert np.abs(plain - want).max() > 1e-3 * np.abs(want).max()


def test_the_gradients_use_e5m2_output_gradients_and_the_saved_e4m3_operands():
    x = jax.random.normal(jax.random.key(2), (2, 16, 32), jnp.float32)
    w = jax.random.normal(jax.random.key(3), (32, 8), jnp.float32) * 0.1
    c = jax.random.normal(jax.random.key(4), (2, 16, 8), jnp.float32)  # dL/dy = c exactly
    dx, dw = jax.grad(lambda x, w: jnp.sum(fp8.matmul(x, w) * c), (0, 1))(x, fp8.FP8Weight(w))
    xq, _ = _quantized(x, ml_dtypes.float8_e4m3fn, 448.0)
    wq, _ = _quantized(w, ml_dtypes.float8_e4m3fn, 448.0)
    gq, _ = _quantized(c, ml_dtypes.float8_e5m2, 57344.0)
    np.testing.assert_allclose(np.asarray(dx, np.float64), gq @ wq.T, rtol=1e-5, atol=1e-6)
    want_dw = np.einsum("bti,bto->io", xq, gq)
    np.testing.assert_allclose(np.asarray(dw.w, np.float64), want_dw, rtol=1e-5, atol=1e-5)


def test_an_all_zero_tensor_quantises_to_zero():
    q, scale = fp8.quantize(jnp.zeros((4, 4)), fp8.E4M3, fp8.E4M3_MAX)
    assert float(scale) == 1.0 and not np.any(np.asarray(q, np.float32))


def test_fp8_marks_the_block_matmuls_and_only_those():
    from shipyard.model import transformer
    from shipyard.model.params import abstract_params
    from shipyard.train.step import matmul_params

    cfg = load_config("tiny", ["train.precision=fp8"])
    assert cfg.train.precision.compute_dtype == "bfloat16" and cfg.train.precision.matmul == "fp8"
    p = matmul_params(abstract_params(transformer.param_specs(cfg.model)), cfg.train.precision)
    b = p.blocks
    assert all(fp8.is_fp8(getattr(b, k)) for k in fp8.WRAPPED)
    assert not fp8.is_fp8(p.embed) and not fp8.is_fp8(p.lm_head) and not fp8.is_fp8(b.attn_norm)


def test_a_precision_name_that_is_not_one_is_refused():
    from shipyard.errors import ConfigError

    with pytest.raises(
        ConfigError, match="precision: 'fp4' is not a precision; expected fp32, bf16, fp16, fp8"
    ):
        load_config("tiny", ["train.precision=fp4"])


def _losses(precision: str, steps: int) -> list[float]:
    from shipyard.model.params import init_params
    from shipyard.model.transformer import param_specs
    from shipyard.train.optim import build_optimizer
    from shipyard.train.step import init_state, make_train_step

    cfg = load_config(
        "tiny",
        [f"train.precision={precision}", "train.global_batch_size=8", "data.seq_len=64",
         "train.schedule.warmup_steps=0", "train.optimizer.lr=3e-3"],
    )  # fmt: skip
    specs = param_specs(cfg.model)
    opt = build_optimizer(cfg.train, specs)
    state = init_state(cfg, init_params(specs, jax.random.key(0)), opt)
    step = jax.jit(make_train_step(cfg, opt))
    # a learnable stream: each row counts up modulo the vocabulary from a random start
    starts = np.random.default_rng(0).integers(0, 256, (steps, 8, 1))
    out = []
    for i in range(steps):
        toks = jnp.asarray((starts[i] + np.arange(65)) % 256, jnp.int32)
        state, m = step(state, {"tokens": toks, "loss_mask": jnp.ones((8, 64), jnp.float32)})
        out.append(float(m["loss"]))
    return out


def test_the_tiny_preset_learns_with_fp8_as_with_bf16():
    steps = 40
    bf16, f8 = _losses("bf16", steps), _losses("fp8", steps)
    assert f8[-1] < 0.5 * f8[0]  # it learns
    # the stated bound: every step's loss within 2% of bf16's (measured: 0.32% at most)
    rel = np.abs(np.array(f8) - np.array(bf16)) / np.array(bf16)
    assert rel.max() < 0.02, rel
    assert f8 != bf16  # and it is not the bf16 run under another name
