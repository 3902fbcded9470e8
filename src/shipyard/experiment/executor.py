"""`shipyard run PIPELINE`: content-addressed steps, skipped when done, every output recorded.

A pipeline file names a `root` and a list of steps (name, kind, inputs,
config). An input is `@step` (that step's output directory), `@step/sub/path`,
or a path (relative to the pipeline file). Each step's output directory is
`<root>/<name>-<hash>`, the hash covering its kind, config, the hashes of its
inputs (an upstream step's own hash; a file's or directory's content) and the
shipyard version, so a changed threshold gives the filter step and everything
downstream new directories while the rest stays done.

A step is done when its `_SUCCESS` marker exists; the marker is written last
(atomically, after `provenance.json`), so a step killed midway leaves none and
its directory is cleared and redone next time. `--dry-run` prints each step's
status and why it would run: new, config changed, input changed, shipyard
version changed, forced, or incomplete (killed). `--force STEP` reruns one.

`shipyard reproduce OUTPUT_DIR` reads the provenance chain behind an output,
reruns every step into a fresh root, and compares each step's artifact
digests (steps.digest) with the recorded ones.

The root may be a bucket (`s3://bucket/prefix`, `gs://`, `memory://`): steps
then run into local staging directories and are published there, the marker
last; done means the marker exists in the bucket (see pipeline/remote.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError

from shipyard import storage
from shipyard.config import Schema, format_validation_error, read_yaml
from shipyard.errors import ConfigError, DataError
from shipyard.experiment import remote
from shipyard.experiment.steps import PATH_INPUTS, STEPS, digest, validate
from shipyard.output import write_atomic
from shipyard.run.rundir import git_commit, package_versions

MARKER = "_SUCCESS"
UNIT_STEPS = ("extract", "filter", "dedup", "decontaminate", "classify", "tokenize")
"""Step kinds whose work units run as Ray tasks of their own under `run --ray`."""


class StepConfig(Schema):
    """One step of a pipeline."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    """Unique step name (letters, digits, `-`, `_`, `.`); the output directory is <root>/<name>-<hash>."""
    kind: Literal[tuple(STEPS)]  # type: ignore[valid-type]
    """What the step does: stdlib, extract, filter, dedup, decontaminate, tokenizer-train, tokenize, train, eval, export-hf, generate, report."""
    inputs: dict[str, str] = {}
    """Input role -> `@step`, `@step/sub/path` or a path relative to the pipeline file."""
    config: dict[str, Any] = {}
    """The step's settings: the data stage's config fields, or for train {preset, overrides: [...]}."""


class PipelineConfig(Schema):
    """A pipeline file."""

    root: str
    """Directory holding every step's output (relative to the pipeline file), or a bucket URL (s3://bucket/prefix)."""
    steps: list[StepConfig]
    """Steps in any order; inputs define the graph."""


@dataclass
class Planned:
    """A step with its resolved hash, inputs and what the executor will do with it."""

    step: StepConfig
    hash: str
    out: Path
    inputs: dict[str, Path]
    input_hashes: dict[str, str]
    status: str  # done | run
    reason: str
    url: str | None = None
    """Where the step is published when the root is a bucket (`out` is then its local staging directory)."""
    recorded_inputs: dict[str, str] | None = None
    """The inputs as provenance records them: upstream outputs where they are published (URLs redacted)."""

    @property
    def location(self) -> str:
        """Where the step's output lives, for messages: its (redacted) URL, else its directory."""
        return storage.redact(self.url) if self.url else str(self.out)


def load_pipeline(
    path: str | Path, root: str | Path | None = None
) -> tuple[PipelineConfig, Path | str, Path]:
    """(config, root dir or bucket URL, base dir for relative paths)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"pipeline file {path} does not exist")
    data = read_yaml(path.read_text(), f"pipeline file {path}")
    try:
        cfg = PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(
            format_validation_error(e, PipelineConfig).replace("invalid config", f"pipeline {path}")
        ) from e
    base = path.resolve().parent
    names = [s.name for s in cfg.steps]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"pipeline {path}: step names must be unique; repeated: {', '.join(dupes)}")
    return cfg, _resolve_root(root if root is not None else cfg.root, root is None, base), base


def _resolve_root(root: str | Path, from_file: bool, base: Path) -> Path | str:
    """A bucket URL as given (no trailing /), else an absolute directory (a file's `root` is
    relative to the file, --root to the working directory)."""
    storage.check_scheme(root, "pipeline root")
    if storage.is_url(root):
        return str(root).rstrip("/")
    path = storage.local(root)
    return (base / path if from_file else path).resolve()


def _content_hash(path: Path) -> str:
    """sha256 over a file's bytes, or a directory's relative paths and file bytes."""
    if not path.exists():
        raise DataError(f"pipeline input {path} does not exist")
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _order(cfg: PipelineConfig) -> list[StepConfig]:
    """Steps in dependency order (ties in file order); a cycle or unknown reference is an error."""
    by_name = {s.name: s for s in cfg.steps}
    deps = {}
    for s in cfg.steps:
        refs = [v[1:].split("/", 1)[0] for v in s.inputs.values() if v.startswith("@")]
        unknown = [r for r in refs if r not in by_name]
        if unknown:
            raise ConfigError(f"pipeline step {s.name}: inputs name unknown steps {unknown}")
        deps[s.name] = refs
    done, out = set(), []
    while len(out) < len(cfg.steps):
        ready = [s for s in cfg.steps if s.name not in done and all(d in done for d in deps[s.name])]
        if not ready:
            left = sorted(set(by_name) - done)
            raise ConfigError(f"pipeline: the inputs of steps {left} form a cycle")
        out.append(ready[0])
        done.add(ready[0].name)
    return out


def _version() -> str:
    from shipyard import __version__

    return __version__


def _previous(root: Path, name: str) -> dict | None:
    """Provenance of the newest finished output of a step with this name, if any."""
    found = []
    for d in root.glob(f"{name}-*"):
        if (d / MARKER).is_file() and (d / "provenance.json").is_file():
            found.append((d.stat().st_mtime, d))
    if not found:
        return None
    return json.loads((max(found)[1] / "provenance.json").read_text())


def plan_pipeline(
    cfg: PipelineConfig, root: Path | str, base: Path, force: tuple[str, ...] = ()
) -> list[Planned]:
    """Hash every step and decide what runs and why (nothing is executed). With a bucket root,
    a step is done iff its marker is in the bucket (each step costs a HEAD, a run a listing)."""
    unknown = [f for f in force if f not in {s.name for s in cfg.steps}]
    if unknown:
        raise ConfigError(
            f"--force {unknown[0]}: no such step (steps: {', '.join(s.name for s in cfg.steps)})"
        )
    bucket = isinstance(root, str)
    if bucket:
        remote.check_root(root)
    planned: dict[str, Planned] = {}
    version = _version()
    for s in cfg.steps:
        validate(s.name, s.kind, s.config, tuple(s.inputs))
    for s in _order(cfg):
        inputs, hashes, recorded = _resolve_inputs(s, planned, base)
        recipe = {"kind": s.kind, "config": s.config, "inputs": hashes, "version": version}
        h = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
        step_dir = f"{s.name}-{h}"
        url = str(storage.join(root, step_dir)) if bucket else None
        out = remote.staging_dir(step_dir) if bucket else root / step_dir
        upstream_reran = any(
            planned[r[1:].split("/")[0]].status == "run" for r in s.inputs.values() if r.startswith("@")
        )
        if s.name in force:
            status, reason = "run", "forced"
        else:
            where = remote.state(url) if bucket else _local_state(out)
            if where == "done" and not upstream_reran:
                status, reason = "done", "done"
            elif where == "partial" and not upstream_reran:
                status, reason = "run", "incomplete (a previous run stopped before finishing)"
            else:
                status, reason = "run", _reason(s, hashes, version, root, upstream_reran)
        planned[s.name] = Planned(s, h, out, inputs, hashes, status, reason, url, recorded)
    return list(planned.values())


def _resolve_inputs(
    s: StepConfig, planned: dict[str, Planned], base: Path
) -> tuple[dict[str, Path], dict[str, str], dict[str, str]]:
    """(paths the step reads, their hashes, where provenance says they are) for each input role."""
    inputs: dict[str, Path] = {}
    hashes: dict[str, str] = {}
    recorded: dict[str, str] = {}
    for role, ref in s.inputs.items():
        if ref.startswith("@"):
            name, _, sub = ref[1:].partition("/")
            up = planned[name]
            inputs[role] = up.out / sub if sub else up.out
            hashes[role] = up.hash + (f"/{sub}" if sub else "")
            recorded[role] = up.location + (f"/{sub}" if sub else "")
        else:
            if "://" in ref:  # Path() would fold s3://b into s3:/b and call it missing
                raise ConfigError(
                    f"pipeline step {s.name}: input {role} {storage.redact(ref)} is a URL; a "
                    "pipeline's external inputs are local paths (copy it locally, or run the "
                    "stage with `shipyard data` on the URL and give its output)"
                )
            p = Path(ref) if Path(ref).is_absolute() else base / ref
            inputs[role] = p.resolve()
            hashes[role] = _content_hash(inputs[role])
            recorded[role] = str(inputs[role])
    return inputs, hashes, recorded


def _local_state(out: Path) -> str:
    """`done` (marker there), `partial` (a directory without one: a killed step) or `absent`."""
    if (out / MARKER).is_file():
        return "done"
    return "partial" if out.exists() else "absent"


def _reason(
    s: StepConfig, hashes: dict[str, str], version: str, root: Path | str, upstream_reran: bool
) -> str:
    """Why a step with no finished output runs: what differs from its newest finished output."""
    prev = remote.previous(root, s.name) if isinstance(root, str) else _previous(root, s.name)
    if prev is None:
        return "new"
    if prev["step"]["config"] != s.config or prev["step"]["kind"] != s.kind:
        return "config changed"
    if prev["input_hashes"] != hashes:
        changed = sorted(r for r in hashes if prev["input_hashes"].get(r) != hashes[r])
        return f"input changed ({', '.join(changed)})"
    if prev["version"] != version:
        return "shipyard version changed"
    return "upstream step forced" if upstream_reran else "new"


def run_step(p: Planned, log=print) -> dict:
    """Run one planned step into its directory; provenance, artifact digests, then the marker.
    With a bucket root the directory is the local staging one, published afterwards (marker last)."""
    if p.out.exists():
        shutil.rmtree(p.out)  # an unfinished or forced earlier attempt
    p.out.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    staged = f" (staging {p.out})" if p.url else ""
    log(f"[{p.step.name}] running ({p.reason}) -> {p.location}{staged}")
    STEPS[p.step.kind](p.out, p.inputs, p.step.config)
    p.out.mkdir(parents=True, exist_ok=True)
    wall = time.time() - started
    record = {
        "step": p.step.model_dump(mode="json"),
        "hash": p.hash,
        "inputs": p.recorded_inputs or {k: str(v) for k, v in p.inputs.items()},
        "input_hashes": p.input_hashes,
        "version": _version(),
        "git_commit": git_commit(),
        "packages": package_versions(),
        "host": {"name": socket.gethostname(), "platform": platform.platform(), "cpus": os.cpu_count()},
        "started": started,
        "wall_seconds": round(wall, 3),
        "artifacts": digest(p.step.kind, p.out),
    }
    own = p.out / "provenance.json"
    if own.is_file():  # the trainer's run provenance (devices, XLA flags, ...) is kept inside
        record["run"] = json.loads(own.read_text())
    write_atomic(own, json.dumps(record, indent=2) + "\n")
    write_atomic(p.out / MARKER, "")
    if p.url:
        remote.publish(p.out, p.url, log)
    log(f"[{p.step.name}] done in {wall:.1f} s")
    return record


def run_pipeline(
    path: str | Path,
    force: tuple[str, ...] = (),
    dry_run: bool = False,
    root=None,
    log=print,
    ray_address: str | None = None,
):
    """Run (or with dry_run only describe) a pipeline; returns the plan.

    Locally, steps run one after another in this process (data steps use their
    own process pools). With `ray_address` ("local" starts a Ray instance
    here) every step that has to run becomes a Ray task that waits for its
    upstream tasks, so independent steps run at the same time on the cluster;
    the root must be on storage every node sees (a bucket root is not supported there).
    With a bucket root, each step that runs first fetches the upstream outputs it reads.
    """
    cfg, out_root, base = load_pipeline(path, root)
    if ray_address is not None and isinstance(out_root, str):
        raise ConfigError(
            f"run --ray: the root {storage.redact(out_root)} is a bucket; Ray runs need a root on a "
            "shared filesystem (or run without --ray)"
        )
    planned = plan_pipeline(cfg, out_root, base, force)
    width = max(len(p.step.name) for p in planned)
    for p in planned:
        log(f"{p.step.name:<{width}}  {p.status:<4}  {p.reason:<40}  {p.location}")
    if dry_run:
        return planned
    if ray_address is not None:
        _run_on_ray(planned, ray_address, log)
        return planned
    by_name = {p.step.name: p for p in planned}
    for p in planned:
        if p.status == "run":
            for q in _needed(p, by_name):
                fetch_output(q, log)
            run_step(p, log)
    return planned


def fetch_output(p: Planned, log=print) -> Path:
    """The step's output directory on this machine: itself for a local root; for a bucket root
    its staging directory, fetched from the bucket unless that copy is already there."""
    if p.url is None:
        return p.out
    return remote.fetch(p.url, p.out, p.step.kind, log)


def _needed(p: Planned, by_name: dict[str, Planned]) -> list[Planned]:
    """The upstream steps whose files `p` reads: its @inputs and, where an output names its own
    inputs by path (steps.PATH_INPUTS: a run's token directories), those too."""
    seen: dict[str, Planned] = {}
    todo = [by_name[u] for u in _upstream(p)]
    while todo:
        q = todo.pop()
        if q.step.name in seen:
            continue
        seen[q.step.name] = q
        refs = [q.step.inputs.get(role, "") for role in PATH_INPUTS.get(q.step.kind, ())]
        todo += [by_name[r[1:].split("/", 1)[0]] for r in refs if r.startswith("@")]
    return list(seen.values())


def _upstream(p: Planned) -> list[str]:
    return [ref[1:].split("/", 1)[0] for ref in p.step.inputs.values() if ref.startswith("@")]


def _ray_step(p: Planned, *upstream_done) -> dict:
    """A step as a Ray task; its arguments include the upstream tasks' results, so Ray runs it after them."""
    return run_step(p)


def _run_on_ray(planned: list[Planned], address: str, log) -> None:
    try:
        import ray
    except ImportError as e:
        raise ConfigError("run --ray: ray is not installed (pip install 'shipyard[ray]')") from e
    # "local" goes to Ray as is: None would join the cluster started last on this machine, if any
    ray.init(address=address, log_to_driver=True)
    try:
        task = ray.remote(_ray_step)
        refs = {}
        for p in planned:
            if p.status == "run":
                # a data step only plans and folds results; its units are tasks of their own, each
                # taking a CPU (a step holding one too could starve them on a small cluster)
                cpus = 0 if p.step.kind in UNIT_STEPS else 1
                upstream = (refs[u] for u in _upstream(p) if u in refs)
                refs[p.step.name] = task.options(num_cpus=cpus).remote(p, *upstream)
        for name, ref in refs.items():
            record = ray.get(ref)
            log(f"[{name}] done on Ray in {record['wall_seconds']:.1f} s")
    finally:
        ray.shutdown()


def reproduce(output_dir: str | Path, root: str | Path, log=print) -> list[dict]:
    """Rerun the recorded chain behind `output_dir` into `root`; compare artifact digests step by step.
    Either may be a bucket URL (the chain is read from the provenance records in the bucket)."""
    storage.check_scheme(output_dir, "reproduce")
    storage.check_scheme(root, "reproduce --root")
    chain: dict[str, dict] = {}

    def collect(d: str) -> None:
        prov = _read_provenance(d)
        for role, ref in prov["step"]["inputs"].items():
            if ref.startswith("@"):
                up = prov["inputs"][role]
                sub = ref[1:].partition("/")[2]
                collect(up[: -len(sub) - 1] if sub else up)
        chain.setdefault(prov["step"]["name"], {"prov": prov, "dir": d})

    collect(str(output_dir).rstrip("/"))
    # External inputs are referred to by absolute path, so the pipeline file can live anywhere.
    steps = []
    for item in chain.values():
        s = item["prov"]["step"]
        inputs = {
            role: (ref if ref.startswith("@") else item["prov"]["inputs"][role])
            for role, ref in s["inputs"].items()
        }
        steps.append({**s, "inputs": inputs})
    pipeline_file, steps_root = _fresh_root(root)
    import yaml

    text = yaml.safe_dump({"root": steps_root, "steps": steps}, sort_keys=False)
    pipeline_file.write_text(text)
    if storage.is_url(root):
        storage.write_bytes(str(storage.join(str(root), "pipeline.yaml")), text.encode())
    planned = run_pipeline(pipeline_file, log=log)
    results = []
    for p in planned:
        recorded = chain[p.step.name]["prov"]["artifacts"]
        now = json.loads((fetch_output(p, log) / "provenance.json").read_text())["artifacts"]
        same = recorded == now
        results.append({"step": p.step.name, "identical": same, "recorded": recorded, "reproduced": now})
        log(f"[{p.step.name}] {'identical' if same else 'DIFFERENT'}: {now}")
    return results


def _read_provenance(d: str) -> dict:
    """A finished step's provenance.json, from a directory or a bucket prefix."""
    if storage.is_url(d):
        if not storage.is_published(d):
            raise DataError(f"reproduce: {storage.redact(d)} has no {MARKER} (not a finished pipeline step)")
        return remote.read_provenance(d)
    path = storage.local(d) / "provenance.json"
    if not path.is_file():
        raise DataError(f"reproduce: {path.parent} has no provenance.json (not a finished pipeline step)")
    return json.loads(path.read_text())


def _fresh_root(root: str | Path) -> tuple[Path, str]:
    """(where the pipeline file goes, the steps' root) for `reproduce --root`, which must be empty.
    For a bucket root the file is written locally too (a pipeline file is read from disk)."""
    if storage.is_url(root):
        root = str(root).rstrip("/")
        remote.check_root(root)
        if storage.list_files(root):
            raise DataError(f"reproduce: {storage.redact(root)} is not empty; give a fresh prefix")
        digest_of_root = hashlib.sha256(storage.redact(root).encode()).hexdigest()[:16]
        local_dir = remote.staging_root() / "reproduce" / digest_of_root
        local_dir.mkdir(parents=True, exist_ok=True)
        return local_dir / "pipeline.yaml", str(storage.join(root, "steps"))
    root = storage.local(root)
    if root.exists() and any(root.iterdir()):
        raise DataError(f"reproduce: {root} is not empty; give a fresh directory")
    root.mkdir(parents=True, exist_ok=True)
    return root / "pipeline.yaml", str(root.resolve() / "steps")
