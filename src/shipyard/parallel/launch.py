"""`shipyard launch`: start the processes of one JAX cluster running `shipyard train`.

Locally (`--processes N`) the N processes run on this host and find each other
through a coordinator on 127.0.0.1 (CPU collectives go through gloo), which is
how multi-host code is tested without hosts. On Ray (`--ray ADDRESS`) one
process runs per Ray node, the coordinator on the first node.

Every process gets SHIPYARD_COORDINATOR / SHIPYARD_NUM_PROCESSES /
SHIPYARD_PROCESS_ID (read by parallel/distributed.py). If one process fails,
the others are stopped: a cluster missing a member would wait in its next
collective until the timeout.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

from shipyard.errors import ConfigError

GRACE_S = 10


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(base: dict, coordinator: str, n: int, i: int, devices_per_process: int | None) -> dict:
    env = dict(
        base, SHIPYARD_COORDINATOR=coordinator, SHIPYARD_NUM_PROCESSES=str(n), SHIPYARD_PROCESS_ID=str(i)
    )
    if devices_per_process is not None:
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices_per_process}".strip()
    return env


def train_command(train_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "shipyard.cli", "train", *train_args]


def launch_local(n: int, train_args: list[str], devices_per_process: int | None = None) -> int:
    """Run `shipyard train` in n local processes forming one cluster; the first failing exit code, else 0."""
    if n < 1:
        raise ConfigError(f"launch --processes: {n} is not a positive number of processes")
    coordinator = f"127.0.0.1:{free_port()}"
    # Each process in a session of its own: a Ctrl-C in the terminal goes to the terminal's process
    # group, which would otherwise deliver it to every process *and* to us, and our forwarding would
    # make it a second Ctrl-C (stop at once, no checkpoint). So only we receive it, and forward it once.
    procs = [
        subprocess.Popen(
            train_command(train_args),
            env=process_env(os.environ, coordinator, n, i, devices_per_process),
            start_new_session=True,
            preexec_fn=_stop_with_parent,
        )
        for i in range(n)
    ]

    def forward(signum, frame):  # SIGTERM/Ctrl-C: every process checkpoints and exits
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _wait_all(procs)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop_with_parent() -> None:
    """In the child, before exec: SIGTERM (checkpoint and exit) when the launcher dies, even by
    SIGKILL, since a process in its own session no longer shares the launcher's fate. Linux only; a
    no-op elsewhere."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))


def _wait_all(procs: list[subprocess.Popen]) -> int:
    failed_at = None
    code = 0
    while any(p.poll() is None for p in procs):
        bad = [p.returncode for p in procs if p.returncode not in (None, 0)]
        if bad and failed_at is None:
            failed_at, code = time.monotonic(), bad[0]
            print(f"shipyard launch: a process exited with code {code}; stopping the others", file=sys.stderr)
            for p in procs:
                if p.poll() is None:
                    p.terminate()
        if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.1)
    if code == 0:
        code = next((p.returncode for p in procs if p.returncode != 0), 0)
    return code


def launch_ray(
    address: str, n: int | None, train_args: list[str], devices_per_process: int | None = None
) -> int:
    """One `shipyard train` process per Ray node (or n processes spread over the nodes)."""
    try:
        import ray
    except ImportError as e:
        raise ConfigError("launch --ray: ray is not installed (pip install 'shipyard[ray]')") from e

    ray.init(address=address, log_to_driver=True)
    try:
        nodes = [node for node in ray.nodes() if node.get("Alive")]
        count = n or len(nodes)
        first_ip = nodes[0]["NodeManagerAddress"]
        coordinator = f"{first_ip}:{_remote_free_port(ray, first_ip)}"

        @ray.remote(num_cpus=0)
        def run(i: int) -> int:
            env = process_env(os.environ, coordinator, count, i, devices_per_process)
            return subprocess.run(train_command(train_args), env=env).returncode

        # process 0 on the coordinator's node, the rest spread over the nodes in turn
        refs = []
        for i in range(count):
            ip = nodes[i % len(nodes)]["NodeManagerAddress"] if i else first_ip
            refs.append(run.options(resources={f"node:{ip}": 0.001}).remote(i))
        codes = ray.get(refs)
    finally:
        ray.shutdown()
    return next((c for c in codes if c != 0), 0)


def _remote_free_port(ray, ip: str) -> int:
    @ray.remote(num_cpus=0)
    def port() -> int:
        return free_port()

    return ray.get(port.options(resources={f"node:{ip}": 0.001}).remote())
