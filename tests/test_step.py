import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shipyard.config import load_config
from shipyard.model.params import init_params
from shipyard.model.transformer import param_specs
from shipyard.train.optim import build_optimizer
from shipyard.train.step import init_state, make_gradient_fn, make_train_step


def _setup(overrides, batch_size=4, seq=32, seed=0):
    cfg = load_config(
        "tiny",
        [
            f"train.global_batch_size={batch_size}",
            f"data.seq_len={seq}",
            "train.schedule.warmup_steps=0",
            *overrides,
        ],
    )
    specs = param_specs(cfg.model)
    opt = build_optimizer(cfg.train, specs)
    state = init_state(cfg, init_params(specs, jax.random.key(seed)), opt)
    step = jax.jit(make_train_step(cfg, opt))
    toks = jax.random.randint(jax.random.key(seed + 1), (batch_size, seq + 1), 0, 256)
    batch = {"tokens": toks, "loss_mask": jnp.ones((batch_size, seq), jnp.float32)}
    return cfg, state, step, batch


def _leaves_equal(a, b):
    return all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def test_fp16_overflow_skips_step_and_lowers_scale():
    cfg, state, step, batch = _setup(
        ["train.precision.compute_dtype=float16", "train.precision.loss_scale_init=1e38"]
    )
    new, m = step(state, batch)
    assert int(m["skipped"]) == 1 and int(new.nonfinite) == 1
    assert _leaves_equal(new.params, state.params)
    assert _leaves_equal(new.opt_state, state.opt_state)
    assert float(new.loss_scale) == pytest.approx(5e37)
    assert int(new.step) == 1  # the data step still advances
    # the scale keeps halving until a step fits, then training proceeds
    s = new
    for _ in range(200):
        s, m = step(s, batch)
        if int(m["skipped"]) == 0:
            break
    assert int(m["skipped"]) == 0 and not _leaves_equal(s.params, state.params)
    assert np.isfinite(float(m["loss"]))


def test_fp16_scale_grows_after_interval():
    cfg, state, step, batch = _setup(
        [
            "train.precision.compute_dtype=float16",
            "train.precision.loss_scale_init=8",
            "train.precision.loss_scale_growth_interval=3",
        ]
    )
    scales = []
    for _ in range(4):
        state, m = step(state, batch)
        scales.append(float(state.loss_scale))
    assert scales == [8, 8, 16, 16]


def test_nonfinite_gradient_skips_update():
    cfg, state, step, batch = _setup([])
    bad = jax.tree.map(lambda x: x, state)
    bad_params = bad.params.__class__(
        **{**vars(bad.params), "final_norm": bad.params.final_norm.at[0].set(jnp.nan)}
    )
    bad = bad.__class__(**{**vars(bad), "params": bad_params})
    new, m = step(bad, batch)
    assert int(m["skipped"]) == 1 and int(m["nonfinite_run"]) == 1
    assert _leaves_equal(new.opt_state, bad.opt_state)
    assert float(m["update_norm"]) == 0.0


def test_grad_accumulation_matches_full_batch():
    cfg1, state, full, batch = _setup([], batch_size=8)
    cfg4, _, accum, _ = _setup(["train.microbatches=4"], batch_size=8)
    g1, s1, _ = jax.jit(make_gradient_fn(cfg1))(state.params, None, batch, 1.0)
    g4, s4, _ = jax.jit(make_gradient_fn(cfg4))(state.params, None, batch, 1.0)
    assert float(s1.ce) == pytest.approx(float(s4.ce), rel=1e-5) and float(s1.tokens) == float(s4.tokens)
    for x, y in zip(jax.tree.leaves(g1), jax.tree.leaves(g4)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-7)
    # and the whole step agrees on the loss and gradient norm
    _, ma = full(state, batch)
    _, mb = accum(state, batch)
    assert float(ma["loss"]) == pytest.approx(float(mb["loss"]), rel=1e-5)
    assert float(ma["grad_norm"]) == pytest.approx(float(mb["grad_norm"]), rel=1e-4)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_metrics_are_sane(dtype):
    cfg, state, step, batch = _setup([f"train.precision.compute_dtype={dtype}", "train.z_loss=1e-4"])
    state, m = step(state, batch)
    assert 0 < float(m["loss"]) < 10 and 0 < float(m["entropy"]) <= np.log(cfg.model.vocab_size) + 1e-3
    assert float(m["grad_norm"]) > 0 and float(m["update_norm"]) > 0 and float(m["z_loss"]) > 0
    assert float(state.params.blocks.wq.dtype.itemsize) == 4  # master weights stay fp32


def test_overfit_one_batch():
    """tiny memorises 4 fixed sequences: loss < 0.1 within a few hundred CPU steps."""
    cfg, state, step, batch = _setup(
        ["train.optimizer.lr=3e-3", "train.schedule.kind=constant", "train.optimizer.weight_decay=0"],
        batch_size=4,
        seq=64,
    )
    losses = []
    for _ in range(300):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
        if losses[-1] < 0.1:
            break
    assert losses[-1] < 0.1, f"loss after {len(losses)} steps: {losses[-1]:.3f}"
    assert losses[0] > 5.0


def test_remat_policies_give_the_same_gradients():
    grads = {}
    for remat in ("none", "full", "save_dots"):
        cfg, state, _, batch = _setup([f"model.remat={remat}", "model.scan_unroll=1"])
        grads[remat] = jax.jit(make_gradient_fn(cfg))(state.params, None, batch, 1.0)[0]
    for other in ("full", "save_dots"):
        for x, y in zip(jax.tree.leaves(grads["none"]), jax.tree.leaves(grads[other])):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)


def test_muon_trains():
    cfg, state, step, batch = _setup(
        ["train.optimizer.name=muon", "train.optimizer.lr=0.02", "train.optimizer.muon_adam_lr=3e-3"]
    )
    losses = []
    for _ in range(30):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0] - 1.0, losses[::5]


def test_document_masking_stops_attention_at_eos():
    from shipyard.model.transformer import logits as model_logits
    from shipyard.train.step import segment_ids

    tokens = jnp.array([[5, 1, 7, 8, 1, 9]])
    assert segment_ids(tokens, 1).tolist() == [[0, 0, 1, 1, 1, 2]]
    assert segment_ids(tokens, None) is None
    cfg = load_config("tiny")
    specs = param_specs(cfg.model)
    params = init_params(specs, jax.random.key(0))
    rng = np.random.default_rng(0)
    doc1, doc2 = rng.integers(2, 500, 9), rng.integers(2, 500, 12)
    packed = jnp.asarray(np.concatenate([doc1, [1], doc2]))[None]
    masked = model_logits(params, packed, cfg.model, segment_ids=segment_ids(packed, 1))
    alone = model_logits(params, jnp.asarray(doc2)[None], cfg.model)
    # RoPE is relative, so doc2's logits do not depend on where it sits once doc1 is masked out
    np.testing.assert_allclose(masked[0, 10:], alone[0], atol=2e-5)
    unmasked = model_logits(params, packed, cfg.model)
    assert not np.allclose(unmasked[0, 10:], alone[0], atol=1e-3)
