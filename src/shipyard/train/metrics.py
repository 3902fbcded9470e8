"""Throughput accounting (FLOPs, MFU) and the metrics.jsonl writer."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from shipyard.config import ModelConfig
from shipyard.errors import RunDirError


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported without torch.

    tensorboardX's writer module tries `import torch` for its optional torch-tensor support; with
    torch installed (the test extras) that costs ~2 s in every training process, and we only ever
    log Python floats. A None in sys.modules makes that import fail fast, as if torch were absent."""
    import sys

    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


def matmul_params_per_token(cfg: ModelConfig) -> int:
    """Weights one token is multiplied with: attention and MLP projections, active experts, router, head.

    Excludes the embedding gather and norms (no matmul) but includes the
    output head (the embedding again when tied). An MoE layer counts its
    router, its top-k routed experts and its shared experts.
    """
    attn = cfg.hidden_size * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    dense = attn + 3 * cfg.hidden_size * cfg.intermediate_size
    total = cfg.num_dense_layers * dense + cfg.hidden_size * cfg.vocab_size
    if cfg.moe is not None:
        m = cfg.moe
        active = m.experts_per_token + m.num_shared_experts
        moe = (
            attn + cfg.hidden_size * m.num_experts + active * 3 * cfg.hidden_size * m.expert_intermediate_size
        )
        total += cfg.num_moe_layers * moe
    return total


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x active matmul params + attention scores and values.

    Attention counts QK^T and PV over the full seq x seq matrix (what XLA
    computes) in forward (4 x seq x heads x head_dim per layer) and backward
    (twice that). For MoE models this is the active-parameter count (the
    convention for MoE MFU); the dispatch's gathers and sorts are not counted.
    """
    attention = 12 * cfg.num_layers * seq_len * cfg.num_heads * cfg.head_dim
    return 6.0 * matmul_params_per_token(cfg) + attention


def measure_matmul_peak(device: jax.Device | None = None, n: int = 1024, dtype=jnp.float32) -> float:
    """Best FLOP/s of an n x n matmul on `device`: the achievable peak MFU is measured against on CPU."""
    device = device or jax.devices()[0]
    a = jax.device_put(jnp.ones((n, n), dtype), device)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(4):
            out = f(a)
        out.block_until_ready()
        best = min(best, (time.perf_counter() - t) / 4)
    return 2 * n**3 / best


def peak_flops(configured_per_device: float | None, devices: list[jax.Device]) -> float:
    """Peak FLOP/s of all `devices` together.

    On CPU the forced host "devices" share the same cores, so the peak is one
    matmul measurement of the whole host, not per device.
    """
    if configured_per_device is not None:
        return configured_per_device * len(devices)
    if devices[0].platform == "cpu":
        return measure_matmul_peak(devices[0])
    return measure_matmul_peak(devices[0]) * len(devices)


class MetricsWriter:
    """Appends one JSON object per logged step to metrics.jsonl (flushed each line) and, with
    `tensorboard_dir`, writes every numeric metric as a TensorBoard scalar (lists, e.g. the
    per-layer MoE loads, as `name/<index>`)."""

    def __init__(
        self,
        path: Path,
        tensorboard_dir: Path | None = None,
        purge_step: int | None = None,
        wandb=None,
        run_config: dict | None = None,
    ):
        self.path = path
        self._f = open(path, "a", encoding="utf-8")  # noqa: SIM115 (held open for the run; closed by close())
        self._tb = None
        if tensorboard_dir is not None:
            SummaryWriter = _summary_writer_class()
            # purge_step: a resumed run hides the events logged after its checkpoint,
            # as truncate_metrics drops those metrics.jsonl lines.
            self._tb = SummaryWriter(str(tensorboard_dir), flush_secs=10, purge_step=purge_step)
        self._wandb = None
        if wandb is not None:
            self._wandb = _start_wandb(wandb, path.parent, run_config or {})

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record, sort_keys=False) + "\n")
        self._f.flush()
        if self._tb is not None:
            step = record["step"]
            for key, value in record.items():
                if key == "step" or value is None:
                    continue
                if isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)
                elif isinstance(value, list) and all(isinstance(v, (int, float)) for v in value):
                    for i, v in enumerate(value):
                        self._tb.add_scalar(f"{key}/{i}", v, step)

        if self._wandb is not None:
            flat = {}
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    flat[key] = value
                elif isinstance(value, list) and all(isinstance(v, (int, float)) for v in value):
                    flat.update({f"{key}/{i}": v for i, v in enumerate(value)})
            self._wandb.log(flat, step=record["step"])

    def close(self) -> None:
        """Flush and close; a file-system failure (a full disk) is one line naming what was being
        written (RunDirError), said once: tensorboardX's own exit-time flush and writer thread then
        stay quiet about the same failure."""
        try:
            self._f.close()
        except OSError as e:
            raise RunDirError(f"writing {self.path} failed: {e.strerror or e}") from None
        finally:
            tb, self._tb = self._tb, None
            try:
                if tb is not None:
                    _close_tensorboard(tb)
            finally:
                if self._wandb is not None:
                    self._wandb.finish()


def _close_tensorboard(tb) -> None:
    try:
        tb.close()
    except OSError as e:
        # tensorboardX would try again from its writer thread and at exit (atexit), each time with a
        # traceback: its threads are stopped and its writers marked closed, so it stays quiet.
        for writer in tb.all_writers.values():
            events = writer.event_writer
            with contextlib.suppress(Exception):
                events._worker.stop()
            events._closed = True
        raise RunDirError(f"writing TensorBoard events in {tb.logdir} failed: {e.strerror or e}") from None


def _start_wandb(cfg, run_dir: Path, run_config: dict):
    """A W&B run for this run directory; its id is derived from the directory so --resume continues it."""
    import hashlib
    import os

    from shipyard.errors import ConfigError

    try:
        import wandb
    except ImportError as e:
        raise ConfigError(
            "train.logging.wandb: the wandb package is not installed (pip install 'shipyard[wandb]'), "
            "or set train.logging.wandb to null"
        ) from e
    os.environ.setdefault("WANDB_SILENT", "true")
    run_id = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
    return wandb.init(
        project=cfg.project,
        entity=cfg.entity,
        mode=cfg.mode,
        dir=str(run_dir),
        name=run_dir.name,
        id=run_id,
        resume="allow",
        config=run_config,
    )
