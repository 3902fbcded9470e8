"""Mixture-of-experts: routing and expert compute against an independent reference, expert parallelism,
balancing through the real train step, presets (killed-and-resumed expert-parallel runs: test_moe_resume.py)."""

import json
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_fixtures import generate
from jax.sharding import NamedSharding
from mesh_fixtures import assert_trees_close
from model_fixtures import noisy_params

from shipyard.cli.main import main
from shipyard.config import load_config
from shipyard.model.layers import swiglu
from shipyard.model.moe import capacity, moe_mlp, route
from shipyard.model.params import init_params, param_shardings
from shipyard.model.transformer import logits, num_active_params, num_params, param_specs
from shipyard.parallel.layout import layout_for
from shipyard.parallel.mesh import logical_to_pspec, make_mesh, rules_for
from shipyard.train.metrics import flops_per_token
from shipyard.train.program import build_program
from shipyard.train.step import init_state, make_gradient_fn

# Heavy compiles and end-to-end runs: the `make test-slow` tier (docs/testing.md: tiers).
pytestmark = pytest.mark.slow


def _layer(cfg, key=0, bias_scale=0.0):
    """One MoE layer's params (noisy init) with an optional random selection bias."""
    p = noisy_params(cfg, key=key, seed=key, scale=0.05).moe_blocks.moe
    p = jax.tree.map(lambda a: jnp.asarray(a[0]), p)
    bias = bias_scale * jax.random.normal(jax.random.key(key + 7), p.router_bias.shape)
    return replace(p, router_bias=bias)


def _swiglu_np(x, gate, up, down):
    g, u = x @ np.asarray(gate, np.float64), x @ np.asarray(up, np.float64)
    return (g / (1 + np.exp(-g)) * u) @ np.asarray(down, np.float64)


def reference_route(x, p, moe):
    """Routing written from MoEConfig's field docs, in float64 numpy (no model/moe.py code):
    (weights [T, k], experts [T, k] in selection order, load [X], aux loss, z loss).

    Scores are softmax over experts or an independent sigmoid per expert; the selection bias
    is added only to pick the top-k (DeepSeek-V3: it never weights an expert's output); the
    chosen scores are rescaled to sum to 1 only with normalize_weights, then multiplied by
    routed_scale.
    """
    logits = np.asarray(x, np.float64) @ np.asarray(p.router, np.float64)
    if moe.score == "softmax":
        e = np.exp(logits - logits.max(-1, keepdims=True))
        scores = e / e.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    chosen = np.argsort(-(scores + np.asarray(p.router_bias, np.float64)), axis=-1, kind="stable")
    experts = chosen[:, : moe.experts_per_token]
    weights = np.take_along_axis(scores, experts, axis=-1)
    if moe.normalize_weights:
        weights = weights / weights.sum(-1, keepdims=True)
    weights = weights * moe.routed_scale
    counts = np.bincount(experts.ravel(), minlength=moe.num_experts)
    load = counts / experts.size
    # The Switch balance loss over per-token distributions (sigmoid scores normalised per token).
    probs = scores / scores.sum(-1, keepdims=True)
    aux = moe.num_experts * np.sum(load * probs.mean(0))
    lse = logits.max(-1) + np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))
    return weights, experts, load, aux, np.mean(lse**2)


def reference_moe(x, p, moe, drop_after=None):
    """The MoE layer for x [T, embed] as a per-token loop over its chosen experts (float64 numpy),
    optionally dropping assignments beyond a per-expert capacity (first come, first served in
    token order, then selection order); plus the shared experts' SwiGLU on every token."""
    weights, experts, *_ = reference_route(x, p, moe)
    x = np.asarray(x, np.float64)
    out = np.zeros_like(x)
    taken = np.zeros(moe.num_experts, int)
    for t in range(x.shape[0]):
        for j in range(moe.experts_per_token):
            i = experts[t, j]
            taken[i] += 1
            if drop_after is not None and taken[i] > drop_after:
                continue
            out[t] += weights[t, j] * _swiglu_np(x[t], p.w_gate[i], p.w_up[i], p.w_down[i])
    if p.shared_gate is not None:
        out += _swiglu_np(x, p.shared_gate, p.shared_up, p.shared_down)
    return out


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model.moe.grouped_matmul=ragged"],
        ["model.moe.score=sigmoid", "model.moe.routed_scale=2.5", "model.moe.num_shared_experts=0"],
        ["model.moe.normalize_weights=false", "model.moe.experts_per_token=3"],
        # DeepSeek-V3 without renormalisation: unnormalised sigmoid weights, scaled
        ["model.moe.score=sigmoid", "model.moe.normalize_weights=false", "model.moe.routed_scale=2.5"],
    ],
)
def test_dropless_equals_an_independent_reference(overrides):
    cfg = load_config("moe-tiny", overrides).model
    moe = cfg.moe
    p = _layer(cfg, bias_scale=0.05 if moe.score == "softmax" else 0.2)
    h = jax.random.normal(jax.random.key(1), (3, 20, cfg.hidden_size))
    y, stats = jax.jit(lambda h, p: moe_mlp(h, p, moe))(h, p)
    x = np.asarray(h).reshape(-1, cfg.hidden_size)
    want = reference_moe(x, p, moe)
    np.testing.assert_allclose(np.asarray(y).reshape(want.shape), want, atol=1e-5, rtol=1e-5)
    _, experts, load, aux, z = reference_route(x, p, moe)
    np.testing.assert_allclose(np.asarray(stats.load), load, rtol=1e-6)
    np.testing.assert_allclose([float(stats.aux_loss), float(stats.z_loss)], [aux, z], rtol=1e-5)
    assert float(stats.dropped) == 0.0
    # The bias is large enough to change many tokens' choices, so a layer that ignored it
    # (or weighted outputs by score + bias) could not match the reference.
    unbiased = reference_route(x, replace(p, router_bias=0 * p.router_bias), moe)[1]
    assert np.mean(np.any(np.sort(experts, -1) != np.sort(unbiased, -1), -1)) > 0.2


def test_capacity_mode_drops_latest_tokens_and_counts_them():
    cfg = load_config("moe-tiny", ["model.moe.capacity_factor=0.5"]).model
    p = _layer(cfg, key=3)
    h = jax.random.normal(jax.random.key(2), (2, 24, cfg.hidden_size))
    y, stats = jax.jit(lambda h, p: moe_mlp(h, p, cfg.moe))(h, p)
    x = h.reshape(-1, cfg.hidden_size)
    C = capacity(cfg.moe, x.shape[0])
    want = reference_moe(np.asarray(x), p, cfg.moe, drop_after=C)
    np.testing.assert_allclose(np.asarray(y).reshape(want.shape), want, atol=1e-5, rtol=1e-5)
    experts = reference_route(np.asarray(x), p, cfg.moe)[1]
    counts = np.bincount(experts.ravel(), minlength=cfg.moe.num_experts)
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
    return jax.jit(make_gradient_fn(cfg, None, layout_for(cfg, mesh)))(params, None, batch, 1.0)


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
    np.testing.assert_allclose(float(s8.ce) / 256, float(s1.ce) / 256, rtol=1e-5)
    assert_trees_close(jax.device_get(g8), jax.device_get(g1))  # each leaf relative to its norm
    for a, b in zip(st1, st8):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)


def _skewed_training(rate: float, steps: int = 16) -> tuple[list, list]:
    """Real train steps (train.program's jitted step, AdamW, sigmoid routing as in DeepSeek-V3) of
    moe-tiny from an init whose routing is skewed: every token embedding shares a component that
    the router columns of experts 0 and 1 respond to, so they take nearly all tokens. The aux and
    z losses are off, so only the selection bias (moved by `rate`) can balance the load within
    these steps. Returns (the step's metrics, the router bias after the step) per step."""
    cfg = load_config(
        "moe-tiny",
        ["mesh.data=1", "data.seq_len=16", f"train.steps={steps}", "model.moe.score=sigmoid"]
        + ["model.moe.aux_loss=0", "model.moe.router_z_loss=0", f"model.moe.bias_update_rate={rate}"]
        # A small constant lr keeps the router's own preference in place for these steps;
        # weight decay is on so a bias the optimizer decayed would show.
        + ["train.optimizer.lr=1e-4", "train.optimizer.weight_decay=0.1", "train.schedule.kind=constant"]
        + ["train.schedule.warmup_steps=0"],
    )
    program = build_program(cfg, make_mesh(cfg.mesh, jax.devices()[:1]))
    params = jax.tree.map(jnp.asarray, noisy_params(cfg.model, key=0, seed=0, scale=0.0))
    u = jax.random.normal(jax.random.key(5), (cfg.model.hidden_size,))
    u = u / jnp.linalg.norm(u)
    moe = params.moe_blocks.moe
    # A wider router spreads the tokens' scores, so a bias can move some tokens and not others.
    router = (5.0 * moe.router).at[:, :, :2].add(0.5 * u[None, :, None])
    params = replace(
        params,
        embed=params.embed + 0.1 * u,
        moe_blocks=replace(params.moe_blocks, moe=replace(moe, router=router)),
    )
    # On the program's shardings, as the trainer places them (else the second step recompiles).
    state = init_state(cfg, jax.device_put(params, program.shardings), program.optimizer)
    B, L = cfg.train.global_batch_size, cfg.data.seq_len
    rng = np.random.default_rng(0)
    metrics, biases = [], []
    for _ in range(steps):
        tokens = rng.integers(0, cfg.model.vocab_size, (B, L + 1)).astype(np.int32)
        state, m = program.train_step(
            state, {"tokens": tokens, "loss_mask": np.ones((B, L), np.float32)}, None
        )
        metrics.append(jax.device_get(m))
        biases.append(np.asarray(state.params.moe_blocks.moe.router_bias))
    return metrics, biases


def test_aux_free_bias_balancing_of_the_train_step_drives_load_toward_uniform():
    rate = 0.03
    still, still_bias = _skewed_training(0.0)
    moved, moved_bias = _skewed_training(rate)
    ratio = {
        name: [float(m["moe_load_max_over_mean"]) for m in ms] for name, ms in (("0", still), ("r", moved))
    }
    # Both start skewed (top-2 of 8: 4 means two experts take every token) ...
    assert ratio["0"][0] > 3.5 and ratio["r"][0] > 3.5
    # ... without the rule the skew stays and the bias is never touched (no gradient, no decay) ...
    assert min(ratio["0"]) > 3.5 and not np.any(np.stack(still_bias))
    # ... with it the load evens out.
    assert np.mean(ratio["r"][-6:]) < 2.0 < np.mean(ratio["0"][-6:]) / 1.5, ratio
    # Each step moves each MoE layer's bias by exactly `rate` toward that layer's own mean load
    # (the load the step logged), and nothing else moves it.
    bias = np.zeros_like(moved_bias[0])
    for m, got in zip(moved, moved_bias):
        load = np.asarray(m["moe_expert_load"])
        gap = load.mean(-1, keepdims=True) - load
        clear = np.abs(gap) > 1e-6  # an expert at exactly the mean load may round either way
        bias = np.where(clear, bias + np.float32(rate) * np.sign(gap).astype(np.float32), got)
        np.testing.assert_array_equal(got, bias)


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
    per_layer = [max(layer) / np.mean(layer) for layer in last["moe_expert_load"]]
    assert last["moe_layer_load_max_over_mean"] == pytest.approx(per_layer, rel=1e-5)
    assert last["moe_load_max_over_mean"] == pytest.approx(max(per_layer), rel=1e-5)
    assert last["moe_dropped"] == 0.0
    assert last["moe_aux_loss"] > 0 and last["moe_z_loss"] > 0
    assert 0 < last["mfu"] < 1


def test_cached_generation_of_an_moe_model_equals_full_forward():
    cfg = load_config("moe-tiny").model
    params = noisy_params(cfg, key=2, seed=1, scale=0.2)
    prompt = [5, 17, 99, 3]
    got = generate(params, cfg, [prompt], 10)[0]
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


@pytest.mark.parametrize(
    "mesh", [["mesh.data=2", "mesh.expert=4"], ["mesh.data=1", "mesh.fsdp=2", "mesh.expert=4"]]
)
def test_expert_parallel_gradients_equal_one_device_when_rows_do_not_split_over_experts(mesh):
    # 2 rows over data x expert: the batch stays whole on every expert shard
    # (no token gather), so each shard routes the same tokens; the input's and
    # router's gradients must still sum every shard's experts exactly once.
    cfg = load_config("moe-tiny", [*mesh, "data.seq_len=32", "model.num_layers=2"])
    params = noisy_params(cfg.model, key=0, seed=0, scale=0.02)
    tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, cfg.model.vocab_size)
    g1, s1, _ = _grads_on(cfg, params, tokens)
    g8, s8, _ = _grads_on(cfg, params, tokens, make_mesh(cfg.mesh))
    assert g8.moe_blocks.moe.w_gate.sharding.spec[1] == "expert"
    np.testing.assert_allclose(float(s8.ce), float(s1.ce), rtol=1e-5)
    assert_trees_close(jax.device_get(g8), jax.device_get(g1))  # each leaf relative to its norm
