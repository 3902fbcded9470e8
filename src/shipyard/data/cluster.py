"""Data stages on a Ray cluster: each work unit is one Ray task.

`stage.pool_map` hands a stage's units to `ray_map` when the stage was given
a `RayCluster` instead of a worker count. The task is the same function a
pool worker runs on the same unit (read the unit through the storage layer,
process it, write its part), so the output does not depend on where a unit
ran: part `i` is unit `i`'s output on any node, and the driver folds the
results in unit order. Nothing a task needs comes from the driver's disk:
inputs are bucket URLs or local paths on a filesystem every node mounts (a
task works in the driver's working directory where its node has it, so a
relative path means the same file there and a document's recorded source is
the same string), and a stage's setup (its config, a tokenizer's JSON,
evaluation n-gram sets) travels once per stage through Ray's object store.

Ray retries a task whose node died (`max_retries`); a unit's output is a
pure function of the unit, and a part is written whole before anyone may
read it (`stage.publish_part`), so a retried unit writes the same bytes.

Each task returns the id of the node it ran on with its result, and the driver
counts them (`count_nodes`): a stage run on Ray records in its stats.json the
nodes its tasks actually ran on (`ray_nodes`, `ray_tasks`), not only the
address it was given.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass

from shipyard import storage
from shipyard.errors import DataError, ShipyardError

TASK_RETRIES = 4
"""Times Ray reruns a unit whose worker or node died (a unit is idempotent: same bytes each time)."""


@dataclass(frozen=True)
class RayCluster:
    """Where a data stage's units run instead of a local process pool."""

    address: str
    """A running cluster's address (host:port, `ray://...`, or `auto`), or `local` to start one in
    this process for the command's duration."""

    def __str__(self) -> str:
        return f"the Ray cluster at {self.address}"


def connect(cluster: RayCluster):
    """The `ray` module, connected to `cluster` (once per process; a task on the cluster is already)."""
    try:
        import ray
    except ImportError as e:
        raise DataError("--ray: ray is not installed here (pip install 'shipyard[ray]')") from e
    if ray.is_initialized():
        return ray
    # Ray >= 2.5x turns token auth on once ~/.ray/auth_token exists; a cluster started by `ray start`
    # without it refuses clients that send one, so follow the cluster's own setting.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    check_reachable(cluster)
    try:
        # "local", not None: Ray reads None as "the cluster started last on this machine, if any"
        ray.init(
            address=cluster.address,
            log_to_driver=False,
            configure_logging=False,
            include_dashboard=False if cluster.address == "local" else None,
        )
    except (ConnectionError, RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(
            f"--ray {cluster.address}: no Ray cluster answers there ({first}); start one with "
            "`ray start --head` and pass its address, or pass --ray local"
        ) from None
    return ray


CONNECT_TIMEOUT_S = 10.0
"""How long a `host:port` address gets to accept a TCP connection before the stage gives up."""


def check_reachable(cluster: RayCluster) -> None:
    """Fail at once, in one line, when nothing listens at a `host:port` address (`ray.init` would
    retry for minutes); `local`, `auto` and `ray://` addresses are left to Ray."""
    import socket

    address = cluster.address
    if address in ("local", "auto") or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise DataError(f"--ray {address}: expected host:port of a Ray head (e.g. 10.0.0.5:6379), or local")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise DataError(
            f"--ray {address}: no Ray cluster answers there ({e.strerror or type(e).__name__}); start one "
            "with `ray start --head` and pass its address, or pass --ray local"
        ) from None


def cluster_cpus(ray) -> int:
    """CPUs the cluster has (the width of a stage's task window)."""
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


_NODES: ContextVar[Counter | None] = ContextVar("shipyard_ray_nodes", default=None)


@contextlib.contextmanager
def count_nodes() -> Iterator[Counter]:
    """A Counter of the Ray tasks `ray_map` gets back within the block (in this thread), by the id of
    the node each ran on (the node that finished it, for a task Ray ran again)."""
    nodes: Counter = Counter()
    token = _NODES.set(nodes)
    try:
        yield nodes
    finally:
        _NODES.reset(token)


# The stage setup this worker process last ran (a Ray worker is reused across tasks and stages).
_READY: dict[str, str] = {}


class SetupLost(Exception):
    """A task could not fetch its stage's setup from the object store: its own node is going away
    (its raylet was killed, so the worker's pipe to it broke). Raised so that Ray runs the task again
    elsewhere, as it does when a node dies before a task starts (`retry_exceptions` in `ray_map`):
    left as the OSError it arrives as, it would fail the stage as the unit's own error."""


def _run_unit(fn: Callable, item, boxed_setup: list) -> tuple[str, object]:
    """A Ray task: run the stage's setup once per worker process, then the unit; (the id of the node
    it ran on, the unit's result)."""
    import ray

    ref = boxed_setup[0]  # boxed: a top-level ObjectRef argument would arrive resolved, without its id
    if _READY.get("setup") != ref.hex():
        try:
            env, cwd, initializer, initargs = ray.get(ref)
        except (OSError, ray.exceptions.ObjectLostError) as e:  # not an unpicklable setup: that is no retry's
            raise SetupLost(f"this node could not fetch the stage's setup ({type(e).__name__}: {e})") from e
        storage.apply_environment(env)
        if os.path.isdir(cwd):  # else a relative input fails to open, with a line saying where
            os.chdir(cwd)
        if initializer is not None:
            initializer(*initargs)
        _READY["setup"] = ref.hex()
    return ray.get_runtime_context().get_node_id(), fn(item)


def ray_map(
    fn: Callable,
    items: Iterable,
    cluster: RayCluster,
    env: dict[str, str],
    initializer: Callable | None = None,
    initargs: tuple = (),
) -> Iterator:
    """fn over items as Ray tasks, results in input order; two tasks per cluster CPU in flight (every
    core busy, the driver holding a bounded number of results). `env`: the storage settings tasks use.
    Each result's node is counted in the `count_nodes` block this runs in, if any."""
    ray = connect(cluster)
    setup = [ray.put((env, os.getcwd(), initializer, initargs))]
    task = ray.remote(num_cpus=1, max_retries=TASK_RETRIES, retry_exceptions=[SetupLost])(_run_unit)
    width = 2 * cluster_cpus(ray)
    inflight: deque = deque()
    for item in items:
        inflight.append(task.remote(fn, item, setup))
        if len(inflight) >= width:
            yield _result(ray, inflight.popleft(), cluster)
    while inflight:
        yield _result(ray, inflight.popleft(), cluster)


def _result(ray, ref, cluster: RayCluster):
    """A task's result, its node counted (`count_nodes`); a task's own error re-raised as itself (a
    DataError stays one line)."""
    try:
        got = ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, ShipyardError):
            raise cause from None
        # a task's arguments (the stage's functions and config) that a worker cannot unpickle come
        # as a RaySystemError whose text names the missing module
        missing = cause.name if isinstance(cause, ModuleNotFoundError) else _missing_module(str(e))
        if missing:
            raise DataError(
                f"{cluster}: a worker cannot import {missing!r} (No module named {missing!r}); install "
                "shipyard and its data dependencies on every node"
            ) from None
        if isinstance(cause, (FileNotFoundError, PermissionError)):
            raise DataError(
                f"{cluster}: a worker cannot read {cause.filename or cause} ({type(cause).__name__}); "
                "every node needs the stage's inputs and outputs on a shared filesystem or a bucket"
            ) from None
        raise
    if not isinstance(got, tuple):  # no unit's result is a tuple: an older shipyard's task returned it bare
        raise DataError(
            f"{cluster}: a worker runs another version of shipyard than this driver (its task did not say "
            "which node it ran on); install the same shipyard on every node"
        )
    node, result = got
    nodes = _NODES.get()
    if nodes is not None:
        nodes[node] += 1
    return result


def _missing_module(text: str) -> str | None:
    found = re.search(r"No module named '([^']+)'", text)
    return found[1] if found else None
