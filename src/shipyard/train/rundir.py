"""The run directory: resolved config, provenance, metrics, all written safely."""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import jax

import shipyard
from shipyard import cpu_tuning
from shipyard.config import Config, to_yaml
from shipyard.errors import RunDirError
from shipyard.output import write_atomic

RUN_FILES = ("config.yaml", "provenance.json", "metrics.jsonl")
_PACKAGES = ("jax", "jaxlib", "optax", "numpy", "pydantic", "pyyaml")


def prepare_run_dir(run_dir: Path, overwrite: bool) -> None:
    """Create the run directory; refuse to clobber an earlier run unless asked."""
    existing = [name for name in RUN_FILES if (run_dir / name).exists()]
    if existing and not overwrite:
        raise RunDirError(
            f"run directory {run_dir} already holds a run ({', '.join(existing)}); "
            "pass --resume to continue it, --overwrite to replace it, or choose another run.name / --run-dir"
        )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        for name in existing:
            (run_dir / name).unlink()
        for sub in ("plots", "checkpoints"):
            if overwrite and (run_dir / sub).is_dir():
                shutil.rmtree(run_dir / sub)
    except OSError as e:
        raise RunDirError(f"run directory {run_dir}: cannot prepare it ({e.strerror})") from e


def check_resumable(run_dir: Path, cfg: Config) -> None:
    """Refuse to resume a run whose saved model differs from `cfg.model`, naming the first difference."""
    import yaml

    saved = run_dir / "config.yaml"
    try:
        old = yaml.safe_load(saved.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise RunDirError(f"--resume: cannot read {saved} to check the model ({e})") from e
    old_model, new_model = old.get("model") or {}, cfg.model.model_dump(mode="json")
    for key in new_model:
        if old_model.get(key) != new_model[key]:
            raise RunDirError(
                f"--resume: the checkpoints in {run_dir} are of another model (model.{key}: "
                f"{old_model.get(key)!r} there, {new_model[key]!r} in this config); use the run's config, "
                "or train this one in a new run directory"
            )
    # What trains and what it starts from decide the checkpoint's structure and the frozen params.
    old_train = old.get("train") or {}
    for key in ("finetune", "init_from"):
        mine = getattr(cfg.train, key)
        mine = mine.model_dump(mode="json") if hasattr(mine, "model_dump") else mine
        if old_train.get(key) != mine:
            raise RunDirError(
                f"--resume: the run in {run_dir} was trained with train.{key}={old_train.get(key)!r}, this config "
                f"has {mine!r}; resume with the run's own setting, or start a new run directory"
            )


def truncate_metrics(path: Path, next_step: int) -> None:
    """Drop metrics of steps at or after `next_step` (logged by a run killed after its last checkpoint)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line)["step"] < next_step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            break  # a torn last line from a kill mid-write
    write_atomic(path, "".join(line + "\n" for line in keep))


def record_resume(run_dir: Path, step: int) -> None:
    """Append this resume (step, host, time, devices) to provenance.json."""
    path = run_dir / "provenance.json"
    try:
        prov = json.loads(path.read_text())
    except (OSError, ValueError):
        prov = {}
    now = provenance({})
    prov.setdefault("resumes", []).append(
        {k: now[k] for k in ("start_time", "host", "devices") if k in now} | {"from_step": step}
    )
    write_atomic(path, json.dumps(prov, indent=2) + "\n")


def _git_commit() -> str | None:
    src = Path(shipyard.__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
        if out.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(src), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def package_versions() -> dict[str, str | None]:
    """shipyard, Python and the versions of the packages whose behaviour the results depend on."""
    versions = {"shipyard": shipyard.__version__, "python": platform.python_version()}
    for pkg in _PACKAGES:
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return versions


def git_commit() -> str | None:
    """The commit shipyard runs from (with -dirty for uncommitted changes), None outside a checkout."""
    return _git_commit()


def provenance(inputs: dict[str, dict]) -> dict:
    devices = jax.devices()
    return {
        "versions": package_versions(),
        "git_commit": _git_commit(),
        "argv": sys.argv,
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "devices": {"count": len(devices), "kind": devices[0].device_kind, "platform": devices[0].platform},
        "process_count": jax.process_count(),
        "inputs": inputs,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "allocator": cpu_tuning.allocator_name(),
        "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_run_header(run_dir: Path, cfg: Config, inputs: dict[str, dict]) -> None:
    write_atomic(run_dir / "config.yaml", to_yaml(cfg))
    write_atomic(run_dir / "provenance.json", json.dumps(provenance(inputs), indent=2) + "\n")
