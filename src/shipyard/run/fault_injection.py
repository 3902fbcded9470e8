"""A switch that breaks a checkpoint save on purpose, for the checkpoint chaos tests.

`SHIPYARD_CHECKPOINT_FAULT` (unset: this module does nothing) names a save and what to do at the
N-th I/O boundary of it:

    SHIPYARD_CHECKPOINT_FAULT="from=4,list=/tmp/boundaries.txt"   # record every boundary, one a line
    SHIPYARD_CHECKPOINT_FAULT="from=4,kill=7"                     # SIGKILL the process at the 7th
    SHIPYARD_CHECKPOINT_FAULT="from=4,enospc=7"                   # the 7th raises ENOSPC
    SHIPYARD_CHECKPOINT_FAULT="from=4,fill=3"                     # the 3rd fills the disk for real
    SHIPYARD_CHECKPOINT_FAULT="from=4,kill=1,at=marker:_SUCCESS"  # N counts only those that match

With `at=KIND:SUFFIX`, `kill`/`enospc`/`fill` count only the boundaries of that kind whose target
ends with SUFFIX: how many files Orbax writes varies from run to run (its OCDBT data files), so the
boundaries after a checkpoint's uploads have no fixed number; they have a fixed name.

`fill` writes `<run>/.chaos-fill` until the file system says it is full, so the writes after it
(tensorstore's array chunks from C++ included, which `enospc` cannot reach) meet a real ENOSPC;
it is meant for a small file system of the test's own (a tmpfs), and deleting the file frees it.

The window opens when the checkpointer starts saving step `from` (`arm`), once the saves before it
have finished, been hashed and (in a bucket) published, and stays open to the end of the process, so it covers everything that save sets off: Orbax's directory creation, metadata
writes and commit renames, the sha256 sidecar's temporary file and rename, retention's deletes, and
in a run in a bucket each upload, each delete and the run marker (run/remote.py calls `boundary`
for those, since they are network calls, not file operations).

Local file operations are seen through a Python audit hook (`sys.addaudithook`) limited to paths
under the run's checkpoint directory: each open for writing, mkdir, rename/replace, remove, rmdir,
rmtree and truncate is one boundary. Tensorstore writes the array chunks from C++, which no audit
hook sees; those writes lie between the boundaries that are seen (the directory made before them,
the commit rename after), so a kill at each seen boundary still covers every state a save passes
through on disk. Only the checkpoint and publish code call into this module, and only when the
variable is set.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
from pathlib import Path

ENV = "SHIPYARD_CHECKPOINT_FAULT"

_WRITE_EVENTS = (
    "os.mkdir",
    "os.rename",
    "os.replace",
    "os.remove",
    "os.rmdir",
    "shutil.rmtree",
    "os.truncate",
)


class _Plan:
    """What the variable asks for, and the count of boundaries seen since the window opened."""

    def __init__(self, text: str):
        fields = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
        try:
            self.start = int(fields["from"])
            self.kill = int(fields["kill"]) if "kill" in fields else None
            self.enospc = int(fields["enospc"]) if "enospc" in fields else None
            self.fill = int(fields["fill"]) if "fill" in fields else None
            self.at = tuple(fields["at"].split(":", 1)) if "at" in fields else None
            if self.at is not None and len(self.at) != 2:
                raise ValueError(fields["at"])
        except (KeyError, ValueError):
            raise SystemExit(
                f"shipyard: {ENV}={text!r}: expected from=STEP and one of list=FILE, kill=N, enospc=N, "
                "fill=N (and at=KIND:SUFFIX)"
            ) from None
        self.listing = open(fields["list"], "a", encoding="utf-8") if "list" in fields else None  # noqa: SIM115
        self.armed = False
        self.count = 0
        self.matched = 0
        self.lock = threading.Lock()
        self.directory: str | None = None

    def hit(self, kind: str, target: str) -> None:
        with self.lock:
            if not self.armed:
                return
            self.count += 1
            if self.listing is not None:
                self.listing.write(f"{self.count}\t{kind}\t{target}\n")
                self.listing.flush()
            if self.at is not None and (kind != self.at[0] or not target.endswith(self.at[1])):
                return
            self.matched += 1
            n, count = self.matched, self.count
        if n == self.kill:
            sys.stderr.write(f"shipyard: fault injection: SIGKILL at boundary {count} ({kind} {target})\n")
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if n == self.enospc:
            raise OSError(errno.ENOSPC, "No space left on device (injected)", target)
        if n == self.fill and self.directory is not None:
            _fill(os.path.join(os.path.dirname(self.directory), ".chaos-fill"))


def _fill(path: str) -> None:
    """Write zeros to `path` until the file system is full (the file is kept: the disk stays full)."""
    block = bytes(1 << 16)
    with open(path, "ab", buffering=0) as f:
        try:
            while True:
                f.write(block)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
        small = 4096
        while small:  # the last partial blocks, so not even a small file fits
            try:
                f.write(bytes(small))
            except OSError:
                small //= 2


_UNRESOLVED = object()
_plan: object = _UNRESOLVED
_resolving = threading.Lock()
_guard = threading.local()


def _current() -> _Plan | None:
    """The one plan of this process. Under a lock: in a run in a bucket the publisher thread asks
    (its first upload) while the main thread's Checkpointer does (`watch`); two plans would split the
    count, and the audit hook's, without the checkpoint directory, would see no local boundary."""
    global _plan
    with _resolving:
        if _plan is _UNRESOLVED:
            text = os.environ.get(ENV)
            _plan = _Plan(text) if text else None
    return _plan  # type: ignore[return-value]


def _audit(event: str, args: tuple) -> None:
    plan = _plan
    if not isinstance(plan, _Plan) or not plan.armed or getattr(_guard, "busy", False):
        return
    if event == "open":
        # One builtin open() raises two "open" events: io.open's (flags 0) and FileIO's (the real
        # flags), as os.open does; counting by flags counts each open for writing once.
        path, flags = args[0], args[2]
        if not (isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)):
            return
    elif event in _WRITE_EVENTS:
        path = args[0]
    else:
        return
    if isinstance(path, int) or path is None:
        return
    target = os.fsdecode(path)
    if plan.directory is None or not os.path.abspath(target).startswith(plan.directory):
        return
    _guard.busy = True
    try:
        plan.hit(event, os.path.relpath(target, plan.directory))
    finally:
        _guard.busy = False


def watch(checkpoints: Path) -> None:
    """Count file operations under `checkpoints` once a save is armed (no-op when the variable is unset)."""
    plan = _current()
    if plan is None or plan.directory is not None:
        return
    plan.directory = os.path.abspath(checkpoints)
    sys.addaudithook(_audit)


def targets(step: int) -> bool:
    """Whether the variable names the save of `step` (the checkpointer then lets the saves before
    it settle first, so the boundaries counted are this save's alone and their number the same in
    every run)."""
    plan = _current()
    return plan is not None and step == plan.start


def arm(step: int) -> None:
    """A save of `step` starts: open the window when it is the step the variable names."""
    plan = _current()
    if plan is not None and step == plan.start:
        plan.armed = True


def boundary(kind: str, target: str) -> None:
    """One I/O boundary that is not a local file operation (an upload, a delete in a bucket)."""
    plan = _current()
    if plan is not None:
        plan.hit(kind, target)
