"""Process-level settings that make XLA's CPU backend fast.

Measured on the 2-core CI machine with bench/train_throughput.py (see the
README's performance section):

* YNNPACK fusions for dots *and* the elementwise ops around them avoid XLA
  materialising transposed copies of activations for the backward matmuls.
* glibc's `malloc.hugetlb=1` backs large allocations with transparent huge
  pages. XLA allocates fresh multi-MB buffers every step; with 4 KiB pages each
  one costs thousands of page faults (a 64 MB write took 29 ms instead of 6).
  glibc reads tunables only at process start, so the CLI re-executes itself
  once with the variable set.

Both are defaults only: a user's own XLA_FLAGS / GLIBC_TUNABLES win.
"""

from __future__ import annotations

import os
import sys

CPU_XLA_FLAGS = "--xla_cpu_experimental_ynn_fusion_type=+LIBRARY_FUSION_TYPE_DOT,+LIBRARY_FUSION_TYPE_ELTWISE"
GLIBC_HUGEPAGES = "glibc.malloc.hugetlb=1"


def apply_xla_flags(env: dict = os.environ) -> None:
    """Add the CPU flags to XLA_FLAGS unless the user already chose those options. Call before JAX starts."""
    flags = env.get("XLA_FLAGS", "")
    if "ynn_fusion_type" not in flags:
        env["XLA_FLAGS"] = f"{flags} {CPU_XLA_FLAGS}".strip()


def reexec_with_hugepages() -> None:
    """Restart this process once with glibc huge-page malloc (Linux only; no-op if already set)."""
    if not sys.platform.startswith("linux") or "GLIBC_TUNABLES" in os.environ:
        return
    env = dict(os.environ, GLIBC_TUNABLES=GLIBC_HUGEPAGES)
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:
        return  # keep running without it: only slower
