"""The accelerators shipyard compiles for without having them: chip facts and compile-only devices.

`shipyard plan --target T` compiles the real train step with the target's own XLA compiler on this
host: XLA:TPU from `libtpu` and XLA:GPU from `jax-cuda13-plugin` both build programs for devices
that are not attached (JAX's `topologies.get_topology_desc`), and report the compiled program's
memory and HLO. What a compile-only device cannot say (speed, kernel numerics, faults) is in
docs/targets.md.

A target is `tpu-v4|v5e|v5p|v6e:<topology>` (the TPU slice's chip grid, e.g. `tpu-v5p:4x4x4`) or
`h100|h200|b200x<N>` (N GPUs, 8 per host, e.g. `h200x1536`). The chip facts below are the vendors'
published figures; the roofline in `shipyard.plan_target` divides by them.
"""

from __future__ import annotations

import math
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass

from shipyard.errors import ConfigError


@dataclass(frozen=True)
class Chip:
    """One accelerator model as the vendor publishes it."""

    name: str
    """The target's prefix (`tpu-v5p`, `h100`)."""
    platform: str
    """"tpu" or "gpu"."""
    memory_bytes: float
    """Memory per chip (HBM) a program can use."""
    bf16_flops: float
    """Dense bf16 matmul peak, FLOP/s per chip."""
    fp8_flops: float | None
    """Dense fp8 matmul peak, FLOP/s per chip; None where the chip has no fp8 matmul units."""
    hbm_bytes_per_s: float
    """HBM bandwidth per chip."""
    link_bytes_per_s: float
    """Collective bandwidth per chip between chips of one host or slice: NVLink one way (GPU),
    the slice's all-reduce bandwidth over its chips (TPU ICI)."""
    network_bytes_per_s: float | None
    """Collective bandwidth per chip between hosts (the GPU's InfiniBand NIC); None on a TPU slice,
    where every chip is on the ICI."""
    topology_name: str
    """What the vendor's compiler calls the chip: libtpu's `v5p`, or the GPU's device string."""
    source: str
    """Where the figures come from."""
    devices_per_chip: int = 1
    """JAX devices per chip: 2 on TPU v4, whose compile-only topology has one device per TensorCore."""


GIB = 2**30
CHIPS = {
    "tpu-v4": Chip("tpu-v4", "tpu", 32 * GIB, 275e12, None, 1200e9, 1.1e15 / 4096, None, "v4",
                   "cloud.google.com/tpu/docs/v4: 275 TFLOP/s, 32 GiB at 1200 GB/s, all-reduce 1.1 PB/s per 4096 chips", 2),
    "tpu-v5e": Chip("tpu-v5e", "tpu", 16 * GIB, 197e12, None, 819e9, 51.2e12 / 256, None, "v5e",
                    "cloud.google.com/tpu/docs/v5e: 197 TFLOP/s, 16 GB at 819 GB/s, all-reduce 51.2 TB/s per 256 chips"),
    "tpu-v5p": Chip("tpu-v5p", "tpu", 95 * GIB, 459e12, None, 2765e9, 4800e9 / 8, None, "v5p",
                    "cloud.google.com/tpu/docs/v5p: 459 TFLOP/s, 95 GB at 2765 GB/s, ICI 4800 Gbps per chip"),
    "tpu-v6e": Chip("tpu-v6e", "tpu", 32 * GIB, 918e12, None, 1638e9, 102.4e12 / 256, None, "v6e",
                    "cloud.google.com/tpu/docs/v6e: 918 TFLOP/s, 32 GB at 1638 GB/s, all-reduce 102.4 TB/s per 256 chips"),
    "h100": Chip("h100", "gpu", 81559 * 2**20, 989e12, 1979e12, 3.35e12, 450e9, 50e9, "NVIDIA H100 80GB HBM3",
                 "NVIDIA H100 SXM datasheet: 989 TFLOP/s bf16, 1979 fp8 (dense), 3.35 TB/s; NVLink 900 GB/s both ways; 400 Gb/s NIC per GPU"),
    "h200": Chip("h200", "gpu", 143771 * 2**20, 989e12, 1979e12, 4.8e12, 450e9, 50e9, "NVIDIA H200",
                 "NVIDIA H200 SXM datasheet: 989 TFLOP/s bf16, 1979 fp8 (dense), 141 GB at 4.8 TB/s; NVLink 900 GB/s both ways; 400 Gb/s NIC per GPU"),
    "b200": Chip("b200", "gpu", 183359 * 2**20, 2.25e15, 4.5e15, 8e12, 900e9, 50e9, "NVIDIA B200",
                 "NVIDIA HGX B200 datasheet / 8: 2.25 PFLOP/s bf16, 4.5 fp8 (dense), 180 GB at 8 TB/s; NVLink 1.8 TB/s both ways; 400 Gb/s NIC per GPU"),
}  # fmt: skip
"""Memory of the GPUs: what nvidia-smi reports as total (MiB); of TPUs the published capacity."""

GPUS_PER_HOST = 8

# XLA:GPU's description of each GPU (stream_executor.GpuTargetConfigProto, text format): what its
# compiler reads instead of querying a device. Figures from the vendors' architecture documents.
_GPU_INFO = {
    "h100": dict(cc=(9, 0), sms=132, clock=1.98, l2=50 * 2**20, smem_sm=228 * 1024, smem_optin=227 * 1024),
    "h200": dict(cc=(9, 0), sms=132, clock=1.98, l2=50 * 2**20, smem_sm=228 * 1024, smem_optin=227 * 1024),
    "b200": dict(cc=(10, 0), sms=148, clock=1.965, l2=126 * 2**20, smem_sm=228 * 1024, smem_optin=227 * 1024),
}


@dataclass(frozen=True)
class Target:
    """A parsed `--target`: the chip and how many, laid out as the vendor lays them out."""

    spec: str
    """As given, e.g. `tpu-v5p:4x4x4` or `h100x64`."""
    chip: Chip
    chips: int
    topology: str
    """The TPU slice's grid (`4x4x4`), or the GPUs' `slices x hosts x per-host` (`1x8x8`)."""

    @property
    def platform(self) -> str:
        return self.chip.platform

    @property
    def devices(self) -> int:
        """JAX devices: what a mesh for this target multiplies to."""
        return self.chips * self.chip.devices_per_chip

    def per_device(self, value: float) -> float:
        """A per-chip figure (memory, FLOP/s, bandwidth) as each device's share."""
        return value / self.chip.devices_per_chip


TARGET_HELP = "tpu-v4|v5e|v5p|v6e:<chip grid> (e.g. tpu-v5p:4x4x4) or h100|h200|b200x<N> (e.g. h100x64)"


def parse_target(text: str) -> Target:
    """'tpu-v5p:4x4x4' / 'h100x64' -> Target; ConfigError in one line naming what is expected."""
    spec = text.strip().lower()
    tpu = re.fullmatch(r"(tpu-v4|tpu-v5e|tpu-v5p|tpu-v6e):(\d+(?:x\d+){1,2})", spec)
    if tpu:
        grid = [int(d) for d in tpu.group(2).split("x")]
        if min(grid) < 1:
            raise ConfigError(f"--target: {text!r} has an empty dimension; expected {TARGET_HELP}")
        return Target(text, CHIPS[tpu.group(1)], math.prod(grid), tpu.group(2))
    gpu = re.fullmatch(r"(h100|h200|b200)x(\d+)", spec)
    if gpu and int(gpu.group(2)) >= 1:
        n = int(gpu.group(2))
        if n > GPUS_PER_HOST and n % GPUS_PER_HOST:
            raise ConfigError(
                f"--target: {text!r}: {n} GPUs do not fill hosts of {GPUS_PER_HOST}; "
                f"expected a count up to {GPUS_PER_HOST} or a multiple of it"
            )
        hosts, per = (1, n) if n <= GPUS_PER_HOST else (n // GPUS_PER_HOST, GPUS_PER_HOST)
        return Target(text, CHIPS[gpu.group(1)], n, f"1x{hosts}x{per}")
    raise ConfigError(f"--target: {text!r} is not a known target; expected {TARGET_HELP}")


def gpu_target_config(chip: Chip) -> str:
    """XLA:GPU's GpuTargetConfigProto for `chip`, in protobuf text format."""
    g = _GPU_INFO[chip.name]
    major, minor = g["cc"]
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {g["smem_sm"]}
  threads_per_core_limit: 2048
  core_count: {g["sms"]}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(chip.hbm_bytes_per_s)}
  l2_cache_size: {g["l2"]}
  clock_rate_ghz: {g["clock"]}
  device_memory_size: {int(chip.memory_bytes)}
  shared_memory_per_block_optin: {g["smem_optin"]}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
device_description_str: "{chip.topology_name}"
"""


# libtpu looks for a TPU VM's metadata when it loads; on a host that is not one these say "no
# cluster here" so that it neither probes the metadata server nor prints what it did not find (the
# accelerator type only quiets the host probe: the compile-only topology names its own chips). It
# also takes /tmp/libtpu_lockfile, one process per TPU: compiling needs no TPU, so several
# processes (two plans, a test and a plan) may load it at once.
QUIET_LIBTPU = {
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TPU_ACCELERATOR_TYPE": "v5p-8",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}


def quiet_libtpu(env: dict) -> None:
    """Set QUIET_LIBTPU's variables the user has not set in `env` (a child process's environment)."""
    for key, value in QUIET_LIBTPU.items():
        env.setdefault(key, value)


@contextmanager
def _quiet_libtpu_here():
    """QUIET_LIBTPU in this process's environment while libtpu loads, then as it was: left set, the
    TPU worker variables make JAX's cluster detection (`jax.distributed`) see a TPU cluster."""
    added = {k: v for k, v in QUIET_LIBTPU.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def compile_only_devices(target: Target) -> list:
    """The target's compile-only devices (nothing attached is used), in the vendor's order: hosts
    (process_index) in turn, a host's chips together."""
    try:
        with _quiet_libtpu_here():
            return _topology(target)
    except (RuntimeError, ValueError) as e:
        need = "libtpu" if target.platform == "tpu" else "jax-cuda13-plugin and jax-cuda13-pjrt"
        raise ConfigError(
            f"--target {target.spec}: the {target.platform.upper()} compiler did not describe the devices "
            f"({str(e).splitlines()[0][:200]}); it needs {need} installed (`make install` does)"
        ) from e


def _topology(target: Target) -> list:
    from jax.experimental import topologies

    if target.platform == "tpu":
        topo = topologies.get_topology_desc(
            platform="tpu", topology_name=f"{target.chip.topology_name}:{target.topology}"
        )
    else:
        topo = topologies.get_topology_desc(
            topology_name=target.chip.name,
            platform="cuda",
            target_config=gpu_target_config(target.chip),
            topology=target.topology,
        )
    return list(topo.devices)
