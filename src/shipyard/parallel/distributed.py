"""Joining a multi-process JAX cluster before anything touches the devices.

Sources, first match wins: the config's `distributed` section, then the
SHIPYARD_COORDINATOR / SHIPYARD_NUM_PROCESSES / SHIPYARD_PROCESS_ID variables
(set by `shipyard launch`), then JAX's own detection of SLURM, Open MPI and
cloud TPU environments. Without any, the run is single-process and nothing is
initialised. On CPU the processes talk through gloo collectives.
"""

from __future__ import annotations

import os

import jax

from shipyard.config import DistributedConfig
from shipyard.errors import ConfigError

_ENV = ("SHIPYARD_COORDINATOR", "SHIPYARD_NUM_PROCESSES", "SHIPYARD_PROCESS_ID")


def _cluster_detected() -> bool:
    """Environments where jax.distributed.initialize() finds everything by itself."""
    slurm = int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ
    mpi = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
    return slurm or mpi or "TPU_WORKER_HOSTNAMES" in os.environ


def settings(cfg: DistributedConfig) -> dict | None:
    """Keyword arguments for jax.distributed.initialize, {} for auto-detection, None for single-process."""
    address = cfg.coordinator_address or os.environ.get(_ENV[0])
    num = cfg.num_processes if cfg.num_processes is not None else os.environ.get(_ENV[1])
    pid = cfg.process_id if cfg.process_id is not None else os.environ.get(_ENV[2])
    given = [v is not None for v in (address, num, pid)]
    if all(given):
        try:
            num, pid = int(num), int(pid)
        except ValueError as e:
            raise ConfigError(
                f"distributed: process count and id must be integers (got {num!r}, {pid!r})"
            ) from e
        if not 0 <= pid < num:
            raise ConfigError(f"distributed.process_id: {pid} is outside 0..{num - 1}")
        if num == 1:
            return None
        return {
            "coordinator_address": address,
            "num_processes": num,
            "process_id": pid,
            "initialization_timeout": cfg.initialization_timeout,
        }
    if any(given):
        raise ConfigError(
            "distributed: set coordinator_address, num_processes and process_id together "
            f"(or {', '.join(_ENV)}); got only some of them"
        )
    return {} if _cluster_detected() else None


def initialize(cfg: DistributedConfig) -> None:
    """Join the cluster described by `cfg` / the environment (no-op for a single process or if done)."""
    kwargs = settings(cfg)
    if kwargs is None or jax.distributed.is_initialized():
        return
    jax.distributed.initialize(**kwargs)


def is_main_process() -> bool:
    """Process 0 writes the run directory's logs, metrics and config; every process checkpoints."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process reaches this point (no-op for one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


STOP_WAIT_MS = 3_600_000
"""How long a process waits at a step boundary for the others (an evaluation or a save can sit
between two boundaries); a dead peer is normally noticed sooner, by the launcher or the heartbeat."""


def agreed_stop(step: int, signum: int | None) -> int | None:
    """The signal the cluster stops on at step boundary `step` (None: go on), from each process's own
    `signum` (the SIGTERM / SIGINT it received, or None). Every process must call this at every
    boundary: a signal reaches processes at different moments, and one that saved while another
    stepped on would wait in different collectives forever. Each process files its signal under
    this step's key before a barrier and reads the keys after it, so all read the same set. One
    barrier per step on the coordination service (about 0.5 ms on one host); one process: `signum`.
    """
    if jax.process_count() == 1:
        return signum
    client = _coordination_client()
    prefix = f"shipyard/stop/{step}/"
    if signum is not None:
        client.key_value_set(f"{prefix}{jax.process_index()}", str(int(signum)))
    client.wait_at_barrier("shipyard-stop", STOP_WAIT_MS)
    filed = client.key_value_dir_get(prefix)
    return max(int(value) for _, value in filed) if filed else None


def _coordination_client():
    """jax.distributed's key-value client. JAX has no public handle on it (Orbax reads the same
    attribute); kept to this one place."""
    from jax._src import distributed

    return distributed.global_state.client
