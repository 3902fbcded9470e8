"""Saving and restoring the train state with Orbax in <run>/checkpoints/<step>.

Orbax writes each checkpoint under a temporary name and renames it when
complete, so an interrupted save (a SIGKILL mid-write) never looks finished;
such leftovers are ignored. Saves are asynchronous: `save` returns once the
arrays are copied to host memory and the files are written in the background.

Once a save has finished, a background thread records the sha256 of every
file in `<step>.sha256.json` next to it (the checkpoint is then *verified*),
and only then applies the keep policy, to checkpoints up to that one: a save
that fails or is killed before its sidecar exists never costs the previous
verified checkpoint. Retention takes a checkpoint out of Orbax's view with one
rename before deleting it, so a kill mid-delete never leaves a half-deleted
checkpoint that looks complete.

On resume, checkpoints are tried newest first, and a newer checkpoint without
a sidecar (killed between Orbax's commit and the hashing) is passed over when
a verified one exists: one whose files no longer match (truncated, corrupted)
or that fails to load is reported and skipped, and the previous one is used.
Checkpoints newer than the one resumed from are then deleted (`tidy_after_resume`),
so the resumed run saves them again. Every other reader (export, generate,
chat, serve, eval, train.init_from, pipeline digests: all through
runs.ModelDir) verifies the one checkpoint it reads and refuses a bad one (no
silent fallback). Hashes go through the per-user cache of data/hashcache.py,
so an unchanged checkpoint is hashed once.

A save that cannot be written (disk full, permissions) stops the run with one
line naming the checkpoint kept; a save is refused up front when the disk has
less free space than the previous checkpoint took. `run/fault_injection.py`
breaks saves on purpose for the chaos tests (inert unless its variable is set).

Restoring is against the abstract state (shapes, dtypes and shardings) of the
*current* mesh, so a checkpoint saved with fsdp=8 on 8 devices restores onto 4
devices or 1: Orbax reads each shard's slice for the new layout.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from shipyard.config import CheckpointConfig
from shipyard.data.hashcache import sha256_files
from shipyard.errors import RunDirError
from shipyard.run import fault_injection

SIDECAR = ".sha256.json"
DELETING = ".orbax-checkpoint-tmp-deleted"
"""Suffix a checkpoint is renamed to before retention deletes it: Orbax takes any name with
`.orbax-checkpoint-tmp` for an unfinished save, so the checkpoint leaves its view in one rename."""


def checkpoint_dir(run_dir: Path) -> Path:
    return (Path(run_dir) / "checkpoints").absolute()


def _file_names(step_dir: Path) -> list[str]:
    names = []
    for root, _, files in os.walk(step_dir):
        names += [(Path(root) / name).relative_to(step_dir).as_posix() for name in sorted(files)]
    return names


def _file_hashes(step_dir: Path, fresh: bool = False) -> dict[str, str]:
    # Through the per-user hash cache: a checkpoint's files never change once Orbax has renamed it
    # into place, so an unchanged file is hashed once (its first verify, or the sidecar's own hashing).
    return sha256_files(step_dir, _file_names(step_dir), fresh=fresh)


def _sidecar(directory: Path, step: int) -> Path:
    return directory / f"{step}{SIDECAR}"


def write_checksums(directory: Path, step: int) -> None:
    """Hash a finished checkpoint's files into <step>.sha256.json (written atomically)."""
    step_dir = directory / str(step)
    if not step_dir.is_dir():
        return
    tmp = _sidecar(directory, step).with_suffix(".tmp")
    text = json.dumps(_file_hashes(step_dir, fresh=True), indent=1)
    try:
        tmp.write_text(text)
        os.replace(tmp, _sidecar(directory, step))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def verify_checksums(directory: Path, step: int) -> str | None:
    """None when checkpoint `step` matches its recorded hashes (or has none yet), else what is wrong.

    No sidecar is not an error: it is written by a background thread after Orbax has finalised the
    save (an atomic rename, so the checkpoint itself is complete), and a run killed in between, a run
    still hashing its newest save, or a checkpoint from before sidecars existed has none. `--resume`
    and every other reader accept such a checkpoint as Orbax left it."""
    sidecar = _sidecar(directory, step)
    if not sidecar.is_file():
        return None
    try:
        recorded = json.loads(sidecar.read_text())
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return f"its checksum file {sidecar} is unreadable ({type(e).__name__})"
    if not isinstance(recorded, dict) or not all(isinstance(v, str) for v in recorded.values()):
        return f"its checksum file {sidecar} is not a {{file: sha256}} object"
    step_dir = directory / str(step)
    actual = sha256_files(step_dir, list(recorded))
    for name, digest in recorded.items():
        if name not in actual:
            return f"file {step_dir / name} is missing"
        if actual[name] != digest:
            return f"file {step_dir / name} does not match its recorded sha256 (truncated or corrupted)"
    return None


def verified(directory: Path, step: int) -> str | None:
    """None when checkpoint `step`'s sha256 sidecar is written and matches (strict, unlike
    `verify_checksums`: what a server watching a run swaps to), "not hashed yet" without one, else
    what is wrong."""
    if not _sidecar(directory, step).is_file():
        return "not hashed yet"
    return verify_checksums(directory, step)


def doomed_steps(steps: list[int], cfg: CheckpointConfig) -> list[int]:
    """Which of `steps` the keep policy drops: all but the newest `keep` and the multiples of
    `keep_every` (locally after each verified save, in a bucket after each publication)."""
    if cfg.keep is None:
        return []
    newest = set(sorted(steps, reverse=True)[: cfg.keep])
    return sorted(s for s in steps if s not in newest and not (cfg.keep_every and s % cfg.keep_every == 0))


def drop_checkpoint(directory: Path, step: int) -> None:
    """Delete checkpoint `step`: renamed out of Orbax's view first (one atomic step), then its
    sidecar, then its files, so a kill at any point leaves either the whole checkpoint or a
    leftover that no reader takes for one."""
    step_dir, doomed = directory / str(step), directory / f"{step}{DELETING}"
    if step_dir.is_dir():
        os.replace(step_dir, doomed)
    _sidecar(directory, step).unlink(missing_ok=True)
    if doomed.exists():
        shutil.rmtree(doomed)


def _clear_leftovers(directory: Path) -> None:
    """What a kill left: unfinished saves and deletes, and sidecars whose checkpoint is gone (run
    at the start of a run, when no save of it can be in progress)."""
    if not directory.is_dir():
        return
    for path in directory.glob("*.orbax-checkpoint-tmp*"):  # DELETING, and Orbax's unfinished saves
        shutil.rmtree(path, ignore_errors=True)
    for tmp in directory.glob("*.sha256.tmp"):  # write_checksums' temporary, killed before its rename
        tmp.unlink(missing_ok=True)
    for sidecar in directory.glob(f"*{SIDECAR}"):
        stem = sidecar.name[: -len(SIDECAR)]
        if stem.isdigit() and not (directory / stem).is_dir():
            sidecar.unlink(missing_ok=True)


def _finalised_steps(directory: Path) -> list[int]:
    """Steps whose directory Orbax has renamed into place (a plain number), read off the disk."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


_TENSORSTORE_OS_ERROR = re.compile(r"os_error_code='?(\d+)|\[errno=(\d+)\]|errno (\d+)")


def io_failure(error: BaseException) -> str | None:
    """What went wrong in words when `error` is a file-system failure (an OSError, or the
    ValueError tensorstore raises for one), else None (a bug: let it through as it is)."""
    if isinstance(error, OSError):
        where = f" ({error.filename})" if error.filename else ""
        return f"{error.strerror or error}{where}"
    text = str(error)
    found = _TENSORSTORE_OS_ERROR.search(text)
    if found is None:
        return None
    code = int(next(g for g in found.groups() if g))
    path = re.search(r'Failed (?:writing|to open|opening)[^"]*"([^"]+)"', text)
    return f"{os.strerror(code)}" + (f" ({path.group(1)})" if path else "")


class _OrbaxIOErrors(logging.Filter):
    """Drops the traceback Orbax logs for a failed background write: the run reports that
    failure itself, as one line (`Checkpointer._failed`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return error is None or io_failure(error) is None


def _closed_loop(kind, value) -> bool:
    return kind is RuntimeError and str(value) == "Event loop is closed"


def _quiet_closed_loop(hook):
    """sys.excepthook without the "Event loop is closed" tracebacks tensorstore raises when the
    writes of a failed save finish after Orbax has closed their event loop (one per array, each
    the failure that `Checkpointer` reports as one line)."""

    def excepthook(kind, value, tb):
        if not _closed_loop(kind, value):
            hook(kind, value, tb)

    excepthook.quiet_closed_loop = True  # type: ignore[attr-defined]
    return excepthook


def _quiet_closed_loop_unraisable(hook):
    """sys.unraisablehook likewise: tensorstore's completion callbacks run on its own threads,
    where the same RuntimeError has no caller and is reported as unraisable."""

    def unraisablehook(unraisable):
        if not _closed_loop(unraisable.exc_type, unraisable.exc_value):
            hook(unraisable)

    unraisablehook.quiet_closed_loop = True  # type: ignore[attr-defined]
    return unraisablehook


def _release_stranded_waits() -> None:
    """After a save failed before Orbax signalled the next stage of it (its directory made, say),
    the threads of the later stages go on waiting for that signal for Orbax's coordination timeout
    (many minutes), and they are not daemon threads: the process would hang at exit instead of
    reporting the failure. Each is cancelled and given the signal, so it wakes and returns.

    Orbax's internals (0.12): on another version whose names differ this does nothing. One
    process only: in a cluster the signals live in JAX's shared key-value store, where setting
    one would wake the other processes' stages too."""
    if jax.process_count() != 1:
        return
    try:
        from orbax.checkpoint._src.futures import future, signaling_client

        thread_type, contract = future._SignalingThread, future.AwaitableSignalsContract
        client = signaling_client.get_signaling_client()
        for thread in threading.enumerate():
            if isinstance(thread, thread_type) and thread.is_alive():
                thread.cancel()
                for signal in thread._receive_signals:
                    key = contract.get_unique_awaitable_singal_key(signal, thread._operation_id)
                    client.key_value_set(key, "released", allow_overwrite=True)
    except (ImportError, AttributeError, TypeError):
        return


class Checkpointer:
    """Decides when to save, saves asynchronously, hashes finished saves and applies the keep
    policy after them; one per run."""

    def __init__(
        self,
        run_dir: Path,
        cfg: CheckpointConfig,
        total_steps: int,
        on_hashed: Callable[[int], None] | None = None,
        settle: Callable[[], None] | None = None,
    ):
        """`on_hashed(step)` is called (from the hashing thread) once checkpoint `step` is final and
        its sidecar written: what a run in a bucket publishes (run/remote.py). `settle()` waits
        until what `on_hashed` started is done (only for the fault-injection switch)."""
        self.on_hashed = on_hashed
        self.settle = settle
        self.cfg = cfg
        self.total_steps = total_steps
        self.directory = checkpoint_dir(run_dir)
        self._manager: ocp.CheckpointManager | None = None
        self._unhashed: list[int] = []
        self._hasher: threading.Thread | None = None
        self._failure: RunDirError | None = None
        fault_injection.watch(self.directory)

    def wants(self, step: int) -> bool:
        """Whether to save the state reached after `step` optimizer steps."""
        periodic = self.cfg.every is not None and step % self.cfg.every == 0
        return periodic or (self.cfg.save_final and step == self.total_steps)

    def _get_manager(self) -> ocp.CheckpointManager:
        if self._manager is None:
            for name in ("absl", "asyncio"):  # asyncio: the failed writes' futures, at exit
                logging.getLogger(name).addFilter(_OrbaxIOErrors())
            if not getattr(sys.excepthook, "quiet_closed_loop", False):
                sys.excepthook = _quiet_closed_loop(sys.excepthook)
            if not getattr(sys.unraisablehook, "quiet_closed_loop", False):
                sys.unraisablehook = _quiet_closed_loop_unraisable(sys.unraisablehook)
            # No max_to_keep: Orbax would delete old checkpoints as soon as a new save starts,
            # before that save is known to be whole; retention runs after hashing instead.
            options = ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
            self._manager = self._orbax(None, lambda: ocp.CheckpointManager(self.directory, options=options))
        return self._manager

    def _kept(self) -> str:
        """Which checkpoint a resume would continue from, in words."""
        done = _finalised_steps(self.directory)
        good = [s for s in reversed(done) if verified(self.directory, s) is None]
        if good:
            return f"checkpoint {good[0]} is intact"
        return (
            "no checkpoint was saved before" if not done else f"checkpoint {done[-1]} is kept (not verified)"
        )

    def _failed(self, step: int | str | None, reason: str) -> RunDirError:
        """One line for a failed save (`step`: its number, or what was being done, in words)."""
        what = (
            step
            if isinstance(step, str)
            else f"saving checkpoint {step}"
            if step is not None
            else "saving a checkpoint"
        )
        return RunDirError(
            f"{what} in {self.directory} failed: {reason}; {self._kept()}: fix that, then "
            "continue with the same command plus --resume"
        )

    def _orbax(self, step: int | None, call: Callable):
        """`call()`, with a file-system failure turned into one line (the manager closed first)."""
        try:
            return call()
        except Exception as e:
            reason = io_failure(e)
            if reason is None:
                raise
            manager, self._manager = self._manager, None
            # What Orbax says on the way down (warnings about the files it could not write, the
            # coroutines a failed save never ran) repeats the one failure reported here.
            warnings.filterwarnings("ignore", "coroutine .* was never awaited", RuntimeWarning)
            absl = logging.getLogger("absl")
            level, _ = absl.level, absl.setLevel(logging.ERROR)
            try:
                if manager is not None:
                    with contextlib.suppress(Exception):  # the same failure again
                        manager.close()
            finally:
                absl.setLevel(level)
            _release_stranded_waits()
            raise self._failed(step, reason) from None

    def _check_space(self, step: int) -> None:
        previous = [s for s in _finalised_steps(self.directory) if s < step]
        if not previous:
            return
        need = _size(self.directory / str(previous[-1]))
        free = shutil.disk_usage(self.directory).free
        if free < need:
            raise RunDirError(
                f"saving checkpoint {step} in {self.directory}: it needs about {need / 2**20:.1f} MiB "
                f"(the size of checkpoint {previous[-1]}) and the disk has {free / 2**20:.1f} MiB free; "
                f"nothing was written and {self._kept()}: free space, then continue with the same "
                "command plus --resume"
            )

    def save(self, step: int, state, wait: bool = False) -> None:
        self._raise_failure()
        manager = self._get_manager()
        if step in manager.all_steps():  # e.g. a SIGTERM right after a periodic save
            return
        self._check_space(step)
        if fault_injection.targets(step):
            self._settle()
        fault_injection.arm(step)
        self._orbax(step, lambda: manager.save(step, args=ocp.args.StandardSave(state)))
        self._unhashed.append(step)
        if wait:
            self._orbax(step, manager.wait_until_finished)
        self.poll()

    def _settle(self) -> None:
        """Let every earlier save finish, be hashed, retained and published (no overlap with the next)."""
        if self._manager is not None:
            self._finish_pending()
        if self.settle is not None:
            self.settle()
        self._raise_failure()

    def _finish_pending(self) -> None:
        """Wait for the pending write, then for its hashing and retention (which poll starts)."""
        self._orbax(self._unhashed[-1] if self._unhashed else None, self._manager.wait_until_finished)
        if self._hasher is not None:  # poll starts no second hasher while one runs
            self._hasher.join()
        self.poll()
        if self._hasher is not None:
            self._hasher.join()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure

    def poll(self) -> None:
        """Start hashing saves that have finished (cheap to call every step); process 0 does it."""
        self._raise_failure()
        if not self._unhashed or self._manager is None or self._manager.is_saving_in_progress():
            return
        # The background write is over: a failure in it is raised here (no wait).
        self._orbax(self._unhashed[-1], self._manager.wait_until_finished)
        if jax.process_index() != 0:
            self._unhashed = []
            return
        if self._hasher is not None and self._hasher.is_alive():
            return
        steps, self._unhashed = self._unhashed, []
        self._hasher = threading.Thread(target=self._hash_and_retain, args=(steps,), daemon=True)
        self._hasher.start()

    def _hash_and_retain(self, steps: list[int]) -> None:
        doing = "saving a checkpoint"
        try:
            for step in steps:
                if not (self.directory / str(step)).is_dir():
                    continue
                doing = f"saving checkpoint {step}"
                write_checksums(self.directory, step)
                # Only now that `step` is verified may older ones go, and only those up to it.
                done = [s for s in _finalised_steps(self.directory) if s <= step]
                for old in doomed_steps(done, self.cfg):
                    doing = f"deleting checkpoint {old} (train.checkpoint.keep) after saving {step}"
                    drop_checkpoint(self.directory, old)
                if self.on_hashed is not None:
                    self.on_hashed(step)
        except OSError as e:
            self._failure = self._failed(doing, io_failure(e) or str(e))

    def close(self) -> None:
        """Wait for pending writes, their checksums and retention."""
        if self._manager is not None:
            pending = self._unhashed[-1] if self._unhashed else None
            self._finish_pending()
            manager, self._manager = self._manager, None
            self._orbax(pending, manager.close)
        self._raise_failure()


def available_steps(directory: Path) -> list[int]:
    """Complete checkpoints (Orbax-finalised step directories), newest first."""
    if not directory.is_dir():
        return []
    with ocp.CheckpointManager(directory) as manager:
        return sorted(manager.all_steps(), reverse=True)


def restore(directory: Path, step: int, abstract_state):
    """Read checkpoint `step` into the structure (and shardings) of `abstract_state`.

    With `abstract_state=None` the arrays come back as nested dicts, which is
    enough to inspect a checkpoint without building a model.
    """
    with ocp.CheckpointManager(Path(directory).absolute()) as manager:
        return manager.restore(step, args=ocp.args.StandardRestore(abstract_state))


def restore_params(directory: Path, step: int, abstract_params):
    """Only the params of checkpoint `step` (Orbax partial restore): the optimizer moments,
    twice the params' size, are never read, and no train state has to be built to
    restore into (what export, eval and generate need)."""
    target = {"params": abstract_params}
    args = ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True
    )
    with ocp.CheckpointManager(Path(directory).absolute()) as manager:
        return manager.restore(step, args=args)["params"]


def restore_latest(directory: Path, abstract_state, say: Callable[[str], None] = print):
    """(step, state) from the newest verified checkpoint that loads; older ones on failure, saying
    why. A newer one without a sidecar (the run was killed before hashing it) is passed over when
    a verified one exists, and taken as Orbax left it when none does (a run from before sidecars)."""
    steps = available_steps(directory)
    if not steps:
        raise RunDirError(f"--resume: no complete checkpoint in {directory} (the run saved none yet)")
    hashed = [s for s in steps if _sidecar(directory, s).is_file()]
    for step in steps:
        if hashed and step > hashed[0]:
            say(
                f"shipyard: checkpoint {step} in {directory} was never verified (the run stopped before "
                f"its sha256 sidecar was written); resuming from checkpoint {hashed[0]}, which was"
            )
            continue
        problem = verify_checksums(directory, step)
        if problem is None:
            try:
                return step, restore(directory, step, abstract_state)
            except Exception as e:  # orbax/tensorstore raise many types for unreadable data
                problem = f"it does not load ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        older = [s for s in steps if s < step]
        fallback = (
            f"falling back to checkpoint {older[0]}" if older else "no older checkpoint to fall back to"
        )
        say(f"shipyard: checkpoint {step} in {directory} is unusable: {problem}; {fallback}")
    raise RunDirError(f"--resume: no usable checkpoint in {directory} (all {len(steps)} failed; see above)")


def tidy_after_resume(directory: Path, step: int, cfg: CheckpointConfig, say: Callable[[str], None] = print):
    """After a resume from checkpoint `step`: the checkpoints newer than it (those `restore_latest`
    passed over) deleted, so the resumed run saves them again and no later resume meets them; the
    leftovers of a killed save or delete cleared; the keep policy applied (a run killed before its
    retention ran, then resumed at its last step, saves nothing more)."""
    for newer in [s for s in _finalised_steps(directory) if s > step]:
        drop_checkpoint(directory, newer)
        say(
            f"shipyard: deleted checkpoint {newer} in {directory} (passed over above); this run saves it again"
        )
    _clear_leftovers(directory)
    for old in doomed_steps(_finalised_steps(directory), cfg):
        drop_checkpoint(directory, old)
