"""`shipyard train`: build everything from a config and run the loop."""

from __future__ import annotations

import math
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from tqdm import tqdm

from shipyard.config import Config
from shipyard.data.tokens import batch_at, load_tokens, tokens_sha256
from shipyard.errors import ConfigError, TrainingDiverged
from shipyard.model.params import init_params, param_shardings
from shipyard.model.transformer import num_params, param_specs
from shipyard.parallel.mesh import DEFAULT_RULES, logical_to_pspec, make_mesh
from shipyard.train.checkpoint import Checkpointer
from shipyard.train.metrics import MetricsWriter, flops_per_token, peak_flops
from shipyard.train.optim import build_optimizer
from shipyard.train.rundir import prepare_run_dir, write_run_header
from shipyard.train.step import init_state, make_train_step


def run_dir_for(cfg: Config) -> Path:
    return Path(cfg.run.out_dir) / cfg.run.name


def _host_metrics(m: dict) -> dict:
    return {k: (v.item() if np.ndim(v) == 0 else v.tolist()) for k, v in jax.device_get(m).items()}


def train(
    cfg: Config, *, run_dir: Path | None = None, overwrite: bool = False, debug_nans: bool = False
) -> Path:
    """Train `cfg` for `train.steps` steps; returns the run directory.

    `debug_nans` turns on JAX's NaN *and* Inf checking for this run: the first
    operation that produces either raises FloatingPointError naming it (an
    overflow to inf usually comes a step before the NaN it turns into).
    """
    if not debug_nans:
        return _train(cfg, run_dir, overwrite)
    with jax.debug_nans(True), jax.debug_infs(True):
        return _train(cfg, run_dir, overwrite)


def _train(cfg: Config, run_dir: Path | None, overwrite: bool) -> Path:
    if cfg.data.train_tokens is None:
        raise ConfigError(
            "data.train_tokens is not set: give a token-shard directory (from `shipyard data tokenize` "
            "or `data prepare`) or a 1-D .npy of token ids (e.g. from `shipyard data bytes`)"
        )
    run_dir = Path(run_dir) if run_dir is not None else run_dir_for(cfg)
    tokens = load_tokens(cfg.data.train_tokens, cfg.model.vocab_size, cfg.data.seq_len)
    mesh = make_mesh(cfg.mesh)
    batch_size, seq_len = cfg.train.global_batch_size, cfg.data.seq_len
    batch_spec = logical_to_pspec(("batch", "seq"), (batch_size, seq_len + 1), mesh, DEFAULT_RULES)
    if math.prod(mesh.shape[a] for a in DEFAULT_RULES["batch"]) > 1 and batch_spec[0] is None:
        raise ConfigError(
            f"train.global_batch_size={batch_size} is not divisible by the {mesh.devices.size} "
            "data-parallel devices; choose a multiple"
        )

    prepare_run_dir(run_dir, overwrite)
    inputs = {
        "train_tokens": {"path": str(cfg.data.train_tokens), "sha256": tokens_sha256(cfg.data.train_tokens)}
    }
    write_run_header(run_dir, cfg, inputs)
    specs = param_specs(cfg.model)
    shardings = param_shardings(specs, mesh, DEFAULT_RULES)
    optimizer = build_optimizer(cfg.train, specs)
    params = init_params(specs, jax.random.key(cfg.train.seed), shardings)
    state = init_state(cfg, params, optimizer)
    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    batch_sharding = NamedSharding(mesh, batch_spec)
    step_fn = jax.jit(
        make_train_step(cfg, optimizer),
        in_shardings=(state_shardings, {"tokens": batch_sharding, "loss_mask": batch_sharding}),
        out_shardings=(state_shardings, None),
        donate_argnums=0,
    )

    devices = list(mesh.devices.flat)
    peak = peak_flops(cfg.train.logging.peak_flops_per_device, devices)
    flops_tok = flops_per_token(cfg.model, seq_len)
    tokens_per_step = batch_size * seq_len
    print(
        f"shipyard: {num_params(cfg.model):,} params, {len(devices)} {devices[0].platform} device(s), "
        f"mesh {dict(mesh.shape)}, run dir {run_dir}",
        flush=True,
    )

    def make_batch(step: int) -> dict:
        windows = batch_at(tokens, step, cfg.train.seed, batch_size, seq_len)
        mask = np.ones((batch_size, seq_len), np.float32)
        return {
            "tokens": jax.device_put(windows, batch_sharding),
            "loss_mask": jax.device_put(mask, NamedSharding(mesh, PartitionSpec(batch_spec[0], None))),
        }

    log = cfg.train.logging
    writer = MetricsWriter(run_dir / "metrics.jsonl")
    checkpointer = Checkpointer(run_dir, cfg.train.checkpoint, cfg.train.steps)
    bar = tqdm(
        total=cfg.train.steps, unit="step", disable=not log.progress, mininterval=0.5, dynamic_ncols=True
    )
    pending: tuple[int, dict] | None = None
    window_start, window_steps, t0 = None, 0, time.perf_counter()

    def finish(step: int, metrics: dict) -> None:
        """Host side of step `step` (its metrics are ready): progress, logging, divergence."""
        nonlocal window_start, window_steps
        m = _host_metrics(metrics)
        now = time.perf_counter()
        if window_start is None:  # the first step includes compilation: time from its end
            window_start, window_steps = now, 0
        else:
            window_steps += 1
        # None (null in JSON) until a step after the compiling first one has finished.
        tok_s = tokens_per_step * window_steps / max(now - window_start, 1e-9) if window_steps else None
        bar.update(1)
        bar.set_postfix(loss=f"{m['loss']:.4f}", tok_s=f"{tok_s or 0:,.0f}", refresh=False)
        last = step == cfg.train.steps - 1
        if step % log.log_every == 0 or last or m["nonfinite_run"] >= cfg.train.max_consecutive_nonfinite:
            mfu = tok_s * flops_tok / peak if tok_s is not None else None
            record = {"step": step, "loss": m.pop("loss"), "lr": m.pop("lr"), **m}
            record.update(tokens_per_s=tok_s, mfu=mfu, elapsed_s=now - t0)
            writer.write(record)
        if m["nonfinite_run"] >= cfg.train.max_consecutive_nonfinite:
            raise TrainingDiverged(
                f"stopped at step {step}: {m['nonfinite_run']} consecutive steps had a non-finite loss or "
                f"gradient (updates were skipped); try a lower train.optimizer.lr or longer warmup, check the "
                f"input tokens, or rerun with --debug-nans to find the first NaN"
            )

    try:
        for step in range(cfg.train.steps):
            state, metrics = step_fn(state, make_batch(step))
            if checkpointer.wants(step + 1):
                checkpointer.save(step + 1, state)
            # Read the previous step's metrics only after queueing this one, so
            # the device never waits for the host.
            if pending is not None:
                finish(*pending)
            pending = (step, metrics)
        finish(*pending)
    finally:
        bar.close()
        writer.close()
        checkpointer.close()
    elapsed = time.perf_counter() - t0
    print(f"shipyard: done {cfg.train.steps} steps in {elapsed:.1f}s; metrics in {run_dir / 'metrics.jsonl'}")
    return run_dir
