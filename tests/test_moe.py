"""Mixture-of-experts: routing and expert compute against naive loops, expert parallelism, balancing, presets."""

import json
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from model_fixtures import noisy_params

from shipyard.cli.main import main
from shipyard.config import load_config
from shipyard.inference.generate import Generator
from shipyard.model.layers import swiglu
from shipyard.model.moe import capacity, moe_mlp, route
from shipyard.model.params import init_params, param_shardings
from shipyard.model.transformer import logits, num_active_params, num_params, param_specs
from shipyard.parallel.mesh import logical_to_pspec, make_mesh, rules_for
from shipyard.train.metrics import flops_per_token
from shipyard.train.step import make_gradient_fn


def _layer(cfg, key=0, bias_scale=0.0):
    """One MoE layer's params (noisy init) with an optional random selection bias."""
    p = noisy_params(cfg, key=key, seed=key, scale=0.05).moe_blocks.moe
    p = jax.tree.map(lambda a: jnp.asarray(a[0]), p)
    bias = bias_scale * jax.random.normal(jax.random.key(key + 7), p.router_bias.shape)
    return replace(p, router_bias=bias)


def _naive(x, p, moe, drop_after=None):
    """A per-token loop over the chosen experts (numpy), optionally dropping assignments beyond a capacity."""
    weights, experts, _ = route(jnp.asarray(x), p.router, p.router_bias, moe)
    weights, experts = np.asarray(weights), np.asarray(experts)
    x = np.asarray(x, np.float64)
    out = np.zeros_like(x)
    taken = np.zeros(moe.num_experts, int)
    # Capacity is first come, first served in token order, then slot order.
    for t in range(x.shape[0]):
        for j in range(moe.experts_per_token):
            i = experts[t, j]
            taken[i] += 1
            if drop_after is not None and taken[i] > drop_after:
                continue
            g = x[t] @ np.asarray(p.w_gate[i], np.float64)
            u = x[t] @ np.asarray(p.w_up[i], np.float64)
            out[t] += weights[t, j] * ((g / (1 + np.exp(-g)) * u) @ np.asarray(p.w_down[i], np.float64))
    if p.shared_gate is not None:
        out += np.asarray(swiglu(jnp.asarray(x, jnp.float32), p.shared_gate, p.shared_up, p.shared_down))
    return out


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model.moe.grouped_matmul=ragged"],
        ["model.moe.score=sigmoid", "model.moe.routed_scale=2.5", "model.moe.num_shared_experts=0"],
        ["model.moe.normalize_weights=false", "model.moe.experts_per_token=3"],
    ],
)
def test_dropless_equals_a_naive_loop_over_chosen_experts(overrides):
    cfg = load_config("moe-tiny", overrides).model
    p = _layer(cfg, bias_scale=0.02)
    h = jax.random.normal(jax.random.key(1), (3, 20, cfg.hidden_size))
    y, stats = jax.jit(lambda h, p: moe_mlp(h, p, cfg.moe))(h, p)
    want = _naive(h.reshape(-1, cfg.hidden_size), p, cfg.moe)
    np.testing.assert_allclose(np.asarray(y).reshape(want.shape), want, atol=1e-5, rtol=1e-5)
    assert float(stats.dropped) == 0.0
    np.testing.assert_allclose(float(jnp.sum(stats.load)), 1.0, rtol=1e-6)


def test_capacity_mode_drops_latest_tokens_and_counts_them():
    cfg = load_config("moe-tiny", ["model.moe.capacity_factor=0.5"]).model
    p = _layer(cfg, key=3)
    h = jax.random.normal(jax.random.key(2), (2, 24, cfg.hidden_size))
    y, stats = jax.jit(lambda h, p: moe_mlp(h, p, cfg.moe))(h, p)
    x = h.reshape(-1, cfg.hidden_size)
    C = capacity(cfg.moe, x.shape[0])
    want = _naive(x, p, cfg.moe, drop_after=C)
    np.testing.assert_allclose(np.asarray(y).reshape(want.shape), want, atol=1e-5, rtol=1e-5)
    _, experts, sums = route(x, p.router, p.router_bias, cfg.moe)
    counts = np.bincount(np.asarray(experts).ravel(), minlength=cfg.moe.num_experts)
    expected = np.maximum(counts - C, 0).sum() / experts.size
    assert expected > 0 and float(stats.dropped) == pytest.approx(expected)


def test_all_experts_with_uniform_routing_is_the_dense_mixture():
    cfg = load_config("moe-tiny", ["model.moe.experts_per_token=8", "model.moe.num_shared_experts=0"]).model
    p = _layer(cfg)
    p = replace(p, router=jnp.zeros_like(p.router))  # every expert scores 1/8
    x = jax.random.normal(jax.random.key(4), (1, 16, cfg.hidden_size))
    y, stats = moe_mlp(x, p, cfg.moe)
    dense = sum(swiglu(x, p.w_gate[i], p.w_up[i], p.w_down[i]) for i in range(8)) / 8
    np.testing.assert_allclose(np.asarray(y), np.asarray(dense), atol=1e-6)
    np.testing.assert_allclose(np.asarray(stats.load), np.full(8, 1 / 8), rtol=1e-6)
    assert float(stats.aux_loss) == pytest.approx(1.0)  # the Switch loss is 1 when balanced


def test_gradients_reach_router_and_experts_finite_differences():
    cfg = load_config("moe-tiny").model
    p = _layer(cfg, key=5)
    h = jax.random.normal(jax.random.key(6), (1, 12, cfg.hidden_size))
    moe = cfg.moe

    def loss(p):
        y, stats = moe_mlp(h, p, moe)
        return jnp.sum(jnp.sin(y)) + 0.3 * stats.aux_loss + 0.1 * stats.z_loss

    grads = jax.grad(loss)(p)
    loss = jax.jit(loss)
    chosen = jax.jit(lambda p: route(h.reshape(-1, cfg.hidden_size), p.router, p.router_bias, moe)[1])
    for name in ("router", "w_gate", "w_up", "w_down", "shared_gate"):
        g = getattr(grads, name)
        assert float(jnp.linalg.norm(g)) > 1e-4, name
        # Central difference along the gradient: the directional derivative must be |g|.
        # Top-k choices (and the load in the balance loss) are piecewise constant, so the
        # step must be small enough not to change any token's experts.
        d = g / jnp.linalg.norm(g)
        eps = 1e-4
        moved = [replace(p, **{name: getattr(p, name) + s * eps * d}) for s in (1, -1)]
        assert all(bool(jnp.all(chosen(q) == chosen(p))) for q in moved), name
        fd = (loss(moved[0]) - loss(moved[1])) / (2 * eps)
        assert float(fd) == pytest.approx(float(jnp.linalg.norm(g)), rel=1e-2), name
    assert not np.any(np.asarray(grads.router_bias))  # the bias is moved by a rule, never by gradients


def _grads_on(cfg, params, tokens, mesh=None):
    batch = {"tokens": tokens, "loss_mask": jnp.ones((tokens.shape[0], tokens.shape[1] - 1))}
    if mesh is None:
        return jax.jit(make_gradient_fn(cfg))(params, None, batch, 1.0)
    rules = rules_for(cfg.mesh)
    params = jax.device_put(params, param_shardings(param_specs(cfg.model), mesh, rules))
    spec = logical_to_pspec(("batch", "seq"), tokens.shape, mesh, rules)
    batch = jax.device_put(batch, NamedSharding(mesh, spec))
    shape = (tokens.shape[0], tokens.shape[1] - 1, cfg.model.hidden_size)
    act = NamedSharding(mesh, logical_to_pspec(("batch", "seq", "embed"), shape, mesh, rules))
    return jax.jit(make_gradient_fn(cfg, None, act, rules))(params, None, batch, 1.0)


@pytest.mark.parametrize(
    "mesh",
    [
        ["mesh.data=2", "mesh.expert=4"],
        ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "mesh.expert=2"],
        ["mesh.data=2", "mesh.expert=4", "model.moe.capacity_factor=8", "model.moe.score=sigmoid"],
    ],
)
def test_expert_parallel_loss_and_gradients_equal_one_device(mesh):
    cfg = load_config("moe-tiny", [*mesh, "data.seq_len=32"])
    params = noisy_params(cfg.model, key=0, seed=0, scale=0.02)
    tokens = jax.random.randint(jax.random.key(1), (8, 33), 0, cfg.model.vocab_size)
    g1, s1, st1 = _grads_on(cfg, params, tokens)
    device_mesh = make_mesh(cfg.mesh)
    g8, s8, st8 = _grads_on(cfg, params, tokens, device_mesh)
    assert g8.moe_blocks.moe.w_gate.sharding.spec[1] == "expert"  # experts really are split
    np.testing.assert_allclose(float(s8.ce) / 256, float(s1.ce) / 256, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g8)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)
    for a, b in zip(st1, st8):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)


def balance_curve(steps=300, rate=0.01):
    """max/mean expert load per step of aux-loss-free bias updates on a skewed input (no gradient training)."""
    cfg = load_config("moe-tiny", ["model.moe.score=sigmoid"]).model
    p = _layer(cfg, key=8)
    k = jax.random.split(jax.random.key(9), 2)
    # Skew: every token shares a large component aligned with experts 0 and 1's router columns.
    skew = p.router[:, 0] + p.router[:, 1]
    x = jax.random.normal(k[0], (512, cfg.hidden_size)) + 4.0 * skew / jnp.linalg.norm(skew)

    @jax.jit
    def update(bias):
        _, _, sums = route(x, p.router, bias, cfg.moe)
        load = sums.counts / jnp.sum(sums.counts)
        return bias + rate * jnp.sign(jnp.mean(load) - load), jnp.max(load) / jnp.mean(load)

    bias, curve = p.router_bias * 0, []
    for _ in range(steps):
        bias, ratio = update(bias)
        curve.append(float(ratio))
    return curve


def test_aux_free_bias_balancing_drives_load_toward_uniform():
    curve = balance_curve()
    assert curve[0] > 2.5  # the skewed input starts far from balanced
    assert max(curve[-50:]) < 1.35
    assert np.mean(curve[-50:]) < curve[0] / 2


def _train(tmp_path, tokens, name, *extra):
    argv = ["train", "moe-tiny", f"data.train_tokens={tokens}", f"run.out_dir={tmp_path}", f"run.name={name}"]
    assert main([*argv, "train.logging.progress=false", *extra]) == 0
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def test_moe_tiny_trains_with_falling_loss_and_logs_expert_load(tmp_path, byte_tokens):
    rows = _train(
        tmp_path, byte_tokens, "moe", "train.steps=60", "train.logging.log_every=10",
        "model.moe.bias_update_rate=0.001",
    )  # fmt: skip
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0
    last = rows[-1]
    assert len(last["moe_expert_load"]) == 2 and len(last["moe_expert_load"][0]) == 8
    assert sum(last["moe_expert_load"][0]) == pytest.approx(1.0, abs=1e-4)
    assert last["moe_load_max_over_mean"] >= 1.0 and last["moe_dropped"] == 0.0
    assert last["moe_aux_loss"] > 0 and last["moe_z_loss"] > 0
    assert 0 < last["mfu"] < 1


@pytest.mark.slow
def test_expert_parallel_training_run_resumes_from_its_checkpoint(tmp_path, byte_tokens):
    ep = ["mesh.data=2", "mesh.expert=4", "train.logging.log_every=1", "train.checkpoint.every=4"]
    straight = _train(tmp_path, byte_tokens, "a", "train.steps=8", *ep)
    _train(tmp_path, byte_tokens, "b", "train.steps=4", *ep)
    argv = ["train", "moe-tiny", f"data.train_tokens={byte_tokens}", f"run.out_dir={tmp_path}", "run.name=b"]
    assert main([*argv, "train.logging.progress=false", "train.steps=8", *ep, "--resume"]) == 0
    resumed = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]


def test_cached_generation_of_an_moe_model_equals_full_forward():
    cfg = load_config("moe-tiny").model
    params = noisy_params(cfg, key=2, seed=1, scale=0.2)
    prompt = [5, 17, 99, 3]
    got = Generator(params, cfg)([prompt], 10)[0]
    # Full forward over a right-padded fixed width (one compilation; causal attention ignores the padding).
    forward = jax.jit(lambda toks: logits(params, toks, cfg))
    seq = list(prompt)
    for _ in range(10):
        padded = jnp.asarray([seq + [0] * (len(prompt) + 10 - len(seq))])
        seq.append(int(jnp.argmax(forward(padded)[0, len(seq) - 1])))
    assert got == seq[len(prompt) :]


def test_presets_total_and_active_parameters(capsys):
    big = load_config("moe-535b-a23b").model
    assert num_params(big) == pytest.approx(535e9, rel=0.01)
    assert num_active_params(big) == pytest.approx(23e9, rel=0.02)
    mixtral = load_config("mixtral-8x7b").model
    assert num_params(mixtral) == pytest.approx(46.70e9, rel=1e-3)  # Mistral's published 46.7B / 12.9B
    assert num_active_params(mixtral) == pytest.approx(12.88e9, rel=1e-3)
    assert main(["config", "show", "moe-535b-a23b"]) == 0
    out = capsys.readouterr().out
    assert f"# parameters: {num_params(big)} (534B)" in out
    assert f"# active parameters per token: {num_active_params(big)} (23B)" in out


def test_active_parameters_and_flops_count_only_chosen_experts():
    moe = load_config("moe-tiny", ["model.moe.num_shared_experts=0", "model.moe.first_dense_layers=0"]).model
    # A dense model whose MLP is exactly the k active experts side by side.
    dense = moe.model_copy(update={"moe": None, "intermediate_size": 2 * moe.moe.expert_intermediate_size})
    router = moe.num_layers * moe.hidden_size * moe.moe.num_experts
    assert num_active_params(moe) == num_params(dense) + router + moe.num_layers * moe.moe.num_experts
    assert flops_per_token(moe, 128) == flops_per_token(dense, 128) + 6 * router
    specs = param_specs(moe)
    assert init_params(specs, jax.random.key(0)).blocks is None  # no dense layers: no dense stack
