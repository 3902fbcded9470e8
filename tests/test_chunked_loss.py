"""Chunked cross-entropy (train/chunked_loss.py): the same loss and gradients as the whole logits,
without the fp32 [tokens, vocab] array."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from shipyard.config import load_config
from shipyard.data.preference import pair_slots
from shipyard.model.params import init_params
from shipyard.parallel.mesh import make_mesh
from shipyard.train.chunked_loss import accumulator_bytes, head_loss_sums, logits_bytes, num_chunks
from shipyard.train.program import build_program
from shipyard.train.step import init_state, make_eval_step, make_gradient_fn

# Heavy compiles and end-to-end runs: the `make test-slow` tier (docs/testing.md: tiers).
pytestmark = pytest.mark.slow


def _close(got, want, tol=1e-6):
    """Every leaf within `tol` of the reference, relative to the reference's largest entry (and 1)."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape
        np.testing.assert_array_less(np.max(np.abs(g - w)), tol * max(1.0, float(np.max(np.abs(w)))))


@pytest.mark.parametrize(("tied", "z_loss"), [(False, 0.0), (True, 0.3)])
def test_head_loss_values_and_gradients_equal_the_whole_logits(tied, z_loss):
    B, S, E, V = 2, 10, 16, 50
    k = jax.random.split(jax.random.key(0), 4)
    h = jax.random.normal(k[0], (B, S, E))
    weight = jax.random.normal(k[1], (V, E) if tied else (E, V)) * 0.5
    targets = jax.random.randint(k[2], (B, S), 0, V)
    mask = (jax.random.uniform(k[3], (B, S)) > 0.3).astype(jnp.float32)

    def objective(h, weight, chunks):
        sums = head_loss_sums(h, weight.T if tied else weight, targets, mask, chunks)
        return (sums.ce + z_loss * sums.z) / sums.tokens, sums

    grad = jax.jit(jax.grad(objective, (0, 1), has_aux=True), static_argnums=2)
    (gh, gw), whole = grad(h, weight, 1)
    assert float(whole.tokens) < B * S  # the mask drops tokens
    (ch, cw), sums = grad(h, weight, 3)  # 3 chunks do not divide the 10 positions: padded
    _close(sums, whole)
    _close((ch, cw), (gh, gw))
    assert float(jnp.max(jnp.abs(gw))) > 0.01  # a real gradient, not two zeros agreeing


def _whole_logits_in(fn, *args, shape: str) -> bool:
    """Whether the traced gradient function holds an fp32 array of the whole logits' `shape`."""
    return f"f32[{shape}]" in str(jax.make_jaxpr(fn)(*args))


def _batch(cfg, seed=1):
    B, L = cfg.train.global_batch_size, cfg.data.seq_len
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.model.vocab_size, (B, L + 1)).astype(np.int32)
    mask = (rng.random((B, L)) > 0.25).astype(np.float32)
    return {"tokens": jnp.asarray(tokens), "loss_mask": jnp.asarray(mask)}


def test_train_gradients_of_every_param_equal_the_whole_logits():
    """A tied head (the embedding's gradient has a lookup and a head part); the sharded test below
    has an untied one. 2 x 32 tokens in chunks of at most 24: 3, which do not divide 32 positions."""
    over = ["train.global_batch_size=2", "data.seq_len=32", "train.z_loss=0.01", "model.tie_embeddings=true"]
    whole = load_config("tiny", [*over, "train.loss_chunk_tokens=null"])
    chunked = load_config("tiny", [*over, "train.loss_chunk_tokens=24"])
    assert num_chunks((2, 32), chunked.train.loss_chunk_tokens) == 3
    params = init_params(make_gradient_fn(whole).partition.trainable_specs(), jax.random.key(0))
    batch = _batch(whole)
    results = [jax.jit(make_gradient_fn(c))(params, None, batch, 1.0) for c in (whole, chunked)]
    (g_whole, s_whole, _), (g_chunk, s_chunk, _) = results
    _close(s_chunk, s_whole)
    _close(g_chunk, g_whole)
    ce = [jax.jit(make_eval_step(c))(params, None, {"tokens": batch["tokens"]})[0] for c in (whole, chunked)]
    _close(ce[1], ce[0])
    logits = "2,32,512"  # [batch, seq, vocab]: there without chunks, never with them
    assert _whole_logits_in(make_gradient_fn(whole), params, None, batch, 1.0, shape=logits)
    assert not _whole_logits_in(make_gradient_fn(chunked), params, None, batch, 1.0, shape=logits)
    assert g_whole.lm_head is None and float(jnp.max(jnp.abs(g_whole.embed))) > 1e-3


@pytest.mark.slow  # two programs on 4 devices: 15 s on an idle 2-core machine, a minute on a busy one
def test_sharded_train_and_eval_steps_equal_the_whole_logits():
    """fsdp x tensor (an untied head, its vocab split over tensor): the step's metrics, the updated
    params and the eval step's sums match the whole-logits program."""
    over = ["train.global_batch_size=8", "data.seq_len=16", "train.z_loss=0.01", "model.tie_embeddings=false"]
    mesh = dict(zip(("mesh.data", "mesh.fsdp", "mesh.tensor"), (1, 2, 2)))
    over += [f"{k}={v}" for k, v in mesh.items()]
    out = []
    for chunk in ("null", "16"):  # 4 rows x 16 positions per device: 4 chunks of 16
        cfg = load_config("tiny", [*over, f"train.loss_chunk_tokens={chunk}"])
        program = build_program(cfg, make_mesh(cfg.mesh, jax.devices()[:4]))
        params = init_params(program.specs, jax.random.key(0), program.shardings)
        batch = jax.device_put(_batch(cfg), program.batch_shardings)
        ce, tokens = program.eval_step(params, None, {"tokens": batch["tokens"]})
        state = init_state(cfg, params, program.optimizer)
        state, metrics = program.train_step(state, batch, None)
        out.append((jax.device_get(metrics), jax.device_get(state.params), float(ce), float(tokens)))
    act = NamedSharding(program.mesh, PartitionSpec("fsdp", None, None))
    assert num_chunks((8, 16), 16, act) == 4
    (m0, p0, ce0, n0), (m1, p1, ce1, n1) = out
    for key in ("loss", "z_loss", "entropy", "grad_norm", "update_norm"):
        _close(m1[key], m0[key])
    _close(p1, p0)
    assert n0 == n1 == 8 * 16
    _close(ce1, ce0)


def test_chunks_are_counted_per_device():
    mesh = make_mesh(load_config("tiny", ["mesh.data=4", "mesh.tensor=2"]).mesh)
    act = NamedSharding(mesh, PartitionSpec("data", None, None))
    assert num_chunks((8, 512), 2048, act) == 1  # 2 rows x 512 = 1024 tokens per device: whole
    assert num_chunks((8, 512), 2048) == 2  # unsharded: 4096 tokens
    assert num_chunks((8, 512), 100, act) == 11
    assert num_chunks((8, 512), None, act) == 1
    assert num_chunks((8, 4), 1, act) == 4  # at least one position per row per chunk
    # The embed dim sharded (fsdp not taken by the batch): only [batch, seq]'s axes count.
    fsdp = make_mesh(load_config("tiny", ["mesh.data=1", "mesh.fsdp=8"]).mesh)
    embed_split = NamedSharding(fsdp, PartitionSpec(None, None, "fsdp"))
    assert num_chunks((4, 1024), 2048, embed_split) == 2
    assert logits_bytes(4096, 1000, None) == 2 * 4 * 4096 * 1000
    assert logits_bytes(4096, 1000, 512) == 2 * 4 * 512 * 1000
    assert accumulator_bytes(4096, 64, 1000, 512) == 4 * 64 * 1000
    assert accumulator_bytes(512, 64, 1000, 512) == accumulator_bytes(4096, 64, 1000, None) == 0


def test_compiled_memory_of_a_128k_vocabulary_step_drops_by_more_than_the_logits():
    """The small preset with a 131072-entry vocabulary, 2 x 512 tokens on one device: XLA's
    temporaries shrink by more than the fp32 logits (tokens x vocab x 4 bytes) when chunked."""
    over = ["model.vocab_size=131072", "train.global_batch_size=2", "data.seq_len=512", "mesh.data=1"]
    over.append(
        "model.scan_unroll=1"
    )  # the head is what is measured: one layer body compiles faster than six
    temps = {}
    for chunk in ("null", "256"):
        cfg = load_config("small", [*over, f"train.loss_chunk_tokens={chunk}"])
        program = build_program(cfg, make_mesh(cfg.mesh, jax.devices()[:1]))
        temps[chunk] = program.lower_train_step().compile().memory_analysis().temp_size_in_bytes
    logits = 2 * 512 * 131072 * 4
    assert temps["null"] - temps["256"] >= logits, temps


def test_preference_gradients_equal_the_whole_logits():
    """DPO's reply log-probs come from the chunked head too (train.preference; cached reference)."""
    over = ["train.global_batch_size=2", "data.seq_len=32", "data.train_tokens=null"]
    over += ["data.preference={train: pairs.jsonl, tokenizer: t.json}", "train.preference={loss: dpo}"]
    whole = load_config("tiny", [*over, "train.loss_chunk_tokens=null"])
    chunked = load_config("tiny", [*over, "train.loss_chunk_tokens=24"])
    rng = np.random.default_rng(2)
    B, L, P = 2, 32, pair_slots(32)
    slots = np.full((B, L), -1, np.int32)
    slots[:, 4:9], slots[:, 12:20], slots[0, 22:25], slots[0, 27:31] = 0, 1, 2, 3  # 2 pairs, 1 pair
    pair_mask = np.zeros((B, P), np.float32)
    pair_mask[0, :2] = pair_mask[1, 0] = 1
    batch = {
        "tokens": rng.integers(0, whole.model.vocab_size, (B, L + 1)).astype(np.int32),
        "loss_mask": (slots >= 0).astype(np.float32),
        "segment_ids": np.zeros((B, L), np.int32),
        "positions": np.broadcast_to(np.arange(L), (B, L)).astype(np.int32),
        "slots": slots,
        "pair_mask": pair_mask,
        "ref_logps": rng.normal(-20, 3, (B, 2 * P)).astype(np.float32),
    }
    params = init_params(make_gradient_fn(whole).partition.trainable_specs(), jax.random.key(0))
    results = [jax.jit(make_gradient_fn(c))(params, None, batch, 1.0) for c in (whole, chunked)]
    (g_whole, s_whole, _), (g_chunk, s_chunk, _) = results
    _close(s_chunk, s_whole)
    _close(g_chunk, g_whole)
    assert not _whole_logits_in(make_gradient_fn(chunked), params, None, batch, 1.0, shape="2,32,512")
    assert float(s_whole.pairs) == 3 and float(jnp.max(jnp.abs(g_whole.lm_head))) > 1e-4
