"""Pipeline parallelism (parallel/pipeline.py): the schedule equals running the layers in order, and
training on a mesh with pipeline stages equals one device (loss, grad_norm, every gradient)."""

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mesh_fixtures import assert_same_training, run_steps

from shipyard.cli.main import main
from shipyard.config import MeshConfig, load_config
from shipyard.errors import ConfigError
from shipyard.parallel import pipeline
from shipyard.parallel.mesh import make_mesh
from shipyard.train.program import build_program

# Heavy compiles and end-to-end runs: the `make test-slow` tier (docs/testing.md: tiers).
pytestmark = pytest.mark.slow

B, L = 8, 32
TINY = [
    f"train.global_batch_size={B}",
    f"data.seq_len={L}",
    "model.num_layers=4",
    "model.hidden_size=32",
    "model.intermediate_size=64",
]
MOE = [*TINY, "model.num_layers=5", "model.moe.expert_intermediate_size=32"]  # 1 dense + 4 MoE layers


# ----------------------------------------------------------------------------- the schedule alone


def test_bubble_fraction():
    assert pipeline.bubble_fraction(1, 4) == 0.0
    assert pipeline.bubble_fraction(2, 1) == pytest.approx(1 / 2)
    assert pipeline.bubble_fraction(4, 8) == pytest.approx(3 / 11)  # GPipe: (P-1)/(M+P-1)
    assert pipeline.bubble_fraction(4, 8, repeats=2) == pytest.approx(3 / 19)  # circular: (P-1)/(MR+P-1)
    assert pipeline.Schedule(4, 8, 2).ticks == 19


def test_stages_hold_the_circular_chunks_and_layer_order_comes_back():
    layers = jnp.arange(16)
    staged = pipeline.to_stages(layers, pipeline.Schedule(stages=2, microbatches=4, repeats=4))
    assert staged.shape == (2, 4, 2)
    # stage p, round r holds chunk r*P + p: stage 0 has layers 0-1, 4-5, 8-9, 12-13
    np.testing.assert_array_equal(staged[0].reshape(-1), [0, 1, 4, 5, 8, 9, 12, 13])
    np.testing.assert_array_equal(staged[1, 2], [10, 11])
    np.testing.assert_array_equal(pipeline.to_layers(staged), layers)
    x = jnp.arange(24).reshape(6, 4)
    np.testing.assert_array_equal(pipeline.merge_microbatches(pipeline.split_microbatches(x, 3)), x)


def _toy_stage(chunk, shared, x, extras, index):
    """A chunk of toy layers (x -> tanh(x @ w + b) * scale); the first chunk adds `shared["first"]` first;
    per-layer aux: the mean of each layer's output."""
    x = jnp.where(index == 0, x + shared["first"], x)

    def layer(x, wb):
        w, b = wb
        x = jnp.tanh(x @ w + b) * extras["scale"][:, None]
        return x, jnp.mean(x)

    return jax.lax.scan(layer, x, chunk)


def _toy_sequential(params, first, x, scale):
    """The same layers in order on the whole batch."""
    w, b = params
    x = x + first
    aux = []
    for i in range(w.shape[0]):
        x = jnp.tanh(x @ w[i] + b[i]) * scale[:, None]
        aux.append(x)
    return x, aux


@pytest.mark.parametrize(
    "stages,microbatches,repeats", [(1, 2, 2), (2, 2, 1), (4, 2, 1), (2, 4, 2), (4, 4, 2), (2, 3, 4)]
)
def test_schedule_equals_the_layers_in_order(stages, microbatches, repeats):
    mesh = make_mesh(MeshConfig(pipeline=stages, data=1), jax.devices()[:stages])
    schedule = pipeline.Schedule(stages, microbatches, repeats)
    n, rows, width = 8, 6 * microbatches, 8
    keys = jax.random.split(jax.random.key(0), 5)
    params = (
        jax.random.normal(keys[0], (n, width, width)) / np.sqrt(width),
        0.1 * jax.random.normal(keys[1], (n, width)),
    )
    first = 0.5 * jax.random.normal(keys[2], (width,))
    x = jax.random.normal(keys[3], (rows, width))
    scale = 1 + 0.1 * jax.random.normal(keys[4], (rows,))

    def piped(params, first, x):
        split = pipeline.split_microbatches
        out, aux = pipeline.run(
            _toy_stage,
            params,
            {"first": first},
            split(x, microbatches),
            {"scale": split(scale, microbatches)},
            mesh,
            schedule,
        )
        return pipeline.merge_microbatches(out), aux

    # every output row and column weighs differently: a microbatch returned in another's place shows
    weights = jnp.arange(rows)[:, None] + jnp.arange(width)[None, :] / width

    def loss_piped(params, first, x):
        y, aux = piped(params, first, x)
        return jnp.sum(y * weights) + jnp.sum(aux * jnp.arange(n)) / microbatches, aux

    def loss_sequential(params, first, x):
        y, outs = _toy_sequential(params, first, x, scale)
        # the schedule sums each layer's per-microbatch mean over microbatches
        split = pipeline.split_microbatches
        aux = jnp.stack([jnp.sum(jnp.mean(split(o, microbatches), axis=(1, 2))) for o in outs])
        return jnp.sum(y * weights) + jnp.sum(aux * jnp.arange(n)) / microbatches, aux

    (got, got_aux), got_grads = jax.jit(jax.value_and_grad(loss_piped, argnums=(0, 1, 2), has_aux=True))(
        params, first, x
    )
    (want, want_aux), want_grads = jax.value_and_grad(loss_sequential, argnums=(0, 1, 2), has_aux=True)(
        params, first, x
    )
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(got_aux, want_aux, rtol=1e-5, atol=1e-6)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        assert np.linalg.norm(g - w) / np.linalg.norm(w) < 1e-5


def test_schedule_refusals():
    with pytest.raises(ConfigError, match="do not split into mesh.pipeline=2 x repeats=2"):
        pipeline.check_schedule(pipeline.Schedule(2, 4, 2), layers=6, rows=8)
    with pytest.raises(ConfigError, match="microbatches=3 does not divide the 8 sequences"):
        pipeline.check_schedule(pipeline.Schedule(2, 3), layers=4, rows=8)
    with pytest.raises(ConfigError, match="needs microbatches >= mesh.pipeline=4"):
        pipeline.check_schedule(pipeline.Schedule(4, 2, 2), layers=8, rows=8)
    cfg = load_config("tiny", [*TINY, "mesh.pipeline=2"])
    with pytest.raises(ConfigError, match="mesh.pipeline=2 needs train.pipeline.microbatches"):
        build_program(cfg, make_mesh(cfg.mesh, jax.devices()[:2]))


# ----------------------------------------------------------------------------- training on a mesh


@pytest.fixture(scope="module")
def dense_reference(byte_tokens):
    cfg = load_config("tiny", TINY)
    return run_steps(cfg, MeshConfig(data=1), jax.devices()[:1], byte_tokens)


def test_circular_pipeline_with_fsdp_and_tensor_equals_one_device(dense_reference, byte_tokens):
    """pipeline=2 x fsdp=2 x tensor=2, two rounds of the circular schedule, 4 microbatches."""
    cfg = load_config("tiny", [*TINY, "train.pipeline.microbatches=4", "train.pipeline.repeats=2"])
    run = run_steps(cfg, MeshConfig(pipeline=2, data=1, fsdp=2, tensor=2), jax.devices(), byte_tokens)
    assert_same_training(run, dense_reference)
    # the stored layout is [layers, ...] in layer order, split over the stages in contiguous blocks
    wq = run.state.params.blocks.wq
    assert wq.shape[0] == 4 and wq.sharding.spec[0] == "pipeline"
    stage0 = {d for d in run.program.mesh.devices[0].reshape(-1)}
    held = {s.index[0].start for s in wq.addressable_shards if s.device in stage0}
    assert held == {0}  # stage 0 holds layers 0-1 (stage 1 the rest)
    assert all(s.data.shape[0] == 2 for s in wq.addressable_shards)  # every device: 1/2 of the layers
    # and the compiled step pipelines: activations go stage to stage by collective-permute, and no
    # all-gather in the layer loop spans two stages (without the schedule, XLA gathers the layer stack
    # across them; the embedding and head outside the loop are sharded over every axis)
    hlo = run.program.lower_train_step().compile().as_text()
    stage = _stage_of_partition(run.program.mesh)
    hops = [_groups(line) for line in _ops(hlo, "collective-permute")]
    assert any(pairs and all(stage[a] != stage[b] for a, b in pairs) for pairs in hops), hops
    gathers = [_groups(line) for line in _ops(hlo, "all-gather") if "/while/body/" in line]
    assert gathers and all(len({stage[d] for d in g}) == 1 for groups in gathers for g in groups), gathers


def _ops(hlo: str, op: str) -> list[str]:
    """The instructions of one collective kind in a compiled module's text."""
    return [line for line in hlo.splitlines() if re.search(rf"\S+ {op}(-start)?\(", line)]


def _groups(line: str) -> list[list[int]]:
    """The device groups of a collective: its source_target_pairs, or its replica_groups written out
    ({{0,2},{1,3}}), as an iota ([4,2]<=[2,2,2]T(0,2,1)) or along axes of a named mesh
    (mesh['axis_0'=2,'axis_1'=4], device_ids=([2,2,2]T(1,0,2)) {'axis_0'})."""
    if m := re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line):
        return [[int(x) for x in g.split(",")] for g in re.findall(r"\{(\d+,\d+)\}", m[1])]
    if m := re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line):
        return [[int(x) for x in g.split(",")] for g in re.findall(r"\{([\d,]+)\}", m[1])]
    if m := re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line):
        shape, dims = [int(x) for x in m[1].split(",")], [int(x) for x in m[2].split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m[3]:
            ids = ids.transpose([int(x) for x in m[3].split(",")])
        return ids.reshape(shape).tolist()
    if m := re.search(
        r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? \{([^}]*)\}",
        line,
    ):
        axes = re.findall(r"'(\w+)'=(\d+)", m[1])  # a named mesh, groups along the listed axes
        sizes = [int(n) for _, n in axes]
        ids = np.arange(int(np.prod(sizes)))
        if m[2]:
            ids = ids.reshape([int(x) for x in m[2].split(",")])
            if m[3]:
                ids = ids.transpose([int(x) for x in m[3].split(",")])
        ids = ids.reshape(sizes)
        along = [i for i, (name, _) in enumerate(axes) if f"'{name}'" in m[4]]
        rest = [i for i in range(len(axes)) if i not in along]
        return ids.transpose(rest + along).reshape(-1, int(np.prod([sizes[i] for i in along]))).tolist()
    raise AssertionError(f"a collective whose groups this test cannot read: {line.strip()[:200]}")


def _stage_of_partition(mesh) -> dict[int, int]:
    """Pipeline stage of each SPMD partition (partition i runs on mesh.devices.flat[i])."""
    axis = mesh.axis_names.index("pipeline")
    return {i: int(np.unravel_index(i, mesh.devices.shape)[axis]) for i in range(mesh.devices.size)}


# (pipeline=4 alone was a case too: pipeline=4 x fsdp=2 runs everything it did.)
DENSE_MESHES = {
    "pipeline=2,data=4": (dict(pipeline=2, data=4), 8, ["train.pipeline.microbatches=2"]),
    "pipeline=4,fsdp=2": (dict(pipeline=4, data=1, fsdp=2), 8, ["train.pipeline.microbatches=4"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DENSE_MESHES))
def test_dense_pipeline_meshes_equal_one_device(dense_reference, byte_tokens, name):
    mesh, devices, schedule = DENSE_MESHES[name]
    cfg = load_config("tiny", [*TINY, *schedule])
    run = run_steps(cfg, MeshConfig(**mesh), jax.devices()[:devices], byte_tokens)
    assert_same_training(run, dense_reference)


# MoE: the reference accumulates the same 4 microbatches (train.microbatches=4, the same strided rows),
# since the balance losses are per-microbatch means; 16 rows keep 4 rows per microbatch, which the
# expert axis divides.
# (pipeline=4 x expert=2 was a case too: four stages are the dense cases', experts within a stage
# these two's.)
MOE_MESHES = {
    "pipeline=2,expert=4": dict(pipeline=2, data=1, expert=4),
}


@pytest.fixture(scope="module")
def moe_reference(byte_tokens):
    cfg = load_config("moe-tiny", [*MOE, "train.global_batch_size=16", "train.microbatches=4"])
    return run_steps(cfg, MeshConfig(data=1), jax.devices()[:1], byte_tokens)


@pytest.mark.slow
@pytest.mark.parametrize("name", [*MOE_MESHES, "pipeline=2,fsdp=2,expert=2,circular"])
def test_moe_pipeline_meshes_equal_one_device(moe_reference, byte_tokens, name):
    """MoE layers inside the stages (expert-parallel within each), the leading dense layer in stage 0."""
    extra = ["train.pipeline.repeats=2"] if name.endswith("circular") else []
    mesh = MOE_MESHES.get(name, dict(pipeline=2, data=1, fsdp=2, expert=2))
    cfg = load_config(
        "moe-tiny", [*MOE, "train.global_batch_size=16", "train.pipeline.microbatches=4", *extra]
    )
    run = run_steps(cfg, MeshConfig(**mesh), jax.devices(), byte_tokens)
    assert_same_training(run, moe_reference)
    assert run.state.params.moe_blocks.moe.w_gate.sharding.spec[:2] == ("pipeline", "expert")


# ----------------------------------------------------------------------------- runs: resume, two processes

RUN = [
    *TINY,
    "train.logging.log_every=1",
    "train.logging.progress=false",
    # a constant rate after a short warmup: step s's rate does not depend on train.steps
    "train.schedule.kind=constant",
    "train.schedule.warmup_steps=2",
]


def _losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_checkpoint_of_one_layout_resumes_on_others(tmp_path, byte_tokens, capsys):
    """Trained 3 steps on pipeline=2 x fsdp=4, resumed to 5 on fsdp=8 (one stage, one microbatch) and
    on pipeline=4 x data=2: the resumed steps equal a straight 5-step run without a pipeline."""
    base = ["train", "tiny", f"data.train_tokens={byte_tokens}", *RUN, "train.pipeline.microbatches=2"]
    layouts = {
        "p2f4": ["mesh.pipeline=2", "mesh.data=1", "mesh.fsdp=4"],
        # one stage, the whole batch as one microbatch (a run may change its schedule on resume)
        "f8": ["mesh.data=1", "mesh.fsdp=8", "train.pipeline.microbatches=1"],
        "p4d2": ["mesh.pipeline=4", "mesh.data=2"],
    }
    straight = tmp_path / "straight"
    plain = ["train", "tiny", f"data.train_tokens={byte_tokens}", *RUN, "train.steps=5"]
    assert main([*plain, "mesh.data=8", "--run-dir", str(straight)]) == 0
    first = tmp_path / "f8"
    assert main([*base, *layouts["p2f4"], "train.steps=3", "--run-dir", str(first)]) == 0
    assert (
        "pipeline 2 stage(s) (GPipe), 2 microbatches: bubble 33.3% of stage time" in capsys.readouterr().out
    )
    shutil.copytree(first, tmp_path / "p4d2")
    for name in ("f8", "p4d2"):
        resumed = tmp_path / name
        assert main([*base, *layouts[name], "train.steps=5", "--run-dir", str(resumed), "--resume"]) == 0
        assert "resumed from checkpoint 3" in capsys.readouterr().out
        np.testing.assert_allclose(_losses(resumed), _losses(straight), rtol=1e-5, err_msg=name)


def _launch(*args, devices_per_process: int):
    env = dict(os.environ, SHIPYARD_NO_REEXEC="1")
    argv = [sys.executable, "-m", "shipyard.cli.main", "launch", *args]
    argv += ["--devices-per-process", str(devices_per_process)]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_two_process_cluster_runs_one_stage_per_process(tmp_path, byte_tokens):
    """pipeline=2 on 2 processes x 4 devices: pipeline is the mesh's outermost axis, so stage 0 is
    process 0's devices and stage 1 process 1's; the losses equal one process of 8 devices."""
    common = ["tiny", f"data.train_tokens={byte_tokens}", *RUN, "train.steps=4"]
    common += ["mesh.pipeline=2", "mesh.data=4", "train.pipeline.microbatches=2"]
    two = _launch("--processes", "2", *common, "--run-dir", str(tmp_path / "two"), devices_per_process=4)
    assert two.returncode == 0, two.stdout + two.stderr
    assert "8 cpu device(s) in 2 processes" in two.stdout and "bubble 33.3%" in two.stdout
    one = _launch("--processes", "1", *common, "--run-dir", str(tmp_path / "one"), devices_per_process=8)
    assert one.returncode == 0, one.stdout + one.stderr
    assert len(_losses(tmp_path / "one")) == 4
    np.testing.assert_allclose(_losses(tmp_path / "two"), _losses(tmp_path / "one"), rtol=1e-5)


def test_stages_are_processes_on_a_cluster_grid():
    """The device grid puts the pipeline axis outermost: with devices listed process by process (as
    jax.devices() is), each stage is one process's block of devices."""

    @dataclass(frozen=True)
    class FakeDevice:
        id: int
        process_index: int

    devices = [FakeDevice(i, i // 4) for i in range(8)]
    grid = make_mesh(MeshConfig(pipeline=2, data=2, fsdp=2), devices).devices
    for stage in range(2):
        assert {d.process_index for d in grid[stage].reshape(-1)} == {stage}
