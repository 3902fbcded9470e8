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
from kill_fixtures import final_params, logged_losses, logged_rows, start_train

from shipyard.cli.main import main
from shipyard.config import CheckpointConfig, load_config
from shipyard.model.params import param_shardings
from shipyard.model.transformer import param_specs
from shipyard.parallel.mesh import DEFAULT_RULES, make_mesh
from shipyard.run.checkpoint import Checkpointer, restore, restore_latest
from shipyard.train.optim import build_optimizer
from shipyard.train.program import abstract_state

RUN = ["train.logging.progress=false", "train.logging.log_every=1", "train.checkpoint.every=10"]


def _losses(run_dir):
    return logged_losses(run_dir)


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


def _files(directory):
    """{file: (size, mtime)} under `directory`: any write shows."""
    return {
        p.relative_to(directory).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in directory.rglob("*")
        if p.is_file()
    }


@pytest.mark.slow
def test_resume_refuses_what_would_not_continue_the_run(tmp_path, byte_tokens, capsys):
    """--resume refuses another model, batch size, sequence length, seed or training data: one line
    naming the field, exit 4, nothing in the run directory touched; raising train.steps (with the
    data moved to another path, data.seed set to the seed in effect) continues the run."""
    run = tmp_path / "r"
    base = [
        "train",
        "tiny",
        f"data.train_tokens={byte_tokens}",
        "train.steps=10",
        "--run-dir",
        str(run),
        *RUN,
    ]
    assert main(base) == 0
    before = _files(run)
    other = tmp_path / "other.npy"  # the same tokens in another order: another data source
    np.save(other, np.ascontiguousarray(np.load(byte_tokens)[::-1]))
    refused = {
        "model.hidden_size=128": "(model.hidden_size: 64 there, 128 in this config)",
        "train.global_batch_size=16": "train.global_batch_size: 8, this config has 16",
        "data.seq_len=64": "data.seq_len: 128, this config has 64",
        "train.seed=1": "train.seed: 0, this config has 1",
        "data.seed=1": "the data seed (data.seed, or train.seed when null): 0, this config has 1",
        f"data.train_tokens={other}": f"train_tokens ({other}) is not the data the run",
    }
    capsys.readouterr()
    for override, says in refused.items():
        assert main([*base, "--resume", override]) == 4, override
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: --resume") and says in err, (override, err)
        assert _files(run) == before, f"{override}: the refused resume wrote into the run directory"
    # without --resume an existing run is refused, and the message says how to continue it
    assert main(base) == 4 and "--resume" in capsys.readouterr().err
    moved = tmp_path / "moved.npy"
    moved.write_bytes(byte_tokens.read_bytes())
    argv = [*base, "--resume", "train.steps=12", "data.seed=0", f"data.train_tokens={moved}"]
    assert main(argv) == 0 and "resumed from checkpoint 10" in capsys.readouterr().out
    assert sorted(_losses(run)) == list(range(12)) and (run / "checkpoints" / "12").is_dir()


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
    args = ["tiny", f"data.train_tokens={tokens}", "train.steps=40", "train.global_batch_size=16", *RUN]
    return start_train(run_dir, [*args, *extra])  # one device: the fastest here


def _final_params(run_dir):
    return final_params(run_dir, 40)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, byte_tokens):
    run = tmp_path_factory.mktemp("straight") / "run"
    proc = _cli(run, byte_tokens)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    return run


TWICE = "SIGINT twice"
"""Ctrl-C, then Ctrl-C again once the run has said it is saving (while it finishes the step and saves)."""
# SIGTERM takes the path SIGINT does (train/stopping.py); a SIGTERM is tested on a two-process
# cluster in test_launch_signals.py, so it is not run again here
SIGNALS = [signal.SIGKILL, signal.SIGINT, TWICE]


def _interrupt(proc, sig) -> str:
    """Send `sig` (or TWICE) to the run; its whole output."""
    if sig != TWICE:
        proc.send_signal(sig)
        return proc.communicate(timeout=120)[0]
    proc.send_signal(signal.SIGINT)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "SIGINT received: saving a checkpoint" in line:
            proc.send_signal(signal.SIGINT)
            break
    return "".join(seen) + proc.communicate(timeout=120)[0]


def _check_stop(proc, sig, out: str, run) -> None:
    """What each signal promises: SIGTERM / SIGINT save a checkpoint and exit 0 saying how to resume;
    a second Ctrl-C stops at once with 130 and saves nothing."""
    if sig == TWICE:
        assert proc.returncode == 130 and "SIGINT again: stopped at once without saving" in out, out
        assert "saved checkpoint" not in out, out
    elif sig != signal.SIGKILL:
        name = signal.Signals(sig).name
        assert proc.returncode == 0 and f"{name} received: saved checkpoint" in out, out
        assert "continue with the same command plus --resume" in out, out
        saved = int(out.split("saved checkpoint ")[1].split()[0])
        assert (run / "checkpoints" / f"{saved}.sha256.json").is_file(), (
            "the stop's checkpoint was not finished"
        )


_SECOND_CTRL_C = """
import signal, threading, time
from shipyard.train.stopping import StopSignal

def ctrl_c(stop):
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    deadline = time.time() + 10
    while stop.received is None and time.time() < deadline:
        time.sleep(0.01)

with StopSignal() as stop:
    ctrl_c(stop)
    print("first Ctrl-C asked to stop:", signal.Signals(stop.received).name, flush=True)
    ctrl_c(stop)
    time.sleep(10)
    print("still running after the second Ctrl-C", flush=True)
"""


def test_second_ctrl_c_stops_at_once_with_130():
    """The loop's stop signal: a first SIGINT asks for a stop (and says so), a second one ends the
    process at once, exit 130, without unwinding into the cleanup that waits for saves."""
    env = dict(os.environ, XLA_FLAGS="")
    proc = subprocess.run(
        [sys.executable, "-c", _SECOND_CTRL_C], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 130, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == "first Ctrl-C asked to stop: SIGINT\n", proc.stdout
    said = [line for line in proc.stderr.splitlines() if line]
    assert said[0].startswith("shipyard: SIGINT received: saving a checkpoint") and "Ctrl-C again" in said[0]
    assert said[1].startswith("shipyard: SIGINT again: stopped at once without saving"), proc.stderr
    assert "Traceback" not in proc.stderr


_CTRL_C_DURING_THE_MESSAGE = """
import os, signal, time
from shipyard.train.stopping import StopSignal

class Hurried(StopSignal):
    sent = False

    def _say(self, line):
        if not Hurried.sent:  # Ctrl-C again while the first one's line is being written:
            Hurried.sent = True
            os.kill(os.getpid(), signal.SIGINT)  # Python runs that handler inside this one
        super()._say(line)

with Hurried():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
    print("still running after the second Ctrl-C", flush=True)
"""


def test_a_second_ctrl_c_during_the_first_ones_message_still_stops_at_once():
    """The slow SIGINT-twice case once exited 0: its second Ctrl-C came while the first handler was
    still writing, before it had marked the first as received."""
    env = dict(os.environ, XLA_FLAGS="")
    proc = subprocess.run(
        [sys.executable, "-c", _CTRL_C_DURING_THE_MESSAGE],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 130 and "still running" not in proc.stdout, (proc.returncode, proc.stderr)
    assert "SIGINT again: stopped at once" in proc.stderr, proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("sig", SIGNALS, ids=["SIGKILL", "SIGINT", "SIGINT-twice"])
def test_interrupted_then_resumed_run_is_bitwise_equal(tmp_path, byte_tokens, straight, sig):
    run = tmp_path / "run"
    proc = _cli(run, byte_tokens)
    first = run / "checkpoints" / "10"
    deadline = time.time() + 240
    while not first.is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be interrupted"
    time.sleep(random.Random(sig).uniform(0.0, 0.6))  # anywhere after the first checkpoint, saves included
    out = _interrupt(proc, sig)
    _check_stop(proc, sig, out, run)
    interrupted_at = max(_losses(run)) if (run / "metrics.jsonl").exists() else -1
    assert interrupted_at < 39, "interrupted too late to test resume"
    proc = _cli(run, byte_tokens, "--resume")
    out, _ = proc.communicate(timeout=300)
    # resumed from a complete checkpoint: none was taken for one and then found unusable
    assert proc.returncode == 0 and "resumed from checkpoint" in out and "unusable" not in out, out
    a, b = _losses(straight), _losses(run)
    assert sorted(b) == list(range(40)) and all(a[s] == b[s] for s in range(40))  # bitwise: float equality
    # each step logged once, in order: the killed run's steps after its checkpoint were dropped
    assert [r["step"] for r in logged_rows(run)] == list(range(40))
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
