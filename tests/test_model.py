import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shipyard.config import RopeScaling, load_config
from shipyard.model import attention, layers
from shipyard.model.params import count_params, init_params, param_shardings
from shipyard.model.transformer import logits, num_params, param_specs
from shipyard.parallel.mesh import DEFAULT_RULES, make_mesh


def test_rope_equals_complex_rotation(rng):
    b, s, h, d = 2, 16, 3, 8
    x = rng.standard_normal((b, s, h, d)).astype(np.float32)
    pos = np.arange(s)
    inv = np.asarray(layers.rope_inv_freq(d, 10000.0, None))
    cos, sin = layers.rope_cos_sin(jnp.asarray(pos)[None], jnp.asarray(inv))
    out = np.asarray(layers.apply_rope(jnp.asarray(x), cos, sin))
    # Reference: pair (i, i + d/2) as one complex number, multiply by e^{i pos w_i}.
    z = x[..., : d // 2] + 1j * x[..., d // 2 :]
    rot = z * np.exp(1j * pos[None, :, None, None] * inv[None, None, None, :])
    ref = np.concatenate([rot.real, rot.imag], axis=-1)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_rope_relative_position_property(rng):
    # <rope(q, m), rope(k, n)> depends only on m - n.
    d = 16
    q, k = rng.standard_normal((2, d)).astype(np.float32)
    inv = layers.rope_inv_freq(d, 500000.0, RopeScaling())

    def rot(v, p):
        c, s = layers.rope_cos_sin(jnp.array([[p]]), inv)
        return np.asarray(layers.apply_rope(jnp.asarray(v)[None, None, None], c, s))[0, 0, 0]

    assert np.dot(rot(q, 7), rot(k, 3)) == pytest.approx(np.dot(rot(q, 104), rot(k, 100)), rel=1e-4)


def test_llama3_scaling_bands():
    sc = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)
    base = np.asarray(layers.rope_inv_freq(128, 500000.0, None))
    scaled = np.asarray(layers.rope_inv_freq(128, 500000.0, sc))
    wavelen = 2 * np.pi / base
    high = wavelen < 8192 / 4
    low = wavelen > 8192 / 1
    np.testing.assert_allclose(scaled[high], base[high], rtol=1e-6)
    np.testing.assert_allclose(scaled[low], base[low] / 8, rtol=1e-6)
    mid = ~high & ~low
    assert mid.any()
    assert np.all(scaled[mid] < base[mid]) and np.all(scaled[mid] > base[mid] / 8)


def _reference_attention(q, k, v):
    """Plain multi-head causal attention with KV heads repeated to match query heads."""
    h, kvh = q.shape[2], k.shape[2]
    k = np.repeat(k, h // kvh, axis=2)
    v = np.repeat(v, h // kvh, axis=2)
    s = q.shape[1]
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


def _attention(q, k, v, segment_ids=None, window=None):
    """attention.attend on ungrouped queries [batch, seq, heads, head_dim], causal over one sequence."""
    b, s, h, d = q.shape
    kvh = k.shape[2]
    slots = jnp.arange(s)
    seen = attention.mask(slots, slots, window, segment_ids)
    return attention.attend(q.reshape(b, s, kvh, h // kvh, d), k, v, seen).reshape(b, s, h, d)


@pytest.mark.parametrize("heads, kv_heads", [(4, 1), (4, 2), (6, 3), (4, 4)])
def test_gqa_equals_repeated_kv(rng, heads, kv_heads):
    b, s, d = 2, 12, 8
    q = rng.standard_normal((b, s, heads, d)).astype(np.float32)
    k = rng.standard_normal((b, s, kv_heads, d)).astype(np.float32)
    v = rng.standard_normal((b, s, kv_heads, d)).astype(np.float32)
    out = np.asarray(_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)))
    np.testing.assert_allclose(out, _reference_attention(q, k, v), rtol=1e-5, atol=1e-5)


def test_segment_ids_block_cross_document_attention(rng):
    b, s, h, d = 1, 8, 2, 4
    q, k, v = (jnp.asarray(rng.standard_normal((b, s, h, d)).astype(np.float32)) for _ in range(3))
    seg = jnp.array([[0, 0, 0, 1, 1, 1, 1, 1]])
    out = _attention(q, k, v, seg)
    # the second document alone gives the same outputs for its positions
    alone = _attention(q[:, 3:], k[:, 3:], v[:, 3:])
    np.testing.assert_allclose(np.asarray(out[:, 3:]), np.asarray(alone), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overrides", [[], ["model.qk_norm=true", "model.tie_embeddings=true"]])
def test_causality(overrides):
    cfg = load_config("tiny", overrides).model
    params = init_params(param_specs(cfg), jax.random.key(0))
    toks = jax.random.randint(jax.random.key(1), (2, 32), 0, cfg.vocab_size)
    base = logits(params, toks, cfg)
    t = 20
    changed = toks.at[:, t].set((toks[:, t] + 1) % cfg.vocab_size)
    after = logits(params, changed, cfg)
    np.testing.assert_array_equal(np.asarray(base[:, :t]), np.asarray(after[:, :t]))
    assert not np.allclose(np.asarray(base[:, t:]), np.asarray(after[:, t:]))


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model.tie_embeddings=true"],
        ["model.qk_norm=true", "model.num_kv_heads=1"],
        ["model.head_dim=24", "model.num_heads=8", "model.num_kv_heads=4", "model.num_layers=3"],
    ],
)
def test_param_count_equals_array_sizes(overrides):
    cfg = load_config("tiny", overrides).model
    specs = param_specs(cfg)
    params = init_params(specs, jax.random.key(0))
    assert num_params(cfg) == count_params(specs) == sum(x.size for x in jax.tree.leaves(params))
    shapes = jax.tree.leaves(jax.tree.map(lambda x: x.shape, params))
    assert all(isinstance(s, int) for s in shapes)


def test_init_is_deterministic_and_sharded_per_rules():
    cfg = load_config("tiny", ["model.num_heads=8", "model.num_kv_heads=4"])
    specs = param_specs(cfg.model)
    mesh = make_mesh(cfg.mesh.model_copy(update={"data": 1, "fsdp": 4, "tensor": 2}))
    shardings = param_shardings(specs, mesh, DEFAULT_RULES)
    a = init_params(specs, jax.random.key(0), shardings)
    b = init_params(specs, jax.random.key(0))
    # same random bits whatever the layout; the float transform may differ by an ulp
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-9)
    assert a.embed.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
    assert a.blocks.wq.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    # each device holds 1/8 of the embedding
    assert a.embed.addressable_shards[0].data.size == a.embed.size // 8


def test_dense_gradients_match_plain_matmul(rng):
    x = jnp.asarray(rng.standard_normal((2, 5, 6)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((6, 3)).astype(np.float32))

    def ours(x, w):
        return jnp.sum(jnp.sin(layers.dense(x, w)))

    def plain(x, w):
        return jnp.sum(jnp.sin(x @ w))

    for a, b in zip(jax.grad(ours, argnums=(0, 1))(x, w), jax.grad(plain, argnums=(0, 1))(x, w)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overrides", [[], ["model.tie_embeddings=true", "model.qk_norm=true"]])
def test_flops_per_token_counts_every_matmul_weight(overrides):
    from shipyard.train.metrics import flops_per_token

    cfg = load_config("tiny", overrides).model
    specs = param_specs(cfg)
    # matmul weights: everything but norms and the embedding gather; a tied embedding is the head's matmul
    norms = sum(
        s.size for s in jax.tree.leaves(specs, is_leaf=lambda x: hasattr(x, "role")) if s.role == "norm"
    )
    matmul = num_params(cfg) - norms - (0 if cfg.tie_embeddings else specs.embed.size)
    seq = 128
    assert flops_per_token(cfg, seq) == 6 * matmul + 12 * cfg.num_layers * seq * cfg.num_heads * cfg.head_dim


def test_sliding_window_attention_equals_a_masked_reference():
    def grouped_attention(q, k, v, window=None):
        slots = jnp.arange(q.shape[1])
        return attention.attend(q, k, v, attention.mask(slots, slots, window))

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 10, 2, 2, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 10, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, 10, 2, 8)), jnp.float32)
    got = np.asarray(grouped_attention(q, k, v, window=3))
    scores = np.einsum("bqkgd,bskd->bkgqs", q, k) / np.sqrt(8)
    i, j = np.arange(10)[:, None], np.arange(10)[None, :]
    scores = np.where((j <= i) & (i - j < 3), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = np.einsum("bkgqs,bskd->bqkgd", probs, v)
    np.testing.assert_allclose(got, want, atol=1e-5)
    # a window longer than the sequence is plain causal attention
    np.testing.assert_allclose(
        np.asarray(grouped_attention(q, k, v, window=10)), np.asarray(grouped_attention(q, k, v))
    )
