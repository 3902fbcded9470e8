"""The DPO reference: log-probs of the starting model, cached once per run or run in every step.

The reference model is the model the run starts from, for every kind of
fine-tuning: `Partition.compute_params` of the initial trainable tree and the frozen one (full
training: the initial params; LoRA: fresh adapters with B = 0, so the base).

reference: cached computes every packed row's reply log-probs (train and
held-out rows) with one jitted forward before step 0 and stores them in
<run>/reference_logps/ (train.npy, validation.npy and manifest.json with their
sha256 and what they were computed from), written atomically. A resumed run
reuses them after checking they belong to this data and model, and
recomputes them (saying why, in one line) when they do not. The batches then
carry each row's `ref_logps`.

reference: on_the_fly keeps a copy of the starting trainable tree, in the
compute dtype, as a read-only argument of the step (see train/step.py).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from shipyard.config import Config
from shipyard.data.preference import PREFERENCE_BATCH_KEYS, PackedPairs
from shipyard.data.shards import file_sha256
from shipyard.output import atomic_dir, progress, write_json
from shipyard.train.loop import global_array
from shipyard.train.program import TrainProgram

CACHE_DIR = "reference_logps"
"""The cache's directory in the run directory."""

Say = Callable[[str], None]


@dataclass(frozen=True)
class ReferencedLoader:
    """A PairBatchLoader whose batches also carry each row's cached reference log-probs (`ref_logps`)."""

    loader: object
    ref: np.ndarray
    """[rows, 2P] float32, indexed by packed row."""

    @property
    def batch_size(self) -> int:
        return self.loader.batch_size

    @property
    def row_shapes(self) -> dict[str, tuple[int, ...]]:
        return {**self.loader.row_shapes, "ref_logps": self.ref.shape[1:]}

    def rows(self, step: int, lo: int = 0, hi: int | None = None) -> dict[str, np.ndarray]:
        idx = self.loader.row_indices(step, lo, hi)
        return {**self.loader.packed.rows(idx), "ref_logps": self.ref[idx]}


@dataclass(frozen=True)
class ReferencedRows:
    """Held-out PackedPairs whose rows also carry their cached reference log-probs."""

    packed: PackedPairs
    ref: np.ndarray

    def __len__(self) -> int:
        return len(self.packed)

    def rows(self, idx) -> dict[str, np.ndarray]:
        return {**self.packed.rows(idx), "ref_logps": self.ref[idx]}


def rows_sha256(packed: PackedPairs) -> str:
    """sha256 of a set of packed rows (every batch array): the rows the cache belongs to."""
    h = hashlib.sha256()
    for key in PREFERENCE_BATCH_KEYS:
        a = np.ascontiguousarray(getattr(packed, key))
        h.update(f"{key}{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def fingerprint(cfg: Config, inputs: dict, splits: dict[str, PackedPairs]) -> dict:
    """What the cached log-probs depend on: the rows (and the inputs they came from), the model, what
    it starts from (train.init_from, or the seeded init), the fine-tuning kind (a quantized base is
    another reference) and the compute dtype of the forward."""
    return {
        "rows": {split: rows_sha256(p) for split, p in splits.items()},
        "inputs": {name: entry.get("sha256") for name, entry in inputs.items()},
        "model": cfg.model.model_dump(mode="json"),
        "init_from": cfg.train.init_from,
        "seed": cfg.train.seed,
        "finetune": None if cfg.train.finetune is None else cfg.train.finetune.model_dump(mode="json"),
        "compute_dtype": cfg.train.precision.compute_dtype,
    }


def compute_logps(program: TrainProgram, trainable, frozen, packed: PackedPairs, split: str) -> np.ndarray:
    """Reply log-probs [rows, 2P] (fp32) of every packed row under the model (trainable, frozen), one
    global batch of rows at a time (the last one filled up with repeats of its own last row)."""
    batch_size, n = program.cfg.train.global_batch_size, len(packed)
    out = None
    starts = range(0, n, batch_size)
    for lo in progress(starts, desc=f"reference log-probs ({split})", unit="batch"):
        idx = [min(lo + r, n - 1) for r in range(batch_size)]
        rows = packed.rows(idx)
        batch = {k: global_array(v, program.batch_shardings[k]) for k, v in rows.items()}
        logps = np.asarray(jax.device_get(program.reference_step(trainable, frozen, batch)))
        if out is None:
            out = np.zeros((n, logps.shape[1]), np.float32)
        out[lo : min(lo + batch_size, n)] = logps[: min(batch_size, n - lo)]
    return out


def _load(directory: Path, expected: dict, splits: dict[str, PackedPairs]) -> tuple[dict | None, str]:
    """(the cached arrays by split, "") when the cache in `directory` belongs to `expected`, else
    (None, why not)."""
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
    except (OSError, ValueError) as e:
        return None, f"its manifest cannot be read ({e})"
    recorded = manifest.get("fingerprint") or {}
    for key, value in expected.items():
        if recorded.get(key) != value:
            return None, f"they were computed for another {key.replace('_', ' ')}"
    arrays = {}
    for split, packed in splits.items():
        path, entry = directory / f"{split}.npy", (manifest.get("files") or {}).get(split) or {}
        if not path.is_file() or file_sha256(path) != entry.get("sha256"):
            return None, f"{path.name} is missing or does not match its sha256"
        arrays[split] = np.load(path, allow_pickle=False)
        if arrays[split].shape[0] != len(packed):
            return None, f"{path.name} has {arrays[split].shape[0]} rows, the data {len(packed)}"
    return arrays, ""


def _store(directory: Path, arrays: dict[str, np.ndarray], expected: dict) -> None:
    """The arrays and their manifest into `directory`, atomically (replacing a stale cache)."""
    with atomic_dir(directory, "the reference log-probs", overwrite=True) as tmp:
        files = {}
        for split, a in arrays.items():
            np.save(tmp / f"{split}.npy", a, allow_pickle=False)
            files[split] = {"sha256": file_sha256(tmp / f"{split}.npy"), "shape": list(a.shape)}
        write_json(tmp / "manifest.json", {"fingerprint": expected, "files": files})


def cached_reference(
    program: TrainProgram,
    run_dir: Path,
    inputs: dict,
    splits: dict[str, PackedPairs],
    start: Callable[[], tuple],
    resuming: bool,
    main: bool,
    say: Say,
) -> dict[str, np.ndarray]:
    """Every split's reference log-probs by packed row: reused from <run>/reference_logps on resume
    when they belong to this data and model, else computed with the starting model (`start()`:
    (trainable, frozen)) and stored (by process 0)."""
    directory = run_dir / CACHE_DIR
    expected = fingerprint(program.cfg, inputs, splits)
    if resuming and directory.is_dir():
        arrays, why = _load(directory, expected, splits)
        if arrays is not None:
            say(f"shipyard: reusing the reference log-probs in {directory}")
            return arrays
        say(f"shipyard: --resume: recomputing the reference log-probs in {directory}: {why}")
    trainable, frozen = start()
    arrays = {split: compute_logps(program, trainable, frozen, p, split) for split, p in splits.items()}
    if main:
        _store(directory, arrays, expected)
    rows = sum(len(p) for p in splits.values())
    say(f"shipyard: reference log-probs of {rows} rows computed with the starting model, in {directory}")
    return arrays


def reference_copy(program: TrainProgram, trainable):
    """A copy of the starting trainable tree in the compute dtype, on the params' shardings: the
    on-the-fly reference (a copy, since the train step donates the state that holds the original)."""
    compute = jnp.dtype(program.cfg.train.precision.compute_dtype)
    shardings = jax.tree.map(lambda a: a.sharding, program.abstract_state.params)
    cast = jax.jit(lambda t: jax.tree.map(lambda x: jnp.copy(x.astype(compute)), t), out_shardings=shardings)
    return cast(trainable)
