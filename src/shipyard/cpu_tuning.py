"""Process-level settings that make XLA's CPU backend fast.

Measured on the 2-core CI machine with bench/train_throughput.py (see the
README's performance section):

* YNNPACK fusions for dots *and* the elementwise ops around them avoid XLA
  materialising transposed copies of activations for the backward matmuls.
* The allocator. XLA's CPU runtime allocates (and frees) its temporary
  buffers, hundreds of MB, on every execution. glibc serves allocations that
  large with fresh mmap()s, so every step pays for page faults and the kernel
  zeroing the pages again: 0.63 s of system time in a 2.1 s step for the
  16M-parameter benchmark model. jemalloc told never to return memory
  (`dirty_decay_ms:-1`) reuses the same pages: 0 faults, 0.01 s system time,
  1.63 s per step. When libjemalloc is installed (Debian: `apt-get install
  libjemalloc2`), the CLI re-executes itself once with it preloaded; without
  it, glibc's `malloc.hugetlb=1` at least makes those faults 2 MB ones
  (29 ms -> 6 ms to write a fresh 64 MB buffer). Allocators and glibc tunables
  are read only at process start, hence the re-exec.

All of these are defaults only: a user's own XLA_FLAGS, LD_PRELOAD or
GLIBC_TUNABLES win, and SHIPYARD_NO_REEXEC=1 turns the re-exec off. And
they apply only to a process that will run on the CPU (`will_run_on_cpu`,
decided before JAX starts): a GPU or TPU process gets neither, as XLA's
GPU/TPU runtimes allocate device memory themselves.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

CPU_XLA_FLAGS = "--xla_cpu_experimental_ynn_fusion_type=+LIBRARY_FUSION_TYPE_DOT,+LIBRARY_FUSION_TYPE_ELTWISE"
GLIBC_HUGEPAGES = "glibc.malloc.hugetlb=1"
JEMALLOC_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
    "/usr/lib64/libjemalloc.so.2",
    "/usr/local/lib/libjemalloc.so.2",
)
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1,thp:always,metadata_thp:always"


ACCELERATOR_PLUGINS = {
    # the package JAX loads a backend from -> device files whose presence says the hardware is there
    "jax_cuda12_plugin": ("/dev/nvidiactl", "/dev/nvidia[0-9]*"),
    "jax_cuda13_plugin": ("/dev/nvidiactl", "/dev/nvidia[0-9]*"),
    "jax_rocm60_plugin": ("/dev/kfd",),
    "jax_rocm7_plugin": ("/dev/kfd",),
    "jax_rocm10_plugin": ("/dev/kfd",),
    "libtpu": ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*"),
}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _present(patterns: tuple[str, ...]) -> bool:
    return any(glob.glob(p) for p in patterns)


def will_run_on_cpu(env: dict = os.environ) -> bool:
    """Whether JAX in this process will pick the CPU as its default backend, without importing JAX.

    JAX_PLATFORMS (JAX's own order of preference) decides when set: its first platform. Otherwise
    JAX uses an accelerator when one of its plugins is installed (jax_cuda12/13_plugin, a ROCm
    plugin, libtpu) and that hardware is present (its device files), else the CPU.
    """
    platforms = env.get("JAX_PLATFORMS", "").strip().lower()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not any(_installed(m) and _present(dev) for m, dev in ACCELERATOR_PLUGINS.items())


def pin_cpu_platform(env: dict = os.environ) -> None:
    """On a process that will run on the CPU (`will_run_on_cpu`) with no JAX_PLATFORMS of the user's,
    set JAX_PLATFORMS=cpu. Why: an accelerator plugin installed without its hardware (libtpu and the
    CUDA plugin are test dependencies here, for compiling TPU and GPU targets: parallel/targets.py)
    is otherwise initialised when JAX starts, which takes time and prints libtpu's complaints about
    the TPU it did not find. Compiling for a target does not need the plugin as a backend: JAX
    builds its compile-only devices from the plugin directly. Call before JAX starts."""
    if "JAX_PLATFORMS" not in env and will_run_on_cpu(env):
        env["JAX_PLATFORMS"] = "cpu"


def apply_xla_flags(env: dict = os.environ) -> None:
    """Add the CPU flags to XLA_FLAGS unless the user already chose those options or the process will
    not run on the CPU (`will_run_on_cpu`). Call before JAX starts."""
    if not will_run_on_cpu(env):
        return
    flags = env.get("XLA_FLAGS", "")
    if "ynn_fusion_type" not in flags:
        env["XLA_FLAGS"] = f"{flags} {CPU_XLA_FLAGS}".strip()


def allocator_env(env: dict = os.environ) -> dict[str, str]:
    """Environment additions for a fast allocator; empty when the user already chose one."""
    if "LD_PRELOAD" in env or "GLIBC_TUNABLES" in env:
        return {}
    # GLIBC_TUNABLES doubles as the "already re-executed" marker.
    jemalloc = next((p for p in JEMALLOC_PATHS if os.path.exists(p)), None)
    if jemalloc:
        return {"LD_PRELOAD": jemalloc, "MALLOC_CONF": JEMALLOC_CONF, "GLIBC_TUNABLES": GLIBC_HUGEPAGES}
    return {"GLIBC_TUNABLES": GLIBC_HUGEPAGES}


def allocator_name(env: dict = os.environ) -> str:
    return "jemalloc" if "jemalloc" in env.get("LD_PRELOAD", "") else "glibc"


def reexec_with_fast_allocator() -> None:
    """Restart this process once with the allocator settings above (Linux only, CPU processes only)."""
    if not sys.platform.startswith("linux") or os.environ.get("SHIPYARD_NO_REEXEC") == "1":
        return
    if not will_run_on_cpu():
        return
    extra = allocator_env()
    if not extra:
        return
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, **extra})
    except OSError:
        return  # keep running as we are: only slower


def release_free_memory() -> int:
    """Hand the memory the allocator holds but no longer uses back to the OS, once (after a server's
    start-up: checkpoint-restore buffers, the host copy of the weights, compile scratch). jemalloc as
    configured above never returns freed pages on its own (that is what makes training steps fast),
    so without this a server keeps its start-up peak for good. Returns 1 when something was asked
    of the allocator, 0 where there is nothing to do (not Linux, an unknown allocator)."""
    if not sys.platform.startswith("linux"):
        return 0
    import ctypes

    libc = ctypes.CDLL(None)
    if allocator_name() == "jemalloc":
        # "arena.<MALLCTL_ARENAS_ALL>.purge": every arena's unused dirty pages back to the OS
        mallctl = getattr(libc, "mallctl", None)
        if mallctl is None:
            return 0
        return int(mallctl(b"arena.4096.purge", None, None, None, ctypes.c_size_t(0)) == 0)
    trim = getattr(libc, "malloc_trim", None)  # glibc
    return int(trim(ctypes.c_size_t(0))) if trim is not None else 0


def environment() -> dict[str, object]:
    """What a benchmark result depends on besides the code: JAX version, XLA flags, allocator, CPU."""
    import platform

    import jax

    return {
        "jax_version": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "allocator": allocator_name(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
    }
