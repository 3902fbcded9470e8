"""Saving the train state with Orbax into <run>/checkpoints/<step>.

Orbax writes each checkpoint under a temporary name and marks it complete
only at the end, so an interrupted save never looks like a finished one. Saves
are asynchronous: `save` returns once the arrays are copied to host memory
(so the donated state may be reused by the next step) and the files are
written in the background. Restoring, resume and fallback to an older
checkpoint belong to the loader/checkpoint work built on this module.
"""

from __future__ import annotations

from pathlib import Path

import orbax.checkpoint as ocp

from shipyard.config import CheckpointConfig


class Checkpointer:
    """Decides when to save and saves; one per training run."""

    def __init__(self, run_dir: Path, cfg: CheckpointConfig, total_steps: int):
        self.cfg = cfg
        self.total_steps = total_steps
        self.directory = (run_dir / "checkpoints").absolute()
        self._manager: ocp.CheckpointManager | None = None

    def wants(self, step: int) -> bool:
        """Whether to save the state reached after `step` optimizer steps."""
        periodic = self.cfg.every is not None and step % self.cfg.every == 0
        return periodic or (self.cfg.save_final and step == self.total_steps)

    def save(self, step: int, state) -> None:
        if self._manager is None:
            options = ocp.CheckpointManagerOptions(max_to_keep=self.cfg.keep, enable_async_checkpointing=True)
            self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._manager.save(step, args=ocp.args.StandardSave(state))

    def close(self) -> None:
        """Wait for pending writes to finish."""
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()


def restore(directory: Path, step: int, abstract_state):
    """Read checkpoint `step` into the structure (and shardings) of `abstract_state`.

    With `abstract_state=None` the arrays come back as nested dicts, which is
    enough to inspect a checkpoint without building a model.
    """
    with ocp.CheckpointManager(Path(directory).absolute()) as manager:
        return manager.restore(step, args=ocp.args.StandardRestore(abstract_state))
