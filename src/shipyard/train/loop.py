"""The train loop and its pieces: console lines, the step log (progress bar, throughput,
metrics.jsonl, divergence), in-loop evaluation and the profiler window; the stop signal is in
train/stopping.py."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from shipyard.config import Config
from shipyard.errors import TrainingDiverged
from shipyard.parallel.distributed import agreed_stop
from shipyard.run.checkpoint import Checkpointer
from shipyard.train.metrics import MetricsWriter
from shipyard.train.preference_loss import PreferenceSums, preference_metrics
from shipyard.train.program import TrainProgram
from shipyard.train.stopping import StopSignal


def say_on(main: bool, message: str) -> None:
    """Print a console line on process 0 only."""
    if main:
        print(message, flush=True)


def global_array(value: np.ndarray, sharding) -> jax.Array:
    """A host value every process holds in full, as a global array (device_put needs it addressable)."""
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def host_metrics(m: dict) -> dict:
    return {k: (v.item() if np.ndim(v) == 0 else v.tolist()) for k, v in jax.device_get(m).items()}


class NoWriter:
    """Processes other than 0 log nothing."""

    def write(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


def open_writer(cfg: Config, run_dir: Path, start: int, main: bool) -> MetricsWriter | NoWriter:
    """metrics.jsonl (+ TensorBoard, W&B) on process 0; a resumed run purges events after `start`."""
    if not main:
        return NoWriter()
    log = cfg.train.logging
    tb = run_dir / "tb" if log.tensorboard else None
    return MetricsWriter(run_dir / "metrics.jsonl", tb, start or None, log.wandb, cfg.model_dump(mode="json"))


def progress_bar(cfg: Config, start: int, main: bool) -> tqdm:
    return tqdm(
        total=cfg.train.steps,
        initial=start,
        unit="step",
        disable=not (cfg.train.logging.progress and main),
        mininterval=0.5,
        dynamic_ncols=True,
    )


class Throughput:
    """Tokens per second over the steps finished since the first one (which includes compilation)."""

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.window_start: float | None = None
        self.window_steps = 0

    def tick(self, now: float) -> float | None:
        """Count a finished step; the rate so far, None until a step after the first has finished."""
        if self.window_start is None:  # the first step includes compilation: time from its end
            self.window_start, self.window_steps = now, 0
        else:
            self.window_steps += 1
        if not self.window_steps:
            return None
        return self.tokens_per_step * self.window_steps / max(now - self.window_start, 1e-9)


def check_divergence(step: int, nonfinite_run: int, limit: int) -> None:
    """Stop the run (exit 5) after `limit` consecutive non-finite steps."""
    if nonfinite_run >= limit:
        raise TrainingDiverged(
            f"stopped at step {step}: {nonfinite_run} consecutive steps had a non-finite loss or "
            f"gradient (updates were skipped); try a lower train.optimizer.lr or longer warmup, check the "
            f"input tokens, or rerun with --debug-nans to find the first NaN"
        )


def val_loss(val_sums: list) -> float:
    """Mean held-out token loss from the eval step's (sum, count) pairs."""
    ce, n = (sum(float(x[i]) for x in val_sums) for i in (0, 1))
    return ce / max(n, 1.0)


def val_metrics(val_sums: list) -> dict[str, float]:
    """The held-out metrics of a record: val_loss (per token), or with preference tuning the
    per-pair val_loss, val_pref_accuracy, val_reward_margin, val chosen/rejected log-probs and rewards."""
    if not isinstance(val_sums[0], PreferenceSums):
        return {"val_loss": val_loss(val_sums)}
    total = jax.tree.map(lambda *xs: sum(np.asarray(x, np.float64) for x in xs), *jax.device_get(val_sums))
    return {f"val_{k}": float(v) for k, v in preference_metrics(total).items()}


class StepLog:
    """The host side of each finished step: progress bar, metrics record, divergence check."""

    def __init__(self, cfg: Config, writer, bar: tqdm, flops_per_token: float, peak: float):
        self.train = cfg.train
        self.writer, self.bar = writer, bar
        self.flops_per_token, self.peak = flops_per_token, peak
        self.throughput = Throughput(cfg.train.global_batch_size * cfg.data.seq_len)
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def finish(self, step: int, metrics: dict, val_sums: list | None) -> None:
        """Step `step` has finished (its metrics are ready): show, log, and stop if it diverged."""
        m = host_metrics(metrics)
        now = time.perf_counter()
        tok_s = self.throughput.tick(now)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{m['loss']:.4f}", tok_s=f"{tok_s or 0:,.0f}", refresh=False)
        last = step == self.train.steps - 1
        diverged = m["nonfinite_run"] >= self.train.max_consecutive_nonfinite
        if step % self.train.logging.log_every == 0 or last or diverged or val_sums is not None:
            mfu = tok_s * self.flops_per_token / self.peak if tok_s is not None else None
            record = {"step": step, "loss": m.pop("loss"), "lr": m.pop("lr"), **m}
            if val_sums is not None:
                record.update(val_metrics(val_sums))
            record.update(tokens_per_s=tok_s, mfu=mfu, elapsed_s=now - self.t0)
            self.writer.write(record)
        check_divergence(step, m["nonfinite_run"], self.train.max_consecutive_nonfinite)

    def close(self) -> None:
        self.bar.close()
        self.writer.close()


@dataclass(frozen=True)
class Evaluator:
    """In-loop held-out loss: sums over the same sequences every time (the first eval_batches * B)."""

    program: TrainProgram
    validation: object
    """SequenceSource (pretraining), PackedChats (chat SFT), packed pairs (preference tuning: rows()
    with each row's ref_logps when cached) or None (no in-loop eval)."""
    frozen: object
    reference: object = None
    """The on-the-fly DPO reference tree (None otherwise)."""

    def due(self, done: int) -> bool:
        every, steps = self.program.cfg.train.eval_every, self.program.cfg.train.steps
        return self.validation is not None and every is not None and (done % every == 0 or done == steps)

    def __call__(self, params) -> list:
        cfg, val = self.program.cfg, self.validation
        batch_size = cfg.train.global_batch_size
        out = []
        for b in range(cfg.train.eval_batches):
            idx = [(b * batch_size + r) % len(val) for r in range(batch_size)]
            packed = cfg.data.chat is not None or cfg.data.preference is not None
            rows = val.rows(idx) if packed else {"tokens": np.stack([val[i] for i in idx])}
            batch = {k: global_array(v, self.program.batch_shardings[k]) for k, v in rows.items()}
            more = () if self.reference is None else (self.reference,)
            out.append(self.program.eval_step(params, self.frozen, batch, *more))
        return out


@dataclass(frozen=True)
class ProfileWindow:
    """A JAX profiler trace of steps first..last (inclusive) into `directory`, on process 0."""

    steps: tuple[int, int] | None
    directory: Path
    main: bool
    say: Callable[[str], None]

    def before(self, step: int) -> None:
        if self.steps is not None and step == self.steps[0] and self.main:
            jax.profiler.start_trace(str(self.directory))

    def after(self, step: int, metrics) -> None:
        if self.steps is not None and step == self.steps[1] and self.main:
            jax.block_until_ready(metrics)
            jax.profiler.stop_trace()
            self.say(f"shipyard: profile of steps {self.steps[0]}-{self.steps[1]} in {self.directory}")


@dataclass(frozen=True)
class LoopParts:
    """What the loop drives besides the state: the step, batches, eval, checkpoints, log, profiler."""

    train_step: Callable
    frozen: object
    batches: object
    """A Prefetcher: `get(step)` gives step's global batch."""
    evaluate: Evaluator
    checkpointer: Checkpointer
    log: StepLog
    profile: ProfileWindow
    reference: object = None
    """The on-the-fly DPO reference tree, the step's last argument (None: the step takes none)."""


def run_loop(parts: LoopParts, state, start: int, steps: int) -> tuple[int, str] | None:
    """Steps start..steps-1; returns (step saved, signal name) when a stop signal ended it early."""
    pending: tuple | None = None
    with StopSignal(parts.checkpointer.directory) as stop:
        for step in range(start, steps):
            batch = parts.batches.get(step)
            parts.profile.before(step)
            more = () if parts.reference is None else (parts.reference,)
            state, metrics = parts.train_step(state, batch, parts.frozen, *more)
            parts.profile.after(step, metrics)
            done = step + 1
            val_sums = parts.evaluate(state.params) if parts.evaluate.due(done) else None
            if parts.checkpointer.wants(done):
                parts.checkpointer.save(done, state)
            else:
                parts.checkpointer.poll()
            # Read the previous step's metrics only after queueing this one, so
            # the device never waits for the host.
            if pending is not None:
                parts.log.finish(*pending)
            pending = (step, metrics, val_sums)
            # Every process asks at every boundary before the last, so a stop lands on one step for
            # all: a process saving while another stepped on would wait in different collectives.
            signum = agreed_stop(done, stop.received) if done < steps else None
            if signum is not None:
                parts.checkpointer.save(done, state, wait=True)
                parts.log.finish(*pending)
                return done, signal.Signals(signum).name
        if pending is not None:
            parts.log.finish(*pending)
    return None
