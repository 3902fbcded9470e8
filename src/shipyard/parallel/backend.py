"""The backend a program is traced for: what the backend-specific code paths ask, not the process's default.

Running, the two are the same: JAX's default backend. Compiling for a target the process does not
have (`shipyard plan --target`: TPU or GPU compile-only devices on a CPU host, `parallel.targets`),
the process's backend is the CPU while the program is for another platform, and the CPU-only tricks
(YNNPACK-friendly layouts, unrolled scans, the CPU decode step) must stay out of it and the TPU/GPU
kernels go in. `compiling_for` says so for the code traced inside it. A context variable rather
than an argument because the question is asked deep in model code (a matmul's backward, a scan's
unroll) that already takes the platform from its caller's context, as JAX's own mesh context does.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import jax

_TRACING_FOR: ContextVar[str | None] = ContextVar("shipyard_tracing_for", default=None)

PLATFORMS = ("cpu", "gpu", "tpu")


def platform() -> str:
    """ "cpu", "gpu" or "tpu": the platform of the program being traced (`compiling_for`), else JAX's
    default backend."""
    return _TRACING_FOR.get() or jax.default_backend()


def on_cpu() -> bool:
    """Whether the program being traced is for the CPU (where the CPU-only tricks apply)."""
    return platform() == "cpu"


def platform_of(devices: Sequence[jax.Device]) -> str:
    """The platform of these devices, in the names `platform` uses ("cuda"/"rocm" devices are "gpu")."""
    name = devices[0].platform
    return "gpu" if name in ("cuda", "rocm", "gpu") else name


@contextmanager
def compiling_for(devices: Sequence[jax.Device]) -> Iterator[str]:
    """Trace (and lower) the programs built inside this block for `devices`' platform; yields it."""
    token = _TRACING_FOR.set(platform_of(devices))
    try:
        yield _TRACING_FOR.get()
    finally:
        _TRACING_FOR.reset(token)
