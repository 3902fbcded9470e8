"""`shipyard train`: build everything from a config and run the loop."""

from __future__ import annotations

import math
import signal
import threading
import time
from functools import partial
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from tqdm import tqdm

from shipyard.config import Config, to_yaml
from shipyard.data.chat_format import BATCH_KEYS
from shipyard.data.loader import Prefetcher, SequenceSource, build_loader, device_batch
from shipyard.data.tokens import tokens_sha256
from shipyard.errors import ConfigError, TrainingDiverged
from shipyard.model.params import init_params, param_shardings
from shipyard.model.transformer import num_active_params, num_params, param_specs
from shipyard.output import write_atomic
from shipyard.parallel import distributed
from shipyard.parallel.mesh import logical_to_pspec, make_mesh, rules_for
from shipyard.runs import base_params
from shipyard.train.checkpoint import Checkpointer, available_steps, checkpoint_dir, restore_latest
from shipyard.train.finetune import Partition
from shipyard.train.metrics import MetricsWriter, flops_per_token, peak_flops
from shipyard.train.optim import build_optimizer
from shipyard.train.rundir import (
    check_resumable,
    prepare_run_dir,
    record_resume,
    truncate_metrics,
    write_run_header,
)
from shipyard.train.sft_data import copy_tokenizer, load_chat_data
from shipyard.train.step import init_state, make_eval_step, make_train_step


def run_dir_for(cfg: Config) -> Path:
    return Path(cfg.run.out_dir) / cfg.run.name


def _host_metrics(m: dict) -> dict:
    return {k: (v.item() if np.ndim(v) == 0 else v.tolist()) for k, v in jax.device_get(m).items()}


def train(
    cfg: Config,
    *,
    run_dir: Path | None = None,
    overwrite: bool = False,
    resume: bool = False,
    debug_nans: bool = False,
    profile_steps: tuple[int, int] | None = None,
) -> Path:
    """Train `cfg` up to `train.steps` steps; returns the run directory.

    `profile_steps` (first, last) records a JAX profiler trace of those steps
    into <run>/profile (open with TensorBoard's profile plugin or Perfetto).

    `resume` continues from the newest usable checkpoint in the run directory
    (or starts the run when there is none). `debug_nans` turns on JAX's NaN
    *and* Inf checking for this run: the first operation that produces either
    raises FloatingPointError naming it.
    """
    if not debug_nans:
        return _train(cfg, run_dir, overwrite, resume, profile_steps)
    with jax.debug_nans(True), jax.debug_infs(True):
        return _train(cfg, run_dir, overwrite, resume, profile_steps)


class _NoWriter:
    """Processes other than 0 log nothing."""

    def write(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


def _global_array(value: np.ndarray, sharding) -> jax.Array:
    """A host value every process holds in full, as a global array (device_put needs it addressable)."""
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def _abstract_state(cfg: Config, specs, shardings, optimizer):
    """The train state's shapes, dtypes and shardings on this mesh, without allocating it
    (what a checkpoint is restored into; the shardings are the ones a fresh init produces)."""
    key = jax.random.key(cfg.train.seed)

    def make():
        return init_state(cfg, init_params(specs, key, shardings), optimizer, shardings)

    shapes = jax.eval_shape(make)
    out_shardings = jax.jit(make).lower().compile().output_shardings
    return jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), shapes, out_shardings
    )


class _StopSignal:
    """SIGTERM / SIGINT ask the loop to checkpoint at the next step boundary and exit cleanly."""

    def __init__(self):
        self.received: int | None = None
        self._previous: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.received = signum

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _train(
    cfg: Config,
    run_dir: Path | None,
    overwrite: bool,
    resume: bool,
    profile_steps: tuple[int, int] | None = None,
) -> Path:
    distributed.initialize(cfg.distributed)
    main = distributed.is_main_process()

    def say(message: str) -> None:
        if main:
            print(message, flush=True)

    run_dir = Path(run_dir) if run_dir is not None else run_dir_for(cfg)
    batch_size, seq_len = cfg.train.global_batch_size, cfg.data.seq_len
    eos_id = None
    chat = None
    if cfg.data.chat is not None:
        chat = load_chat_data(cfg)
        loader, val = chat["loader"], chat["validation"]
        paths = []
        say(chat["summary"])
    else:
        paths, weights = cfg.data.sources()
        if not paths:
            raise ConfigError(
                "data.train_tokens is not set: give a token-shard directory (from `shipyard data tokenize` "
                "or `data prepare`), a 1-D .npy of token ids (e.g. from `shipyard data bytes`), data.mixture, "
                "or data.chat for fine-tuning on conversations"
            )
        loader = build_loader(paths, weights, cfg.train.seed, batch_size, seq_len, cfg.model.vocab_size)
        if cfg.data.document_masking:
            eos_id = cfg.data.eos_id if cfg.data.eos_id is not None else loader.eos_id
            if eos_id is None:
                raise ConfigError(
                    "data.document_masking: no EOS id known for these sources (a .npy, or shard sets with "
                    "different EOS ids); set data.eos_id"
                )
        val = None
        if cfg.train.eval_every is not None:
            val = SequenceSource(cfg.data.validation_tokens, seq_len, cfg.model.vocab_size)
    mesh = make_mesh(cfg.mesh)
    rules = rules_for(cfg.mesh)
    batch_spec = logical_to_pspec(("batch", "seq"), (batch_size, seq_len + 1), mesh, rules)
    if math.prod(mesh.shape[a] for a in rules["batch"]) > 1 and batch_spec[0] is None:
        raise ConfigError(
            f"train.global_batch_size={batch_size} is not divisible by the {mesh.devices.size} "
            "data-parallel devices; choose a multiple"
        )

    ckpt_dir = checkpoint_dir(run_dir)
    resuming = resume and bool(available_steps(ckpt_dir))
    if resuming:
        check_resumable(run_dir, cfg)
    else:
        if resume and (run_dir / "config.yaml").exists():
            say(f"shipyard: --resume: no complete checkpoint in {run_dir}; starting the run from step 0")
        if main:
            prepare_run_dir(run_dir, overwrite or resume)
        if chat is not None:
            inputs = chat["inputs"]
        else:
            names = [f"mixture[{i}]" for i in range(len(paths))] if cfg.data.mixture else ["train_tokens"]
            inputs = {n: {"path": str(p), "sha256": tokens_sha256(p)} for n, p in zip(names, paths)}
        if main:
            write_run_header(run_dir, cfg, inputs)
            if chat is not None:  # the run carries its tokenizer: export, generate and chat find it there
                copy_tokenizer(chat["tokenizer"], run_dir / "tokenizer")
    partition = Partition(cfg.model, cfg.train.finetune)
    full_specs = param_specs(cfg.model)
    specs = partition.trainable_specs()
    distributed.barrier("run directory ready")
    shardings = param_shardings(specs, mesh, rules)
    optimizer = build_optimizer(cfg.train, specs)
    frozen = None
    if partition.kind != "full" or not resuming:
        # The frozen part is never checkpointed: it is re-read from init_from (or the seeded init).
        if cfg.train.init_from is not None:
            say(f"shipyard: starting from the params in {cfg.train.init_from}")
        base = base_params(cfg, full_specs, param_shardings(full_specs, mesh, rules))
        frozen = partition.frozen(base)
    start = 0
    if resuming:
        abstract = _abstract_state(cfg, specs, shardings, optimizer)
        state_shardings = jax.tree.map(lambda a: a.sharding, abstract)
        start, state = restore_latest(ckpt_dir, abstract, say=say)
        if main:
            truncate_metrics(run_dir / "metrics.jsonl", start)
            record_resume(run_dir, start)
            write_atomic(run_dir / "config.yaml", to_yaml(cfg))
        say(f"shipyard: resumed from checkpoint {start} in {ckpt_dir}")
    else:
        params = partition.initial(base, jax.random.key(cfg.train.seed), shardings)
        del base
        state = init_state(cfg, params, optimizer)
        state_shardings = jax.tree.map(lambda x: x.sharding, state)
    frozen_shardings = jax.tree.map(lambda x: x.sharding, frozen)
    batch_sharding = NamedSharding(mesh, batch_spec)
    mask_sharding = NamedSharding(mesh, PartitionSpec(batch_spec[0], None))

    def activations(rows: int) -> NamedSharding:
        shape = (rows, seq_len, cfg.model.hidden_size)
        return NamedSharding(mesh, logical_to_pspec(("batch", "seq", "embed"), shape, mesh, rules))

    micro = activations(batch_size // cfg.train.microbatches)
    batch_keys = BATCH_KEYS if chat is not None else ("tokens", "loss_mask")
    batch_shardings = {k: batch_sharding if k == "tokens" else mask_sharding for k in batch_keys}
    step_fn = jax.jit(
        make_train_step(cfg, optimizer, eos_id, micro, rules, partition),
        in_shardings=(state_shardings, batch_shardings, frozen_shardings),
        out_shardings=(state_shardings, None),
        donate_argnums=0,
    )
    eval_keys = batch_keys if chat is not None else ("tokens",)
    eval_fn = jax.jit(
        make_eval_step(cfg, eos_id, activations(batch_size), rules, partition),
        in_shardings=(state_shardings.params, frozen_shardings, {k: batch_shardings[k] for k in eval_keys}),
    )

    devices = list(mesh.devices.flat)
    peak = peak_flops(cfg.train.logging.peak_flops_per_device, devices)
    flops_tok = flops_per_token(cfg.model, seq_len)
    tokens_per_step = batch_size * seq_len
    say(
        f"shipyard: {num_params(cfg.model):,} params"
        f"{f' ({num_active_params(cfg.model):,} active)' if cfg.model.moe is not None else ''}, "
        f"{len(devices)} {devices[0].platform} device(s)"
        f"{f' in {jax.process_count()} processes' if jax.process_count() > 1 else ''}, "
        f"mesh {dict(mesh.shape)}, run dir {run_dir}"
    )
    if partition.kind != "full":
        n_train = sum(x.size for x in jax.tree.leaves(state.params))
        say(
            f"shipyard: fine-tuning ({partition.kind.replace('_', ' ')}): {n_train:,} trainable params "
            f"({n_train / num_params(cfg.model):.2%} of the model); the rest is frozen"
        )
    loss_mask = _global_array(np.ones((batch_size, seq_len), np.float32), mask_sharding)

    def evaluate(params) -> tuple:
        """Sums over the same held-out sequences every time (the first eval_batches * B)."""
        out = []
        for b in range(cfg.train.eval_batches):
            idx = [(b * batch_size + r) % len(val) for r in range(batch_size)]
            rows = val.rows(idx) if chat is not None else {"tokens": np.stack([val[i] for i in idx])}
            batch = {k: _global_array(v, batch_shardings[k]) for k, v in rows.items()}
            out.append(eval_fn(params, frozen, batch))
        return out

    log = cfg.train.logging
    tb = run_dir / "tb" if log.tensorboard else None
    writer = (
        MetricsWriter(run_dir / "metrics.jsonl", tb, start or None, log.wandb, cfg.model_dump(mode="json"))
        if main
        else _NoWriter()
    )
    checkpointer = Checkpointer(run_dir, cfg.train.checkpoint, cfg.train.steps)
    bar = tqdm(
        total=cfg.train.steps,
        initial=start,
        unit="step",
        disable=not (log.progress and main),
        mininterval=0.5,
        dynamic_ncols=True,
    )
    pending: tuple | None = None
    window_start, window_steps, t0 = None, 0, time.perf_counter()

    def finish(step: int, metrics: dict, val_sums) -> None:
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
        diverged = m["nonfinite_run"] >= cfg.train.max_consecutive_nonfinite
        if step % log.log_every == 0 or last or diverged or val_sums is not None:
            mfu = tok_s * flops_tok / peak if tok_s is not None else None
            record = {"step": step, "loss": m.pop("loss"), "lr": m.pop("lr"), **m}
            if val_sums is not None:
                ce, n = (sum(float(x[i]) for x in val_sums) for i in (0, 1))
                record["val_loss"] = ce / max(n, 1.0)
            record.update(tokens_per_s=tok_s, mfu=mfu, elapsed_s=now - t0)
            writer.write(record)
        if diverged:
            raise TrainingDiverged(
                f"stopped at step {step}: {m['nonfinite_run']} consecutive steps had a non-finite loss or "
                f"gradient (updates were skipped); try a lower train.optimizer.lr or longer warmup, check the "
                f"input tokens, or rerun with --debug-nans to find the first NaN"
            )

    if chat is not None:
        make_batch = partial(device_batch, loader, sharding=batch_shardings)
    else:

        def make_batch(s):
            return {"tokens": device_batch(loader, s, batch_sharding), "loss_mask": loss_mask}

    prefetch = Prefetcher(make_batch, start, cfg.train.steps)
    stopped_at = None
    try:
        with _StopSignal() as stop:
            for step in range(start, cfg.train.steps):
                batch = prefetch.get(step)
                if profile_steps is not None and step == profile_steps[0] and main:
                    jax.profiler.start_trace(str(run_dir / "profile"))
                state, metrics = step_fn(state, batch, frozen)
                if profile_steps is not None and step == profile_steps[1] and main:
                    jax.block_until_ready(metrics)
                    jax.profiler.stop_trace()
                    say(
                        f"shipyard: profile of steps {profile_steps[0]}-{profile_steps[1]} in {run_dir / 'profile'}"
                    )
                done = step + 1
                evaluating = val is not None and (done % cfg.train.eval_every == 0 or done == cfg.train.steps)
                val_sums = evaluate(state.params) if evaluating else None
                if checkpointer.wants(done):
                    checkpointer.save(done, state)
                else:
                    checkpointer.poll()
                # Read the previous step's metrics only after queueing this one, so
                # the device never waits for the host.
                if pending is not None:
                    finish(*pending)
                pending = (step, metrics, val_sums)
                if stop.received is not None and done < cfg.train.steps:
                    checkpointer.save(done, state, wait=True)
                    stopped_at = (done, signal.Signals(stop.received).name)
                    break
            if pending is not None:
                finish(*pending)
    finally:
        prefetch.close()
        bar.close()
        writer.close()
        checkpointer.close()
    elapsed = time.perf_counter() - t0
    if stopped_at is not None:
        say(
            f"shipyard: {stopped_at[1]} received: saved checkpoint {stopped_at[0]} in {ckpt_dir}; "
            f"continue with the same command plus --resume"
        )
        return run_dir
    say(f"shipyard: done {cfg.train.steps} steps in {elapsed:.1f}s; metrics in {run_dir / 'metrics.jsonl'}")
    return run_dir
