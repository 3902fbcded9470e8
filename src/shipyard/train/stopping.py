"""Stopping a run cleanly: SIGTERM / SIGINT mark a stop, the loop checkpoints at the next step
boundary the whole cluster agrees on (parallel/distributed.agreed_stop) and exits 0."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import jax

INTERRUPTED_EXIT = 130
"""Exit status of a run stopped by a second Ctrl-C (128 + SIGINT, what shells report for it)."""


class StopSignal:
    """SIGTERM / SIGINT ask the loop to checkpoint at the next step boundary and exit cleanly (exit 0).

    A second SIGINT (Ctrl-C again) stops the process at once with exit 130,
    without waiting for the step, the checkpoint being written or any other
    thread. That is os._exit, not KeyboardInterrupt: an exception would unwind
    through the trainer's cleanup, which waits for the save in flight (not "at
    once"), and could land inside Orbax's own code. Exiting is as safe for the
    files as a SIGKILL: Orbax renames a checkpoint into place only once it is
    complete, so an abandoned save is never taken as one, and --resume
    continues from the newest complete checkpoint (tests/test_resume.py).
    The lines are written with os.write: a handler may run while the main
    thread is inside print().
    """

    def __init__(self, directory: Path | None = None):
        self.received: int | None = None
        self.directory = directory
        self.main = jax.process_index() == 0  # the lines are for process 0's console only
        self._previous: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        where = f" in {self.directory}" if self.directory is not None else ""
        if self.received is not None and signum == signal.SIGINT:
            self._say(
                "shipyard: SIGINT again: stopped at once without saving; --resume continues from the "
                f"newest complete checkpoint{where}"
            )
            os._exit(INTERRUPTED_EXIT)
        first, self.received = self.received is None, signum
        # Marked received before saying so: a second Ctrl-C can arrive while this handler is still
        # writing, and Python runs that handler inside this one; it must see the first.
        if first:
            again = " (Ctrl-C again: stop at once without it)" if signum == signal.SIGINT else ""
            name = signal.Signals(signum).name
            self._say(f"shipyard: {name} received: saving a checkpoint after this step, then stopping{again}")

    def _say(self, line: str) -> None:
        if self.main:  # on a new line: a progress bar may be drawn on the current one
            os.write(2, f"\n{line}\n".encode())

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
