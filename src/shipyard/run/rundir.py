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
from shipyard.config import Config
from shipyard.errors import RunDirError
from shipyard.output import write_atomic
from shipyard.storage import redact

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


def check_resumable(run_dir: Path, cfg: Config, inputs: dict[str, dict]) -> None:
    """Refuse to resume a run that `cfg` would not continue, naming the first field that differs.

    Refused (one line, RunDirError; the checkpoints are not touched):
    - the model (`model.*`), what trains and from what (`train.finetune`,
      `train.init_from`) and `train.optimizer.name`: they decide the
      checkpoint's structure and the frozen params;
    - what decides the batch of step s (DESIGN "Determinism"):
      `train.global_batch_size`, `data.seq_len`, the data-order seed
      (`data.seed`, or `train.seed` when null), the mixture weights and the
      training data itself, compared by the sha256 that provenance.json
      recorded for each source (`inputs`: `run_inputs`' names and hashes),
      so data moved to another path still resumes; `train.seed` too, since
      it seeds dropout and the resumed config.yaml must describe the run.
    Accepted, as legitimate ways to continue a run: `train.steps` (extend
    it), the schedule and optimizer hyperparameters, `train.microbatches`
    (the same global batch in smaller pieces, e.g. on fewer devices), the
    mesh (restore works on any device count), checkpointing, logging and
    evaluation settings, `data.validation_tokens`, `data.document_masking`.
    """
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
    old_train, old_data = old.get("train") or {}, old.get("data") or {}
    new_train = cfg.train.model_dump(mode="json")
    # What trains and what it starts from decide the checkpoint's structure and the frozen params.
    fields = [(f"train.{k}", old_train.get(k), new_train[k]) for k in ("finetune", "init_from")]
    fields.append(
        (
            "train.optimizer.name",
            (old_train.get("optimizer") or {}).get("name", "adamw"),
            cfg.train.optimizer.name,
        )
    )
    fields += _data_order_fields(old_train, old_data, cfg)
    for name, was, now in fields:
        if was != now:
            raise RunDirError(
                f"--resume: the run in {run_dir} was trained with {name}: {was!r}, this config has {now!r}; "
                "resume with the run's own setting, or start a new run directory"
            )
    _check_same_data(run_dir, cfg, old_data, inputs)


def _data_order_fields(old_train: dict, old_data: dict, cfg: Config) -> list[tuple[str, object, object]]:
    """(field, saved value, value in cfg) of what decides the batch of step s, besides the data's content."""
    old_seed = old_data.get("seed")
    old_seed = old_train.get("seed", 0) if old_seed is None else old_seed
    old_chat, new_chat = old_data.get("chat") or {}, cfg.data.chat
    old_pref, new_pref = old_data.get("preference") or {}, cfg.data.preference
    return [
        ("train.global_batch_size", old_train.get("global_batch_size"), cfg.train.global_batch_size),
        ("data.seq_len", old_data.get("seq_len"), cfg.data.seq_len),
        ("train.seed", old_train.get("seed", 0), cfg.train.seed),
        # Compared as the seed in effect: data.seed null and data.seed = train.seed give the same order.
        ("the data seed (data.seed, or train.seed when null)", old_seed, cfg.data_seed()),
        (
            "data.mixture weights",
            [c.get("weight") for c in old_data.get("mixture") or ()],
            [c.weight for c in cfg.data.mixture],
        ),
        ("data.chat.template", old_chat.get("template"), new_chat.template if new_chat else None),
        ("data.chat.pack", old_chat.get("pack"), new_chat.pack if new_chat else None),
        ("data.preference.template", old_pref.get("template"), new_pref.template if new_pref else None),
        ("data.preference.pack", old_pref.get("pack"), new_pref.pack if new_pref else None),
    ]


def _source_paths(data: dict) -> list:
    """The training sources named in a dumped DataConfig."""
    chat, pref = data.get("chat") or {}, data.get("preference") or {}
    sources = [
        data.get("train_tokens"),
        *(c.get("path") for c in data.get("mixture") or ()),
        chat.get("train"),
    ]
    return sources + [pref.get("train")]


def _check_same_data(run_dir: Path, cfg: Config, old_data: dict, inputs: dict[str, dict]) -> None:
    """Refuse training data other than the run's: by the sha256s in provenance.json, else by the paths."""

    def training(recorded: dict) -> dict[str, str | None]:
        # held-out data is not part of the batches: it may change
        return {k: (v or {}).get("sha256") for k, v in recorded.items() if "validation" not in k}

    try:
        old_inputs = json.loads((run_dir / "provenance.json").read_text()).get("inputs")
    except (OSError, ValueError, AttributeError):
        old_inputs = None
    if not isinstance(old_inputs, dict):  # no record of the run's data: its paths must be the same
        old_paths, new_paths = _source_paths(old_data), _source_paths(cfg.data.model_dump(mode="json"))
        if old_paths != new_paths:
            raise RunDirError(
                f"--resume: the run in {run_dir} was trained on {old_paths}, this config reads {new_paths} (and "
                "provenance.json does not record the run's data); resume with the run's data, or start a new run directory"
            )
        return
    was, now = training(old_inputs), training(inputs)
    if sorted(was) != sorted(now):
        raise RunDirError(
            f"--resume: the run in {run_dir} was trained on {', '.join(sorted(was))}, this config on "
            f"{', '.join(sorted(now))}; resume with the run's data sources, or start a new run directory"
        )
    for name in sorted(was):
        if was[name] != now[name]:
            raise RunDirError(
                f"--resume: {name} ({inputs[name].get('path')}) is not the data the run in {run_dir} was trained "
                f"on (sha256 {str(was[name])[:12]}... there, {str(now[name])[:12]}... now), so the batches after the "
                "checkpoint would not continue the run; resume with the run's data, or start a new run directory"
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
        "argv": [redact_arg(a) for a in sys.argv],
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "devices": {"count": len(devices), "kind": devices[0].device_kind, "platform": devices[0].platform},
        "process_count": jax.process_count(),
        "inputs": inputs,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "allocator": cpu_tuning.allocator_name(),
        "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def redact_arg(arg: str) -> str:
    """A command-line word with any URL in it redacted (`--run-dir=s3://...`, `data.train_tokens=gs://...`)."""
    if "://" not in arg:
        return arg
    key, sep, value = arg.partition("=")  # the first '=': a URL's query has more
    return f"{key}{sep}{redact(value)}" if sep and "://" not in key else redact(arg)


def _redacted(obj):
    """A dumped config with every URL redacted (credentials never reach config.yaml)."""
    if isinstance(obj, dict):
        return {k: _redacted(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_redacted(v) for v in obj]
    return redact(obj) if isinstance(obj, str) and "://" in obj else obj


def config_text(cfg: Config) -> str:
    """config.yaml's text: the resolved config, URLs redacted."""
    import yaml

    return yaml.safe_dump(_redacted(cfg.model_dump(mode="json")), sort_keys=False)


def write_run_header(run_dir: Path, cfg: Config, inputs: dict[str, dict], url: str | None = None) -> None:
    """config.yaml and provenance.json; `url`: the bucket the run is published to (recorded redacted)."""
    write_atomic(run_dir / "config.yaml", config_text(cfg))
    prov = _redacted(provenance(inputs) | ({"published_to": url} if url is not None else {}))
    write_atomic(run_dir / "provenance.json", json.dumps(prov, indent=2) + "\n")
