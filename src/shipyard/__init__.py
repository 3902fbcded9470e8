"""shipyard: an open, reproducible language-model training stack in JAX."""

from shipyard import cpu_tuning as _cpu_tuning

__version__ = "0.1.0"

# Before JAX starts (importing shipyard first is enough): on a machine without accelerators, keep
# the installed TPU/GPU compilers (libtpu, the CUDA plugin: test dependencies, for `plan --target`)
# from being started as backends, which is slow and prints their complaints (cpu_tuning.py).
_cpu_tuning.pin_cpu_platform()
