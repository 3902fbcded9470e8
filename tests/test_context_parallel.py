"""Context parallelism: sequences split over the `context` mesh axis, attention as a ring.

The ring (model/ring_attention.py) equals the one-device attention forward and backward; a model
trained with context = 2 and 4 (document masking, sliding windows, packed chats, combined with
fsdp and tensor, and a MoE model with expert parallelism) gives the one-device losses, grad norms
and every gradient; the residual stream really is split along seq on the devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from mesh_fixtures import Run, assert_same_training, assert_trees_close, run_steps

from shipyard.config import MeshConfig, load_config
from shipyard.errors import ConfigError
from shipyard.model import attention
from shipyard.model.params import init_params
from shipyard.model.ring_attention import ring_attention
from shipyard.parallel.context import check_config, zigzag_order
from shipyard.parallel.mesh import make_mesh
from shipyard.train.program import build_program
from shipyard.train.step import make_gradient_fn

# Heavy compiles and end-to-end runs: the `make test-slow` tier (docs/testing.md: tiers).
pytestmark = pytest.mark.slow

TINY = [
    "train.global_batch_size=4",
    "data.seq_len=32",
    "model.hidden_size=32",
    "model.intermediate_size=64",
]
DOCS = ["data.document_masking=true", "data.eos_id=10"]  # byte 10 (newline): many short documents
WINDOW = ["model.sliding_window=6", "model.global_attention_every=2", "train.microbatches=2"]


# ----------------------------------------------------------------------------- the order


@pytest.mark.parametrize("context", [2, 4])
def test_zigzag_order_gives_each_device_an_early_and_a_late_chunk(context):
    L = 8 * context
    order = zigzag_order(L, context)
    assert sorted(order.tolist()) == list(range(L))  # a permutation
    chunk = L // (2 * context)
    shares = order.reshape(context, 2, chunk)
    for i, (early, late) in enumerate(shares):
        assert early.tolist() == list(range(i * chunk, (i + 1) * chunk))
        assert late.tolist() == list(range((2 * context - 1 - i) * chunk, (2 * context - i) * chunk))
    # causal work (query, key) pairs per device are equal: the point of the order
    work = [int(np.sum(s.reshape(-1)[:, None] >= np.arange(L)[None, :])) for s in shares]
    assert len(set(work)) == 1, work


def test_unsupported_context_configs_are_refused():
    with pytest.raises(ConfigError, match=r"data.seq_len=30 .* divisible by 4"):
        check_config(load_config("tiny", ["mesh.context=2", "data.seq_len=30"]))
    with pytest.raises(ConfigError, match="mesh.context=-1"):
        check_config(load_config("tiny", ["mesh.context=-1", "mesh.data=1"]))
    with pytest.raises(ConfigError, match="mesh.rules.seq"):
        check_config(load_config("tiny", ["mesh.context=2", "mesh.rules={seq: [tensor]}"]))


# ----------------------------------------------------------------------------- the ring itself


@pytest.mark.parametrize(
    "context,block,window,new_doc",
    [(4, None, 7, 0.15), (2, 3, 7, 0.15), (4, None, None, 0.02)],
    ids=["context=4 in halves", "context=2 in tiles of 2", "context=4 global, long documents"],
)
def test_ring_attention_equals_one_device_attention_forward_and_backward(context, block, window, new_doc):
    """Zig-zag ordered q/k/v over the context axis (x data), GQA, documents (a new one at each
    position with probability `new_doc`) and a window (None: global attention, over documents that
    span several devices' chunks, so every hop of the ring carries keys some query needs), each chunk
    in halves or in tiles (block 3: the largest divisor of the half up to it, 2): the output and the
    gradients of q, k, v equal `attention.attend` over the [L, L] mask in the original order."""
    B, L, K, G, D = 2, 8 * context, 2, 2, 8
    mesh = make_mesh(MeshConfig(data=8 // context, context=context), jax.devices())
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, L, K, G, D))
    k, v = jax.random.normal(keys[1], (B, L, K, D)), jax.random.normal(keys[2], (B, L, K, D))
    seg = jnp.cumsum(jax.random.uniform(keys[3], (B, L)) < new_doc, axis=1).astype(jnp.int32)
    if window is None:  # documents longer than the window the other cases use: the far keys count
        assert int(jnp.max(jnp.bincount(seg[0]))) > 2 * 7
    else:
        window = jnp.int32(window)
    order = jnp.asarray(zigzag_order(L, context))
    back = jnp.argsort(order)

    def reference(q, k, v):
        slots = jnp.arange(L)
        return attention.attend(q, k, v, attention.mask(slots, slots, window, seg))

    def ring(q, k, v):
        out = ring_attention(q[:, order], k[:, order], v[:, order], order, seg[:, order], window, mesh, block)
        return out[:, back]

    def run(fn):
        def loss(*a):
            out = fn(*a)
            return jnp.sum(jnp.sin(out)), out

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    (want, want_out), want_grads = run(reference)
    (got, got_out), got_grads = run(ring)
    assert float(jnp.max(jnp.abs(got_out - want_out))) < 1e-5
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert_trees_close(got_grads, want_grads)


# ----------------------------------------------------------------------------- the train step


def _run(preset: str, overrides: list[str], mesh_cfg: MeshConfig, devices: int, tokens, steps=5) -> Run:
    """`run_steps` of `preset` + `overrides` on the first `devices` devices, with a loss mask that
    the context permutation must carry along (the first quarter of every row masked)."""
    cfg = load_config(preset, overrides)
    mask = np.ones((cfg.train.global_batch_size, cfg.data.seq_len), np.float32)
    mask[:, : cfg.data.seq_len // 4] = 0.0
    return run_steps(cfg, mesh_cfg, jax.devices()[:devices], tokens, steps, mask)


@pytest.fixture(scope="module")
def reference(byte_tokens):
    return _run("tiny", TINY + DOCS + WINDOW, MeshConfig(data=1), 1, byte_tokens)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh_cfg,devices",
    [(MeshConfig(data=2, context=4), 8), (MeshConfig(data=1, fsdp=2, context=2, tensor=2), 8)],
    ids=["data=2,context=4", "fsdp=2,context=2,tensor=2"],
)
def test_context_steps_equal_one_device(reference, byte_tokens, mesh_cfg, devices):
    """Document masking, a loss mask, per-layer windows (every second layer global) under scan and
    two microbatches: 5 steps' losses and grad norms, and every gradient before and after."""
    assert_same_training(_run("tiny", TINY + DOCS + WINDOW, mesh_cfg, devices, byte_tokens), reference)


# One leading dense layer: under a pipeline it runs inside stage 0, with the ring's collectives in it.
MOE = TINY + DOCS + ["model.num_layers=3", "model.moe.first_dense_layers=1", "model.moe.num_experts=4"]
MOE += ["model.moe.expert_intermediate_size=32", "train.pipeline.microbatches=2"]


@pytest.fixture(scope="module")
def moe_reference(byte_tokens):
    """One device without the pipeline code: plain accumulation over the same 2 microbatches (the
    same strided rows; the balance losses are per-microbatch means)."""
    plain = [o for o in MOE if not o.startswith("train.pipeline.")] + ["train.microbatches=2"]
    return _run("moe-tiny", plain, MeshConfig(data=1), 1, byte_tokens)


@pytest.mark.slow
def test_moe_with_context_and_expert_parallelism_equals_one_device(moe_reference, byte_tokens):
    """The MoE layer's own shard_map (experts over `expert`, tokens split over batch and seq)
    composes with the ring, and the ring nests inside pipeline stages: moe-tiny shrunk (two MoE
    layers of 4 experts), document masking, the pipeline schedule in 2 microbatches, on
    pipeline=2 x context=2 x expert=2 (one case: context x expert without the pipeline runs
    nothing this one does not)."""
    mesh_cfg = MeshConfig(data=1, pipeline=2, context=2, expert=2)
    assert_same_training(_run("moe-tiny", MOE, mesh_cfg, 8, byte_tokens), moe_reference)


@pytest.mark.parametrize(
    "overrides,documents",
    [(["model.sliding_window=5", "model.num_layers=1"], 3), (["model.num_layers=2"], 2)],
    ids=["window 5, 1 layer", "global, 2 layers, long documents"],
)
def test_packed_chat_gradients_equal_one_device(overrides, documents):
    """Packed conversations (batch segment ids, positions restarting at 0, padding as segment -1, a
    loss mask on replies only) under context=4 x tensor=2, with a sliding window or global attention
    over `documents` per row: causality by slot, RoPE by the batch's positions; the loss and every
    gradient equal one device's."""
    cfg = load_config("tiny", TINY + overrides)
    B, L = cfg.train.global_batch_size, cfg.data.seq_len
    rng = np.random.default_rng(0)
    segments = np.sort(rng.integers(0, documents, (B, L)), axis=1)
    segments[:, -3:] = -1  # padding at each row's end
    starts = np.maximum.accumulate(
        np.where(np.diff(segments, prepend=-2, axis=1) != 0, np.arange(L), 0), axis=1
    )
    batch = {
        "tokens": rng.integers(0, 256, (B, L + 1)).astype(np.int32),
        "loss_mask": (rng.random((B, L)) < 0.6).astype(np.float32) * (segments >= 0),
        "segment_ids": segments.astype(np.int32),
        "positions": (np.arange(L) - starts).astype(np.int32),
    }

    def gradients(mesh_cfg, devices):
        c = cfg.model_copy(update={"mesh": mesh_cfg})
        program = build_program(c, make_mesh(mesh_cfg, jax.devices()[:devices]))
        params = init_params(program.specs, jax.random.key(0), program.shardings)
        fn = make_gradient_fn(c, None, program.layout, program.partition)
        grads, sums, _ = jax.jit(lambda p, b: fn(p, None, b, 1.0))(params, batch)
        return float(sums.ce), jax.device_get(grads)

    want_loss, want = gradients(MeshConfig(data=1), 1)
    got_loss, got = gradients(MeshConfig(data=1, context=4, tensor=2), 8)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    assert_trees_close(got, want)


# ----------------------------------------------------------------------------- really split


def test_activations_are_split_along_seq():
    """The residual stream is laid out [batch, seq/context, embed], the ring's collective-permutes
    are in the compiled train step, each of the 4 devices needs well under half the temporary
    memory of one device running the whole step (a replicated sequence, or one gathered by a
    reshape that merges batch and seq, costs about as much as one device), and the temporaries
    grow linearly with the sequence (nothing [L, L] is kept, e.g. every block's mask)."""
    overrides = ["train.global_batch_size=2", "model.hidden_size=32", "model.intermediate_size=256"]
    overrides += ["model.num_layers=2", "model.remat=none", "model.attention_block=32", "mesh.data=1"]

    def compiled(context: int, seq_len: int):
        sizes = [f"mesh.context={context}", f"data.seq_len={seq_len}", f"model.max_seq_len={seq_len}"]
        cfg = load_config("tiny", overrides + sizes)
        mesh = make_mesh(cfg.mesh, jax.devices()[:context])
        program = build_program(cfg, mesh)
        act = program.layout.activations(2)
        return program.lower_train_step().compile(), act

    def temp(step) -> int:
        return step.memory_analysis().temp_size_in_bytes

    split, act = compiled(4, 512)
    assert act.is_equivalent_to(NamedSharding(act.mesh, PartitionSpec(None, "context", None)), 3)
    assert "collective-permute" in split.as_text()  # the ring
    ratio = temp(split) / temp(compiled(1, 512)[0])
    assert ratio < 0.4, ratio
    growth = temp(compiled(4, 1024)[0]) / temp(split)
    assert growth < 2.4, growth
