"""`shipyard` commands as children forked from a process that has imported shipyard already.

The kill-and-resume tests start a few hundred short `shipyard train` runs; as fresh interpreters,
each spent about a third of its time importing JAX, Orbax and shipyard before its first step. Here a
`multiprocessing` fork server imports them once (no JAX backend started, so no XLA thread is forked)
and every run is a fork of it: the same `main(argv)` under the same environment, with its own
stdout/stderr file, exit code and pid (a SIGKILL shows as -9, as for a subprocess).
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

# What every `shipyard train` imports before its first step (the fork server imports them once).
PRELOAD = ["shipyard.cli.main", "shipyard.train.trainer", "shipyard.run.checkpoint", "shipyard.storage"]

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(PRELOAD)


def _child(argv: list[str], env: dict[str, str], out: str) -> None:
    """The forked run: the environment and output of a subprocess, then what `shipyard` does."""
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.clear()
    os.environ.update(env)
    faulthandler.enable()  # a hung run stopped with SIGABRT prints where each thread was
    from shipyard import cpu_tuning
    from shipyard.cli.main import main

    cpu_tuning.apply_xla_flags()  # as `shipyard`'s entry point does, before the backend starts
    cpu_tuning.pin_cpu_platform()
    try:
        code = main(argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def run(argv: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    """`shipyard ARGV` under `env` in a forked child: (return code, stdout and stderr together).
    A run past `timeout` is stopped with SIGABRT and fails the test with where its threads were."""
    with tempfile.NamedTemporaryFile(prefix="shipyard-fork-", suffix=".out") as out:
        proc = _CONTEXT.Process(target=_child, args=(list(argv), dict(env), out.name))
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            os.kill(proc.pid, signal.SIGABRT)
            proc.join(60)
            text = Path(out.name).read_text(errors="replace")
            raise AssertionError(f"the run hung ({timeout:.0f} s); where its threads were:\n{text[-8000:]}")
        text = Path(out.name).read_text(errors="replace")
    return subprocess.CompletedProcess(["shipyard", *argv], proc.exitcode, text)
