"""Running a reply's code for a reward: a separate Python process with a wall-clock and CPU time limit,
a memory limit, an empty environment, a fresh temporary working directory, and no network.

No network: the child runs in a new network namespace (`unshare -rn`: only a loopback that is down)
where the machine allows it, and in any case the code runs after `socket` is replaced by a function
that refuses. The namespace is the boundary; the `socket` guard alone is not one (the code could
import `_socket`), so on a machine without namespaces, run models you do not trust in a container.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
import tempfile

GUARD = (
    "import socket\n"
    "def _refused(*a, **k):\n"
    "    raise OSError('no network in the sandbox')\n"
    "socket.socket = socket.create_connection = socket.getaddrinfo = _refused\n"
    "del socket, _refused\n"
)


class SandboxTimeout(Exception):
    """The code ran past its time limit (killed)."""


class SandboxMemory(Exception):
    """The code ran out of its memory limit."""


@functools.cache
def _namespace() -> tuple[str, ...]:
    """The command prefix that gives the child no network, when this machine allows it (else ())."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    try:
        ok = subprocess.run([unshare, "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return (unshare, "-rn") if ok else ()


def isolated() -> bool:
    """Whether children run in their own network namespace here."""
    return bool(_namespace())


def run_python(source: str, *, timeout: float = 2.0, memory_mb: int = 256) -> subprocess.CompletedProcess:
    """Run `source` under the limits; the finished process (its stdout and return code), or
    SandboxTimeout / SandboxMemory."""
    import resource

    memory = memory_mb * 2**20
    cpu = max(1, int(timeout))

    def limits() -> None:  # in the child, before exec
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    with tempfile.TemporaryDirectory(prefix="shipyard-sandbox-") as cwd:
        argv = [*_namespace(), sys.executable, "-I", "-S", "-c", GUARD + source]
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=timeout, preexec_fn=limits, env={}, cwd=cwd
            )
        except subprocess.TimeoutExpired:
            raise SandboxTimeout(f"ran past {timeout:g} s") from None
    if done.returncode != 0 and "MemoryError" in done.stderr:
        raise SandboxMemory(f"ran out of {memory_mb} MiB")
    if done.returncode in (-9, -24, 137, 152):  # SIGKILL, SIGXCPU: the CPU limit
        raise SandboxTimeout("ran past its CPU time")
    return done
