"""Sharded training on a device mesh: same numbers as one device; each array laid out by the rules."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from mesh_fixtures import Run, assert_same_training, run_steps

from shipyard.config import MeshConfig, load_config
from shipyard.parallel.distributed import settings
from shipyard.parallel.mesh import logical_to_pspec

# Heavy compiles and end-to-end runs: the `make test-slow` tier (docs/testing.md: tiers).
pytestmark = pytest.mark.slow

MESHES = {
    "data=8": dict(data=8),
    "fsdp=8": dict(data=1, fsdp=8),
    "tensor=4,fsdp=2": dict(data=1, fsdp=2, tensor=4),
    "data=2,fsdp=2,tensor=2": dict(data=2, fsdp=2, tensor=2),
}


@pytest.fixture(scope="module")
def reference(byte_tokens):
    cfg = load_config("tiny", ["train.global_batch_size=8", "data.seq_len=64"])
    return cfg, run_steps(cfg, MeshConfig(data=1), jax.devices()[:1], byte_tokens)


def _assert_optimizer_state_laid_out_like_params(run: Run) -> None:
    """Every optimizer moment that mirrors a parameter has that parameter's sharding."""
    pairs = []
    optax.tree_map_params(
        run.program.optimizer,
        lambda moment, param: pairs.append((moment, param)),
        run.state.opt_state,
        run.state.params,
        transform_non_params=lambda x: x,
    )
    assert len(pairs) >= 2 * len(jax.tree.leaves(run.state.params))  # AdamW's mu and nu at least
    for moment, param in pairs:
        assert moment.shape == param.shape
        assert moment.sharding.is_equivalent_to(param.sharding, param.ndim), (moment.sharding, param.sharding)


@pytest.mark.parametrize("name", list(MESHES))
def test_sharded_steps_equal_one_device(reference, byte_tokens, name):
    cfg, ref = reference
    run = run_steps(cfg, MeshConfig(**MESHES[name]), jax.devices(), byte_tokens)
    assert_same_training(run, ref)
    for got, want in zip(
        jax.tree.leaves(jax.device_get(run.state.params)), jax.tree.leaves(ref.state.params)
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # every parameter is laid out exactly as the rules say, and its optimizer moments like it
    mesh, rules = run.program.mesh, run.program.rules
    for spec, arr in zip(jax.tree.leaves(run.program.specs), jax.tree.leaves(run.state.params)):
        want = logical_to_pspec(spec.logical_axes, spec.shape, mesh, rules)
        assert arr.sharding.is_equivalent_to(NamedSharding(mesh, want), arr.ndim), (
            spec.logical_axes,
            arr.sharding,
        )
    _assert_optimizer_state_laid_out_like_params(run)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_fsdp8_each_device_holds_an_eighth(byte_tokens, optimizer):
    cfg = load_config(
        "tiny", ["train.global_batch_size=8", "data.seq_len=64", f"train.optimizer.name={optimizer}"]
    )
    state = run_steps(cfg, MeshConfig(data=1, fsdp=8), jax.devices(), byte_tokens, steps=1).state
    for tree in (state.params, state.opt_state):
        total = on_device0 = 0
        for leaf in jax.tree.leaves(tree):
            if leaf.size < 64:
                continue  # step counters and constants (Muon's Newton-Schulz coefficients): replicated, tiny
            total += leaf.nbytes
            on_device0 += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == jax.devices()[0])
        assert on_device0 * 8 == total, (on_device0, total)


def test_distributed_settings_from_config_and_environment(monkeypatch):
    from shipyard.config import DistributedConfig
    from shipyard.errors import ConfigError

    for key in ("SHIPYARD_COORDINATOR", "SHIPYARD_NUM_PROCESSES", "SHIPYARD_PROCESS_ID", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    assert settings(DistributedConfig()) is None
    monkeypatch.setenv("SHIPYARD_COORDINATOR", "10.0.0.1:1234")
    with pytest.raises(ConfigError, match="together"):
        settings(DistributedConfig())
    monkeypatch.setenv("SHIPYARD_NUM_PROCESSES", "4")
    monkeypatch.setenv("SHIPYARD_PROCESS_ID", "2")
    got = settings(DistributedConfig())
    assert (got["coordinator_address"], got["num_processes"], got["process_id"]) == ("10.0.0.1:1234", 4, 2)
    assert settings(DistributedConfig(process_id=3))["process_id"] == 3  # config wins
    with pytest.raises(ConfigError, match="outside 0..3"):
        settings(DistributedConfig(process_id=7))


def _launch(tmp_path, *args, devices_per_process=4):
    env = dict(os.environ, SHIPYARD_NO_REEXEC="1")
    argv = [sys.executable, "-m", "shipyard.cli.main", "launch", *args]
    if devices_per_process:
        argv += ["--devices-per-process", str(devices_per_process)]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)


def test_launch_stops_when_processes_fail(tmp_path):
    r = _launch(
        tmp_path,
        "--processes",
        "2",
        "tiny",
        f"data.train_tokens={tmp_path / 'missing.npy'}",
        "--run-dir",
        str(tmp_path / "r"),
    )
    assert r.returncode == 3 and "does not exist" in r.stderr


@pytest.mark.slow
def test_two_process_cluster_matches_one_process_and_resumes_on_four_devices(tmp_path, byte_tokens):
    common = [
        "tiny",
        f"data.train_tokens={byte_tokens}",
        "train.logging.log_every=1",
        "train.logging.progress=false",
        # a constant rate after a short warmup: step s's rate does not depend on train.steps,
        # so a 10-step run resumed to 12 can be compared with a straight 12-step run
        "train.schedule.kind=constant",
        "train.schedule.warmup_steps=2",
    ]
    r = _launch(tmp_path, "--processes", "2", *common, "train.steps=10", "--run-dir", str(tmp_path / "two"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "8 cpu device(s) in 2 processes" in r.stdout
    one = _launch(
        tmp_path,
        "--processes",
        "1",
        *common,
        "train.steps=12",
        "--run-dir",
        str(tmp_path / "one"),
        devices_per_process=8,
    )
    assert one.returncode == 0, one.stderr

    def losses(run):
        return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]

    straight = losses(tmp_path / "one")
    assert len(straight) == 12
    np.testing.assert_allclose(losses(tmp_path / "two"), straight[:10], rtol=1e-5)
    assert (tmp_path / "two" / "checkpoints" / "10").is_dir()
    resumed = _launch(
        tmp_path,
        "--processes",
        "1",
        *common,
        "train.steps=12",
        "--run-dir",
        str(tmp_path / "two"),
        "--resume",
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from checkpoint 10" in resumed.stdout and "4 cpu device(s)" in resumed.stdout
    rows = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(12))
    # the steps after the resume (2-process checkpoint, 1 process of 4 devices) continue the straight run
    np.testing.assert_allclose([r["loss"] for r in rows], straight, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.xdist_group("ray")  # one Ray cluster on the machine at a time (tests/xdist_schedule.py)
def test_launch_on_a_local_ray_instance(tmp_path, byte_tokens, monkeypatch):
    pytest.importorskip("ray")
    # Ray >= 2.5x turns on token auth once ~/.ray/auth_token exists (any earlier local
    # ray.init writes one); a throwaway test cluster runs without it, explicitly.
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    from shipyard.parallel.launch import free_port

    port = free_port()
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    start = [ray_bin, "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false"]
    subprocess.run([*start, "--disable-usage-stats"], check=True, capture_output=True, timeout=180)
    try:
        args = ["tiny", f"data.train_tokens={byte_tokens}", "train.steps=4", "train.logging.progress=false"]
        r = _launch(
            tmp_path,
            "--ray",
            f"127.0.0.1:{port}",
            "--processes",
            "2",
            *args,
            "--run-dir",
            str(tmp_path / "r"),
        )
        assert r.returncode == 0, r.stdout + r.stderr
        assert "in 2 processes" in r.stdout + r.stderr
        rows = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
        assert json.loads(rows[-1])["step"] == 3
    finally:
        subprocess.run([ray_bin, "stop", "--force"], capture_output=True, timeout=120)
