"""`shipyard train`: build everything from a config and run the loop."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import jax
import numpy as np

from shipyard import storage
from shipyard.config import Config
from shipyard.data.loader import Prefetcher, SequenceSource, build_loader, device_batch
from shipyard.data.tokens import is_shard_set, tokens_sha256
from shipyard.errors import ConfigError, RunDirError
from shipyard.model.params import param_shardings
from shipyard.model.transformer import num_active_params, num_params, param_specs
from shipyard.output import write_atomic
from shipyard.parallel import distributed, pipeline
from shipyard.run import remote
from shipyard.run.checkpoint import (
    Checkpointer,
    available_steps,
    checkpoint_dir,
    restore_latest,
    tidy_after_resume,
)
from shipyard.run.rundir import (
    check_resumable,
    config_text,
    prepare_run_dir,
    record_resume,
    truncate_metrics,
    write_run_header,
)
from shipyard.train.loop import (
    Evaluator,
    LoopParts,
    ProfileWindow,
    StepLog,
    global_array,
    open_writer,
    progress_bar,
    run_loop,
    say_on,
)
from shipyard.train.metrics import flops_per_token, peak_flops
from shipyard.train.preference_data import load_preference_data
from shipyard.train.program import (
    TrainProgram,
    build_program,
    document_eos_id,
    reference_on_the_fly,
)
from shipyard.train.reference import ReferencedLoader, ReferencedRows, cached_reference, reference_copy
from shipyard.train.sft_data import copy_tokenizer, load_chat_data
from shipyard.train.startup import (
    announce_vocab_resize,
    base_params,
    check_ids_fit,
    check_init_from,
    run_tokenizer,
)
from shipyard.train.step import init_state

Say = Callable[[str], None]


def run_dir_for(cfg: Config) -> Path | str:
    """run.out_dir/run.name: a path, or a URL when run.out_dir is one (a run published to a bucket)."""
    if storage.is_url(cfg.run.out_dir):
        return str(storage.join(cfg.run.out_dir, cfg.run.name))
    return Path(cfg.run.out_dir) / cfg.run.name


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


@dataclass(frozen=True)
class TrainData:
    """The run's batches and held-out data, and what the run header records about them."""

    loader: object
    """BatchLoader (token sources), ChatBatchLoader (packed chats) or PairBatchLoader (preference pairs;
    a ReferencedLoader once the reference log-probs are cached)."""
    validation: object
    """SequenceSource, PackedChats, PackedPairs (ReferencedRows) or None."""
    eos_id: int | None
    """EOS id for document masking (None: off)."""
    paths: list
    """Token sources (pretraining; empty for chats)."""
    chat: dict | None
    """load_chat_data's result (chat SFT)."""
    tokenizer: Path | None = None
    """The tokenizer the model speaks (recorded in <run>/tokenizer); None for id .npy files from scratch."""
    preference: dict | None = None
    """load_preference_data's result (preference tuning)."""


def load_data(cfg: Config, say: Say) -> TrainData:
    check_init_from(cfg)  # a bad train.init_from checkpoint is refused before the run directory is written
    if cfg.data.chat is not None:
        chat = load_chat_data(cfg)
        say(chat["summary"])
        return TrainData(chat["loader"], chat["validation"], None, [], chat, Path(chat["tokenizer"]))
    if cfg.data.preference is not None:
        pref = load_preference_data(cfg)
        say(pref["summary"])
        validation = pref["validation"] if cfg.train.eval_every is not None else None
        return TrainData(pref["loader"], validation, None, [], None, Path(pref["tokenizer"]), pref)
    paths, weights = cfg.data.sources()
    if not paths:
        raise ConfigError(
            "data.train_tokens is not set: give a token-shard directory (from `shipyard data tokenize` "
            "or `data prepare`), a 1-D .npy of token ids (e.g. from `shipyard data bytes`), data.mixture, "
            "or data.chat for fine-tuning on conversations"
        )
    seq_len = cfg.data.seq_len
    verify = cfg.data.verify  # shard sizes always, sha256 unless data.verify is false
    loader = build_loader(
        paths, weights, cfg.data_seed(), cfg.train.global_batch_size, seq_len, cfg.model.vocab_size, verify
    )
    eos_id = document_eos_id(cfg, loader.eos_id)
    val = None
    if cfg.train.eval_every is not None:
        val = SequenceSource(cfg.data.validation_tokens, seq_len, cfg.model.vocab_size, verify)
    tokenizer = run_tokenizer(cfg)
    if tokenizer is not None:
        check_ids_fit(cfg, tokenizer)
    return TrainData(loader, val, eos_id, paths, None, tokenizer)


def run_inputs(cfg: Config, data: TrainData) -> dict:
    """The run header's inputs: each training source (or chat file and tokenizer) with its sha256, and
    whether its shards were checked against their manifest's sha256s (data.verify; a .npy has none)."""
    if data.chat is not None:
        return data.chat["inputs"]
    if data.preference is not None:
        return data.preference["inputs"]
    names = [f"mixture[{i}]" for i in range(len(data.paths))] if cfg.data.mixture else ["train_tokens"]
    return {
        n: {
            "path": storage.redact(p),
            "sha256": tokens_sha256(p),
            "verified": cfg.data.verify and is_shard_set(p),
        }
        for n, p in zip(names, data.paths)
    }


def open_run_dir(
    cfg: Config,
    run_dir: Path,
    data: TrainData,
    resume: bool,
    overwrite: bool,
    main: bool,
    say: Say,
    url: str | None = None,
) -> bool:
    """Check a run to resume, or prepare a fresh run directory and write its header; True when resuming."""
    inputs = run_inputs(cfg, data)
    if resume and available_steps(checkpoint_dir(run_dir)):
        check_resumable(run_dir, cfg, inputs)
        return True
    if resume and (run_dir / "config.yaml").exists():
        say(f"shipyard: --resume: no complete checkpoint in {run_dir}; starting the run from step 0")
    if main:
        prepare_run_dir(run_dir, overwrite or resume)
    if main:
        write_run_header(run_dir, cfg, inputs, url)
        if (
            data.tokenizer is not None
        ):  # the run carries its tokenizer: export, generate and chat find it there
            copy_tokenizer(data.tokenizer, run_dir / "tokenizer")
    return False


def initial_state(program: TrainProgram, run_dir: Path, resuming: bool, main: bool, say: Say) -> tuple:
    """(first step, train state, frozen params): fresh from the base params, or the newest usable checkpoint."""
    cfg, partition = program.cfg, program.partition
    base = frozen = None
    if partition.kind != "full" or not resuming:
        # The frozen part is never checkpointed: it is re-read from init_from (or the seeded init).
        if cfg.train.init_from is not None:
            say(f"shipyard: starting from the params in {cfg.train.init_from}")
            announce_vocab_resize(cfg, run_dir if main and not resuming else None, say)
        full_specs = param_specs(cfg.model)
        base = base_params(cfg, full_specs, param_shardings(full_specs, program.mesh, program.rules))
        frozen = partition.frozen(base, program.frozen_shardings)  # QLoRA: quantized once, placed
    if not resuming:
        params = partition.initial(base, jax.random.key(cfg.train.seed), program.shardings)
        return 0, init_state(cfg, params, program.optimizer), frozen
    ckpt_dir = checkpoint_dir(run_dir)
    start, state = restore_latest(ckpt_dir, program.abstract_state, say=say)
    distributed.barrier("checkpoint restored")  # every process has read before main deletes
    if main:
        tidy_after_resume(ckpt_dir, start, cfg.train.checkpoint, say)
        truncate_metrics(run_dir / "metrics.jsonl", start)
        record_resume(run_dir, start)
        write_atomic(run_dir / "config.yaml", config_text(cfg))
    say(f"shipyard: resumed from checkpoint {start} in {ckpt_dir}")
    return start, state, frozen


def starting_trainable(program: TrainProgram):
    """The trainable tree the run started from (what `initial_state` builds at step 0), rebuilt: the
    model's own params or its last layers (from train.init_from or the seeded init), or fresh adapters."""
    cfg, partition = program.cfg, program.partition
    base = None
    if partition.kind != "lora":  # fresh adapters do not read the base
        full_specs = param_specs(cfg.model)
        base = base_params(cfg, full_specs, param_shardings(full_specs, program.mesh, program.rules))
    return partition.initial(base, jax.random.key(cfg.train.seed), program.shardings)


def preference_reference(
    program: TrainProgram, run_dir: Path, data: TrainData, state, frozen, resuming: bool, main: bool, say: Say
) -> tuple[TrainData, object]:
    """(data, on-the-fly reference tree or None) for DPO: with reference: cached the data's batches
    and held-out rows carry the starting model's log-probs (computed once, or reused on resume);
    with on_the_fly the step gets a copy of the starting trainable tree. Called before step 0,
    while `state` still holds its own params."""
    cfg = program.cfg
    if data.preference is None or cfg.train.preference.loss != "dpo":
        return data, None

    def start() -> tuple:
        return (starting_trainable(program) if resuming else state.params), frozen

    if reference_on_the_fly(cfg):
        return data, reference_copy(program, start()[0])
    splits = {"train": data.preference["train"]}
    if data.validation is not None:
        splits["validation"] = data.validation
    inputs = run_inputs(cfg, data)
    arrays = cached_reference(program, run_dir, inputs, splits, start, resuming, main, say)
    validation = None if data.validation is None else ReferencedRows(data.validation, arrays["validation"])
    return replace(data, loader=ReferencedLoader(data.loader, arrays["train"]), validation=validation), None


def announce(program: TrainProgram, state, run_dir: Path, say: Say) -> None:
    """The start-of-run lines: model size, devices and mesh, and what trains when fine-tuning."""
    cfg, mesh = program.cfg, program.mesh
    devices = list(mesh.devices.flat)
    say(
        f"shipyard: {num_params(cfg.model):,} params"
        f"{f' ({num_active_params(cfg.model):,} active)' if cfg.model.moe is not None else ''}, "
        f"{len(devices)} {devices[0].platform} device(s)"
        f"{f' in {jax.process_count()} processes' if jax.process_count() > 1 else ''}, "
        f"mesh {dict(mesh.shape)}, run dir {run_dir}"
    )
    schedule = program.layout.schedule
    if schedule is not None:
        say(f"shipyard: {pipeline.describe(schedule)}")
    if program.partition.kind != "full":
        n_train = sum(x.size for x in jax.tree.leaves(state.params))
        say(
            f"shipyard: fine-tuning ({program.partition.kind.replace('_', ' ')}): {n_train:,} trainable params "
            f"({n_train / num_params(cfg.model):.2%} of the model); the rest is frozen"
        )


def pretraining_batch(loader, sharding, loss_mask: jax.Array, step: int) -> dict:
    return {"tokens": device_batch(loader, step, sharding), "loss_mask": loss_mask}


def batch_source(program: TrainProgram, data: TrainData) -> Callable[[int], dict]:
    """step -> the global batch (this process's rows), laid out as the train step expects."""
    if data.chat is not None or data.preference is not None:
        return partial(device_batch, data.loader, sharding=program.batch_shardings)
    cfg, shardings = program.cfg, program.batch_shardings
    ones = np.ones((cfg.train.global_batch_size, cfg.data.seq_len), np.float32)
    return partial(
        pretraining_batch, data.loader, shardings["tokens"], global_array(ones, shardings["loss_mask"])
    )


def step_log(program: TrainProgram, run_dir: Path, start: int, main: bool) -> StepLog:
    cfg = program.cfg
    peak = peak_flops(cfg.train.logging.peak_flops_per_device, list(program.mesh.devices.flat))
    writer = open_writer(cfg, run_dir, start, main)
    return StepLog(
        cfg, writer, progress_bar(cfg, start, main), flops_per_token(cfg.model, cfg.data.seq_len), peak
    )


def _close(batches, log, checkpointer: Checkpointer, publisher, complete: bool) -> None:
    """End a run's background work: prefetch, logs, pending saves and their hashes, then (a run in a
    bucket) the final publication, whose run marker goes up only when the run finished (`complete`)."""
    # Every part is closed even when one fails (a full disk fails the logs and the save alike);
    # the failure reported is the checkpoint's when there is one: it says which checkpoint is kept.
    failures: list[Exception] = []
    for part in (batches.close, checkpointer.close, log.close):
        try:
            part()
        except Exception as e:
            failures.append(e)
    try:
        if publisher is not None:
            publisher.close(complete and not failures)
    finally:
        if failures:
            raise next((e for e in failures if isinstance(e, RunDirError)), failures[0])


def _train(
    cfg: Config,
    run_dir: Path | None,
    overwrite: bool,
    resume: bool,
    profile_steps: tuple[int, int] | None = None,
) -> Path:
    distributed.initialize(cfg.distributed)
    main = distributed.is_main_process()
    say = partial(say_on, main)
    target = run_dir if run_dir is not None else run_dir_for(cfg)
    storage.check_scheme(target, "--run-dir")
    url = str(target) if storage.is_url(target) else None
    data = load_data(cfg, say)
    program = build_program(cfg, eos_id=data.eos_id)
    # A run in a bucket trains in a local working copy (pulled from the bucket on --resume) and is
    # published as it goes: run/remote.py
    run_dir = remote.local_copy(url) if url is not None else storage.local(target)
    if url is not None and main:
        remote.open_remote(url, resume, overwrite, say)
    resuming = open_run_dir(cfg, run_dir, data, resume, overwrite, main, say, url)
    distributed.barrier("run directory ready")
    start, state, frozen = initial_state(program, run_dir, resuming, main, say)
    data, reference = preference_reference(program, run_dir, data, state, frozen, resuming, main, say)
    announce(program, state, run_dir, say)
    log = step_log(program, run_dir, start, main)
    publisher = None
    if url is not None and main:
        publisher = remote.Publisher(run_dir, url, cfg.train.checkpoint, say)
        publisher.sync_files()  # the header is in the bucket from the start
        log = remote.PublishedLog(log, publisher)
    hashed, idle = (publisher.checkpoint_hashed, publisher.wait_idle) if publisher else (None, None)
    checkpointer = Checkpointer(run_dir, cfg.train.checkpoint, cfg.train.steps, on_hashed=hashed, settle=idle)
    batches = Prefetcher(batch_source(program, data), start, cfg.train.steps)
    evaluate = Evaluator(program, data.validation, frozen, reference)
    profile = ProfileWindow(profile_steps, run_dir / "profile", main, say)
    parts = LoopParts(program.train_step, frozen, batches, evaluate, checkpointer, log, profile, reference)
    try:
        stopped_at = run_loop(parts, state, start, cfg.train.steps)
    except BaseException:
        # the run's own error is the one to report: a store that is down too was said already, and
        # a full disk that failed the save fails the logs' last flush as well
        with contextlib.suppress(Exception):
            _close(batches, log, checkpointer, publisher, complete=False)
        raise
    _close(batches, log, checkpointer, publisher, complete=stopped_at is None)
    if stopped_at is not None:
        say(
            f"shipyard: {stopped_at[1]} received: saved checkpoint {stopped_at[0]} in {checkpointer.directory}; "
            f"continue with the same command plus --resume"
        )
        return run_dir
    say(
        f"shipyard: done {cfg.train.steps} steps in {log.elapsed():.1f}s; metrics in {run_dir / 'metrics.jsonl'}"
    )
    return run_dir
