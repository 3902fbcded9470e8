"""`shipyard plan --target`: the train step compiled by the target's own compiler, and what it says.

The CPU plan compiles the step for fake CPU devices: XLA:CPU's view, with stand-ins for what has no
CPU form (vendor attention kernels, the accelerators' grouped matmul). With a target
(`parallel/targets.py`: a TPU slice or N GPUs) the same program is built for the target's
compile-only devices and compiled by XLA:TPU or XLA:GPU on this host, vendor kernels included:
memory per device from the compiler's memory analysis; FLOPs, memory traffic and collectives
(kind, mesh axes, bytes) read from the compiled HLO (`parallel/compiled_hlo.py`); and a roofline
step time from the chip's published peaks.

Roofline, stated with every estimate: compute = HLO FLOPs / bf16 peak, memory = kernel traffic /
HBM bandwidth, collectives = bytes each device sends / link bandwidth (NVLink or ICI within a host
or slice, the NIC across GPU hosts); step = max(compute, memory) + collectives, collectives not
overlapped with compute (the lower bound, all overlapped, is printed beside it). MFU = the model's
FLOPs (6 x active params + attention per token) over step x peak.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

from shipyard.config import Config
from shipyard.errors import ConfigError
from shipyard.output import human_bytes
from shipyard.parallel.targets import Target


def lower_step(cfg: Config, devices):
    """(lowered train step, mesh) of `cfg` on `devices` (compile-only ones of a target), traced
    for their platform: the CPU-only paths stay out, the platform's kernels go in."""
    from shipyard.parallel import backend
    from shipyard.parallel.mesh import make_mesh
    from shipyard.train.program import build_program

    mesh = make_mesh(cfg.mesh, devices)
    with backend.compiling_for(devices):
        # The plan reads no data: any EOS id compiles to the same program.
        program = build_program(cfg, mesh, eos_id=0)
        lowered = program.lower_train_step()
    return lowered, mesh, program


def local_bytes(tree) -> float:
    """Bytes one device holds of a tree of sharded abstract arrays (None: 0)."""
    import jax

    return float(
        sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))
    )


def compiled_peak(mem) -> int:
    """A device's peak bytes by the target compiler: its heap simulation's peak
    (`peak_memory_in_bytes`), or where a plugin gives none (0), arguments + temporaries + outputs
    less what they alias. The two agree on XLA:GPU; XLA:TPU's `temp_size_in_bytes` counts more than
    is ever live at once: for marin-8b on tpu-v5p:4x4x4 (fsdp=64) 38.56 GiB of temporaries against a
    28.70 GiB peak, which is what its buffer assignment holds (one 27.7 GiB block of temporaries and
    the 1.4 GiB of arguments)."""
    peak = getattr(mem, "peak_memory_in_bytes", 0) or 0
    if peak > 0:
        return int(peak)
    return (
        mem.argument_size_in_bytes
        + mem.temp_size_in_bytes
        + mem.output_size_in_bytes
        - mem.alias_size_in_bytes
    )


def analyse(compiled, mesh, program=None) -> dict:
    """Per-device figures of a compiled step: the compiler's memory analysis, the HLO's FLOPs,
    traffic, vendor kernels and collectives, XLA's own cost analysis where it gives one."""

    from shipyard.parallel import compiled_hlo

    mem = compiled.memory_analysis()
    text = compiled.as_text()
    # A GPU collective between hosts goes over the network; a TPU slice's chips are all on the ICI.
    on_gpu = mesh.devices.flat[0].platform in ("gpu", "cuda", "rocm")
    hosts = [d.process_index for d in mesh.devices.flat] if on_gpu else None
    costs = compiled_hlo.Reader(text, dict(mesh.shape), hosts).entry()
    try:
        xla = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - a compile-only GPU raises or returns nothing
        xla = None
    xla = xla[0] if isinstance(xla, list) else xla
    out = {
        "argument_bytes": mem.argument_size_in_bytes,
        "output_bytes": mem.output_size_in_bytes,
        "alias_bytes": mem.alias_size_in_bytes,
        "temp_bytes": mem.temp_size_in_bytes,
        "peak_bytes": compiled_peak(mem),
        "hlo_flops": costs.flops,
        "hlo_fp8_flops": costs.fp8_flops,
        "traffic_bytes": costs.traffic_bytes,
        "xla_flops": float(xla.get("flops", 0.0)) if xla else None,
        "kernels": dict(costs.kernels),
        "unknown_loops": costs.unknown_loops,
        "collectives": compiled_hlo.summarize(costs),
        "hlo_fingerprint": compiled_hlo.fingerprint(text),
    }
    if program is not None:
        state, params = local_bytes(program.abstract_state), local_bytes(program.abstract_state.params)
        frozen = local_bytes(program.abstract_frozen)
        out.update(params_bytes=params + frozen, optimizer_bytes=state - params, state_bytes=state + frozen)
    return out


def compile_step(cfg: Config, target: Target) -> dict:
    """`analyse` of cfg's train step compiled for `target` (in this process)."""
    from shipyard.parallel.targets import compile_only_devices

    lowered, mesh, program = lower_step(cfg, compile_only_devices(target))
    return analyse(lowered.compile(), mesh, program)


def target_env(env: dict | None = None) -> dict:
    """The environment a target compile runs in: JAX on the CPU (the plugins are compilers here,
    not backends), libtpu quiet, and none of shipyard's XLA:CPU flags (they tune the CPU compiler;
    a target program must not depend on them)."""
    from shipyard.cpu_tuning import CPU_XLA_FLAGS
    from shipyard.parallel.targets import quiet_libtpu

    env = dict(os.environ if env is None else env)
    env["JAX_PLATFORMS"] = "cpu"
    flags = env.get("XLA_FLAGS", "").replace(CPU_XLA_FLAGS, "").split()
    env["XLA_FLAGS"] = " ".join(
        f for f in flags if not f.startswith("--xla_force_host_platform_device_count")
    )
    quiet_libtpu(env)
    return env


def run_child(cfg: Config, target: Target) -> dict:
    """`compile_step` in a child process (the plan's own process has JAX started for the CPU)."""
    from shipyard.config import to_yaml

    payload = json.dumps({"config": to_yaml(cfg), "target": target.spec})
    proc = subprocess.run(
        [sys.executable, "-m", "shipyard.plan_target", "--child"],
        input=payload,
        capture_output=True,
        text=True,
        env=target_env(),
    )
    if proc.returncode != 0:
        lines = [ln.strip() for ln in proc.stderr.strip().splitlines() if ln.strip()] or ["(no output)"]
        # the exception's own line, not the traceback's last frame or JAX's note under it
        errors = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception): ", ln)]
        refused = [ln for ln in errors if ln.startswith("shipyard.errors.ConfigError: ")]
        if refused:  # the config asks what the target cannot do: the program's own one line
            raise ConfigError(refused[-1].removeprefix("shipyard.errors.ConfigError: "))
        raise ConfigError(
            f"plan --target {target.spec}: compiling the train step failed: {(errors or lines)[-1][:400]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def roofline(compiled: dict, target: Target, model_flops_per_device: float, kernel_flops: float) -> dict:
    """Step time from the compiled figures and the chip's peaks (module doc), with MFU."""
    chip = target.chip
    peak = target.per_device(chip.bf16_flops)
    # fp8 matmuls (train.precision=fp8) run at the fp8 peak where the chip has one
    fp8 = compiled.get("hlo_fp8_flops", 0.0) if chip.fp8_flops else 0.0
    fp8_peak = target.per_device(chip.fp8_flops) if chip.fp8_flops else peak
    compute = (compiled["hlo_flops"] - fp8 + kernel_flops) / peak + fp8 / fp8_peak
    memory = compiled["traffic_bytes"] / target.per_device(chip.hbm_bytes_per_s)
    comm = 0.0
    for row in compiled["collectives"]:
        link = (
            chip.network_bytes_per_s
            if row["crosses_hosts"] and chip.network_bytes_per_s
            else chip.link_bytes_per_s
        )
        comm += row["wire_bytes"] / link
    step = max(compute, memory) + comm
    return {
        "compute_seconds": compute,
        "memory_seconds": memory,
        "collective_seconds": comm,
        "step_seconds": step,
        "overlapped_step_seconds": max(compute, memory, comm),
        "mfu": model_flops_per_device / (step * peak) if step else 0.0,
        "kernel_flops": kernel_flops,
        "peak_flops": peak,
        "hbm_bytes_per_s": target.per_device(chip.hbm_bytes_per_s),
        "link_bytes_per_s": chip.link_bytes_per_s,
        "network_bytes_per_s": chip.network_bytes_per_s,
    }


_fmt = human_bytes


def _seconds(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.3g} us"
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def collective_lines(c: dict, platform: str) -> list[str]:
    """The collectives table: kind, mesh axes, count, data and bytes sent per device per step."""
    if not c["collectives"]:
        return ["collectives per step: none"]
    lines = ["collectives per step per device (compiled HLO; sent = ring-algorithm bytes one device sends):"]
    for row in c["collectives"]:
        link = "network" if row["crosses_hosts"] else ("ICI" if platform == "tpu" else "NVLink")
        axes = "+".join(row["axes"]) or "-"
        lines.append(
            f"  {row['kind']:<24} over {axes:<16} x{row['count']:<7.0f} data {_fmt(row['bytes']):>11}"
            f"  sent {_fmt(row['wire_bytes']):>11}  ({link})"
        )
    return lines


def time_lines(p: dict) -> list[str]:
    """The roofline's parts, its step time and MFU, with the chip figures it divided by."""
    r, t = p["roofline"], p["target"]
    link = "ICI" if t["platform"] == "tpu" else "NVLink"
    net = f", {r['network_bytes_per_s'] / 1e9:.0f} GB/s between hosts" if r["network_bytes_per_s"] else ""
    return [
        f"step time (roofline on {t['chip']}: {r['peak_flops'] / 1e12:.0f} TFLOP/s bf16, "
        f"{r['hbm_bytes_per_s'] / 1e9:.0f} GB/s HBM per device, {r['link_bytes_per_s'] / 1e9:.0f} GB/s {link}{net}):",
        f"  compute {_seconds(r['compute_seconds'])}, HBM {_seconds(r['memory_seconds'])}, "
        f"collectives {_seconds(r['collective_seconds'])} -> {_seconds(r['step_seconds'])} per step "
        f"(collectives not overlapped; {_seconds(r['overlapped_step_seconds'])} if all overlap), "
        f"MFU {r['mfu']:.0%}",
    ]


def _child() -> None:
    from shipyard.config import build_config, read_yaml
    from shipyard.parallel.targets import parse_target

    payload = json.loads(sys.stdin.read())
    cfg = build_config(read_yaml(payload["config"], "plan config"))
    print(json.dumps(compile_step(cfg, parse_target(payload["target"]))))


if __name__ == "__main__" and sys.argv[1:] == ["--child"]:
    _child()
