"""`shipyard train` as a child process for kill-and-resume tests: start it, wait for a moment in
the run (a logged step, a checkpoint save in progress), and read back what it left."""

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax

from shipyard.run.checkpoint import restore

# Orbax writes a checkpoint under "<step>.orbax-checkpoint-tmp..." and renames it when complete.
_SAVING = "orbax-checkpoint-tmp"


def start_train(run_dir: Path, args: list[str], devices: int = 1) -> subprocess.Popen:
    """`shipyard train ARGS --run-dir RUN_DIR` on `devices` host CPU devices (stdout and stderr
    together, as text). One device is the fastest for models that need no mesh."""
    flags = "" if devices == 1 else f"--xla_force_host_platform_device_count={devices}"
    env = dict(os.environ, XLA_FLAGS=flags, SHIPYARD_NO_REEXEC="1")
    argv = [sys.executable, "-m", "shipyard.cli.main", "train", *args, "--run-dir", str(run_dir)]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def logged_rows(run_dir: Path) -> list[dict]:
    """The rows of the run's metrics.jsonl in file order ([] before the first); a line still being
    written (the run killed mid-write) is left out."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def logged_losses(run_dir: Path) -> dict[int, float]:
    """{step: loss} of the run's metrics.jsonl (the last row of a step wins)."""
    return {row["step"]: row["loss"] for row in logged_rows(run_dir)}


def saves_in_progress(run_dir: Path) -> list[str]:
    """Names of the checkpoint directories Orbax is still writing (not yet renamed into place)."""
    directory = Path(run_dir) / "checkpoints"
    return sorted(p.name for p in directory.iterdir() if _SAVING in p.name) if directory.is_dir() else []


def wait_until(proc: subprocess.Popen, condition: Callable[[], bool], timeout: float = 240) -> None:
    """Poll `condition` every few milliseconds while `proc` runs; fail if the run ends first or time is up."""
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, (
            "the run finished before the moment to interrupt it:\n" + proc.stdout.read()
        )
        assert time.time() < deadline, "timed out waiting for the moment to interrupt the run"
        time.sleep(0.005)


def final_params(run_dir: Path, step: int) -> list:
    """The params leaves of checkpoint `step` of a run (restored as saved)."""
    return jax.tree.leaves(restore(Path(run_dir) / "checkpoints", step, None)["params"])
