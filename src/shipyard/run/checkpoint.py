"""Saving and restoring the train state with Orbax in <run>/checkpoints/<step>.

Orbax writes each checkpoint under a temporary name and renames it when
complete, so an interrupted save (a SIGKILL mid-write) never looks finished;
such leftovers are ignored. Saves are asynchronous: `save` returns once the
arrays are copied to host memory and the files are written in the background.

Once a save has finished, a background thread records the sha256 of every
file in `<step>.sha256.json` next to it. On resume, checkpoints are tried
newest first: one whose files no longer match (truncated, corrupted) or that
fails to load is reported and skipped, and the previous complete one is used.
Every other reader (export, generate, chat, serve, eval, train.init_from,
pipeline digests: all through runs.ModelDir) verifies the one checkpoint it
reads and refuses a bad one (no silent fallback). Hashes go through the
per-user cache of data/hashcache.py, so an unchanged checkpoint is hashed once.

Restoring is against the abstract state (shapes, dtypes and shardings) of the
*current* mesh, so a checkpoint saved with fsdp=8 on 8 devices restores onto 4
devices or 1: Orbax reads each shard's slice for the new layout.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from shipyard.config import CheckpointConfig
from shipyard.data.hashcache import sha256_files
from shipyard.errors import RunDirError

SIDECAR = ".sha256.json"


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
    tmp.write_text(json.dumps(_file_hashes(step_dir, fresh=True), indent=1))
    os.replace(tmp, _sidecar(directory, step))


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


class Checkpointer:
    """Decides when to save, saves asynchronously, and hashes finished saves; one per run."""

    def __init__(
        self,
        run_dir: Path,
        cfg: CheckpointConfig,
        total_steps: int,
        on_hashed: Callable[[int], None] | None = None,
    ):
        """`on_hashed(step)` is called (from the hashing thread) once checkpoint `step` is final and
        its sidecar written: what a run in a bucket publishes (run/remote.py)."""
        self.on_hashed = on_hashed
        self.cfg = cfg
        self.total_steps = total_steps
        self.directory = checkpoint_dir(run_dir)
        self._manager: ocp.CheckpointManager | None = None
        self._unhashed: list[int] = []
        self._hasher: threading.Thread | None = None

    def wants(self, step: int) -> bool:
        """Whether to save the state reached after `step` optimizer steps."""
        periodic = self.cfg.every is not None and step % self.cfg.every == 0
        return periodic or (self.cfg.save_final and step == self.total_steps)

    def _get_manager(self) -> ocp.CheckpointManager:
        if self._manager is None:
            options = ocp.CheckpointManagerOptions(
                max_to_keep=self.cfg.keep,
                keep_period=self.cfg.keep_every,
                enable_async_checkpointing=True,
            )
            self._manager = ocp.CheckpointManager(self.directory, options=options)
        return self._manager

    def save(self, step: int, state, wait: bool = False) -> None:
        manager = self._get_manager()
        if step in manager.all_steps():  # e.g. a SIGTERM right after a periodic save
            return
        manager.save(step, args=ocp.args.StandardSave(state))
        self._unhashed.append(step)
        if wait:
            manager.wait_until_finished()
        self.poll()

    def poll(self) -> None:
        """Start hashing saves that have finished (cheap to call every step); process 0 does it."""
        if not self._unhashed or self._manager is None or self._manager.is_saving_in_progress():
            return
        if jax.process_index() != 0:
            self._unhashed = []
            return
        if self._hasher is not None and self._hasher.is_alive():
            return
        steps, self._unhashed = self._unhashed, []
        kept = set(self._manager.all_steps())

        def work():
            for step in steps:
                if step in kept:
                    write_checksums(self.directory, step)
                    if self.on_hashed is not None:
                        self.on_hashed(step)
            # sidecars of checkpoints Orbax has garbage-collected go too
            for sidecar in self.directory.glob(f"*{SIDECAR}"):
                stem = sidecar.name[: -len(SIDECAR)]
                if stem.isdigit() and not (self.directory / stem).is_dir():
                    sidecar.unlink(missing_ok=True)

        self._hasher = threading.Thread(target=work, daemon=True)
        self._hasher.start()

    def close(self) -> None:
        """Wait for pending writes and their checksums."""
        if self._manager is not None:
            self._manager.wait_until_finished()
            self.poll()
            if self._hasher is not None:
                self._hasher.join()
            self._manager.close()


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
    """(step, state) from the newest checkpoint that verifies and loads; older ones on failure, saying why."""
    steps = available_steps(directory)
    if not steps:
        raise RunDirError(f"--resume: no complete checkpoint in {directory} (the run saved none yet)")
    for step in steps:
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
