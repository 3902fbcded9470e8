"""Checkpoints: exact resume after SIGKILL / SIGTERM, corrupt-checkpoint fallback, other device counts."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from shipyard.cli.main import main
from shipyard.config import CheckpointConfig, load_config
from shipyard.model.params import param_shardings
from shipyard.model.transformer import param_specs
from shipyard.parallel.mesh import DEFAULT_RULES, make_mesh
from shipyard.train.checkpoint import Checkpointer, restore, restore_latest
from shipyard.train.optim import build_optimizer
from shipyard.train.program import abstract_state

RUN = ["train.logging.progress=false", "train.logging.log_every=1", "train.checkpoint.every=10"]


def _losses(run_dir):
    return {
        r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    }


def _small_state(value):
    return {"w": np.full((4, 3), value, np.float32), "step": np.int32(value)}


def test_corrupt_checkpoint_falls_back_to_the_previous_one(tmp_path):
    ckpt = Checkpointer(tmp_path, CheckpointConfig(every=1, keep=None), total_steps=3)
    for step in (1, 2, 3):
        ckpt.save(step, _small_state(step))
        ckpt.close()  # waits, then hashes
        ckpt = Checkpointer(tmp_path, CheckpointConfig(every=1, keep=None), total_steps=3)
    directory = tmp_path / "checkpoints"
    assert sorted(p.name for p in directory.glob("*.sha256.json")) == [
        "1.sha256.json",
        "2.sha256.json",
        "3.sha256.json",
    ]
    victim = max((p for p in (directory / "3").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    said = []
    step, state = restore_latest(directory, None, say=said.append)
    assert step == 2 and float(np.asarray(state["w"])[0, 0]) == 2.0
    assert len(said) == 1 and "checkpoint 3" in said[0] and "falling back to checkpoint 2" in said[0]
    # a truncated file in the newest good one: fall back again
    victim2 = max((p for p in (directory / "2").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    victim2.write_bytes(victim2.read_bytes()[:10])
    step, _ = restore_latest(directory, None, say=said.append)
    assert step == 1 and "truncated or corrupted" in said[-1]


def test_restore_onto_other_device_counts(tmp_path):
    cfg = load_config("tiny", ["mesh.data=1", "mesh.fsdp=8"])
    specs = param_specs(cfg.model)
    opt = build_optimizer(cfg.train, specs)
    mesh8 = make_mesh(cfg.mesh)
    abstract8 = abstract_state(cfg, specs, param_shardings(specs, mesh8, DEFAULT_RULES), opt)
    state = jax.tree.map(
        lambda a: jax.device_put(
            np.random.default_rng(0).standard_normal(a.shape).astype(a.dtype), a.sharding
        ),
        abstract8,
    )
    wq = state.params.blocks.wq
    assert len({s.device for s in wq.addressable_shards}) == 8 and wq.addressable_shards[0].data.shape[1] == 8
    ckpt = Checkpointer(tmp_path, CheckpointConfig(), total_steps=1)
    ckpt.save(1, state)
    ckpt.close()
    for n, fsdp in ((4, 4), (1, 1)):
        cfg_n = load_config("tiny", ["mesh.data=1", f"mesh.fsdp={fsdp}"])
        mesh = make_mesh(cfg_n.mesh, jax.devices()[:n])
        abstract = abstract_state(cfg_n, specs, param_shardings(specs, mesh, DEFAULT_RULES), opt)
        back = restore(tmp_path / "checkpoints", 1, abstract)
        assert back.params.blocks.wq.sharding.mesh.devices.size == n
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back)):
            assert np.array_equal(np.asarray(a), np.asarray(b))


def test_resume_refuses_another_model_and_keeps_the_checkpoints(tmp_path, byte_tokens, capsys):
    base = [
        "train",
        "tiny",
        f"data.train_tokens={byte_tokens}",
        "train.steps=10",
        "--run-dir",
        str(tmp_path / "r"),
        *RUN,
    ]
    assert main(base) == 0
    before = sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir())
    capsys.readouterr()
    assert main([*base, "--resume", "model.hidden_size=128"]) == 4
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.hidden_size: 64 there, 128 in this config" in err
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == before
    # without --resume an existing run is refused, and the message says how to continue it
    assert main(base) == 4 and "--resume" in capsys.readouterr().err


def test_in_loop_validation_loss_is_logged(tmp_path, byte_tokens):
    argv = ["train", "tiny", f"data.train_tokens={byte_tokens}", f"data.validation_tokens={byte_tokens}"]
    assert (
        main(
            [
                *argv,
                "train.steps=6",
                "train.eval_every=3",
                "train.logging.log_every=100",
                "--run-dir",
                str(tmp_path / "v"),
                "train.logging.progress=false",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in (tmp_path / "v" / "metrics.jsonl").read_text().splitlines()]
    with_val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    assert sorted(with_val) == [2, 5] and with_val[5] < with_val[2] < 7.0


def _cli(run_dir, tokens, *extra):
    env = dict(os.environ, XLA_FLAGS="", SHIPYARD_NO_REEXEC="1")  # one device: the fastest here
    argv = [
        sys.executable,
        "-m",
        "shipyard.cli.main",
        "train",
        "tiny",
        f"data.train_tokens={tokens}",
        "train.steps=40",
    ]
    argv += ["train.global_batch_size=16", *RUN, "--run-dir", str(run_dir), *extra]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _final_params(run_dir):
    return jax.tree.leaves(restore(run_dir / "checkpoints", 40, None)["params"])


@pytest.fixture(scope="module")
def straight(tmp_path_factory, byte_tokens):
    run = tmp_path_factory.mktemp("straight") / "run"
    proc = _cli(run, byte_tokens)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    return run


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_interrupted_then_resumed_run_is_bitwise_equal(tmp_path, byte_tokens, straight, sig):
    run = tmp_path / "run"
    proc = _cli(run, byte_tokens)
    first = run / "checkpoints" / "10"
    deadline = time.time() + 240
    while not first.is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be interrupted"
    time.sleep(random.Random(sig).uniform(0.0, 0.6))  # anywhere after the first checkpoint, saves included
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    if sig == signal.SIGTERM:
        assert proc.returncode == 0 and "SIGTERM received: saved checkpoint" in out, out
    interrupted_at = max(_losses(run)) if (run / "metrics.jsonl").exists() else -1
    assert interrupted_at < 39, "interrupted too late to test resume"
    proc = _cli(run, byte_tokens, "--resume")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "resumed from checkpoint" in out, out
    a, b = _losses(straight), _losses(run)
    assert sorted(b) == list(range(40)) and all(a[s] == b[s] for s in range(40))  # bitwise: float equality
    for x, y in zip(_final_params(straight), _final_params(run)):
        assert np.array_equal(np.asarray(x), np.asarray(y))


def test_keep_last_n_plus_every_mth_permanently(tmp_path):
    ckpt = Checkpointer(tmp_path, CheckpointConfig(every=1, keep=2, keep_every=3), total_steps=7)
    for step in range(1, 8):
        ckpt.save(step, _small_state(step))
    ckpt.close()
    kept = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert kept == [3, 6, 7]
    sidecars = sorted(p.name for p in (tmp_path / "checkpoints").glob("*.sha256.json"))
    assert sidecars == ["3.sha256.json", "6.sha256.json", "7.sha256.json"]
