import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shipyard.config import ScheduleConfig, load_config
from shipyard.model.params import init_params
from shipyard.model.transformer import param_specs
from shipyard.train.optim import build_optimizer, lr_schedule, weight_decay_mask


def test_cosine_schedule_values_and_warmup_join():
    f = lr_schedule(
        ScheduleConfig(kind="cosine", warmup_steps=10, min_lr_ratio=0.1), peak=1.0, total_steps=110
    )
    assert float(f(0)) == 0.0
    assert float(f(5)) == pytest.approx(0.5)
    assert float(f(10)) == pytest.approx(1.0)
    assert float(f(60)) == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the cosine
    assert float(f(110)) == pytest.approx(0.1)
    assert float(f(500)) == pytest.approx(0.1)  # stays at the floor
    # continuity at the join: one step either side differs by about one warmup increment
    assert abs(float(f(10)) - float(f(9))) <= 0.1 + 1e-6
    assert abs(float(f(11)) - float(f(10))) < 1e-3


def test_wsd_schedule():
    f = lr_schedule(
        ScheduleConfig(kind="wsd", warmup_steps=10, decay_fraction=0.2, min_lr_ratio=0.0),
        peak=2.0,
        total_steps=100,
    )
    assert float(f(10)) == pytest.approx(2.0)
    assert float(f(50)) == pytest.approx(2.0)
    assert float(f(80)) == pytest.approx(2.0)  # decay starts at 80
    assert float(f(90)) == pytest.approx(1.0)
    assert float(f(100)) == pytest.approx(0.0)
    assert abs(float(f(10)) - float(f(9))) == pytest.approx(0.2)


def test_constant_schedule():
    f = lr_schedule(ScheduleConfig(kind="constant", warmup_steps=4), peak=3.0, total_steps=50)
    assert [float(f(s)) for s in (0, 2, 4, 49)] == pytest.approx([0.0, 1.5, 3.0, 3.0])


def test_weight_decay_mask_roles():
    specs = param_specs(load_config("tiny", ["model.qk_norm=true"]).model)
    m = weight_decay_mask(specs, decay_embeddings=False, decay_norms=False)
    assert m.blocks.wq and m.blocks.w_down and m.lm_head
    assert not m.embed and not m.final_norm and not m.blocks.attn_norm and not m.blocks.q_norm
    m = weight_decay_mask(specs, decay_embeddings=True, decay_norms=True)
    assert m.embed and m.final_norm and m.blocks.mlp_norm


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_decay_applies_only_where_masked(name):
    """With zero gradients the only change is weight decay: norms and embeddings must not move."""
    cfg = load_config("tiny", [f"train.optimizer.name={name}", "train.optimizer.weight_decay=0.5"])
    specs = param_specs(cfg.model)
    params = init_params(specs, jax.random.key(0))
    opt = build_optimizer(cfg.train, specs)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = jax.jit(opt.update)(zeros, opt.init(params), params)
    moved = jax.tree.map(lambda u: bool(jnp.any(u != 0)), updates)
    assert moved.blocks.wq and moved.blocks.w_up and moved.lm_head
    assert not moved.embed and not moved.final_norm and not moved.blocks.attn_norm
    # decoupled decay at unit learning rate: update = -wd * param
    np.testing.assert_allclose(np.asarray(updates.lm_head), -0.5 * np.asarray(params.lm_head), rtol=1e-6)
