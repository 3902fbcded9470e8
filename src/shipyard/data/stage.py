"""What every data stage shares: work units, an atomic output directory, a
process pool, a progress bar and the stats JSON.

The input is cut into work units (documents.plan_units: line ranges of big
jsonl files, row groups of parquet files, whole compressed files, groups of
small files). Each worker reads its unit itself, processes it and writes its
own output part, so the main process only plans and collects counts: every
core works, and nothing funnels through one process. Unit sizes depend only on
the input size, and part `i` holds unit `i`'s output, so a stage's output is
byte-identical for any number of workers.

A stage's output directory holds `part-NNNNN.jsonl.zst` (records with id,
source, text: readable by every stage as input) and `stats.json`. It is built
under a temporary name next to the destination and renamed into place only
when complete, so an interrupted stage never leaves a directory that looks
finished. An output URL (`s3://bucket/prefix`) is built in a local staging
directory the same way and then published (`publish_output`): a tag object
first, the files, the `_SUCCESS` marker last, so a reader can tell a prefix
whose upload was cut off from a finished one (`sources.list_url` refuses it).

Workers come from a fork server (`_context`): forking this process directly
could deadlock if it has started JAX or tokenizers' threads.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import shutil
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from shipyard import __version__, storage
from shipyard.data.documents import (
    Document,
    ReadStats,
    Unit,
    check_bad_fraction,
    plan_units,
    read_unit,
)
from shipyard.data.sources import STAGE_TAG
from shipyard.errors import DataError
from shipyard.output import atomic_dir, progress, write_json

BATCH_DOCS = 256
BATCH_BYTES = 4 << 20
MAX_EXAMPLES = 20


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@dataclass
class StageStats:
    """Counts for one stage run; written as stats.json."""

    stage: str
    inputs: list[str]
    config: dict
    workers: int
    documents_in: int = 0
    bytes_in: int = 0
    documents_out: int = 0
    bytes_out: int = 0
    dropped: Counter = field(default_factory=Counter)
    read: ReadStats = field(default_factory=ReadStats)
    extra: dict = field(default_factory=dict)
    examples: list = field(default_factory=list)
    max_examples: int = MAX_EXAMPLES
    started: float = field(default_factory=time.time)

    def add(self, r: dict) -> None:
        """Fold in one unit's result (see document_unit)."""
        self.documents_in += r["documents_in"]
        self.bytes_in += r["bytes_in"]
        self.documents_out += r.get("documents_out", 0)
        self.bytes_out += r.get("bytes_out", 0)
        self.dropped.update(r.get("dropped", {}))
        self.read.merge(r["read"])
        self.examples.extend(r.get("examples", [])[: self.max_examples - len(self.examples)])

    def as_dict(self) -> dict:
        seconds = time.time() - self.started
        return {
            "stage": self.stage,
            "inputs": [storage.redact(i) for i in self.inputs],
            "config": self.config,
            "workers": self.workers,
            "documents_in": self.documents_in,
            "bytes_in": self.bytes_in,
            "documents_out": self.documents_out,
            "bytes_out": self.bytes_out,
            "dropped": dict(sorted(self.dropped.items())),
            "bad_records": dict(sorted(self.read.bad.items())),
            "bad_examples": self.read.examples,
            "examples": self.examples,
            "seconds": round(seconds, 3),
            "mb_per_s": round(self.bytes_in / 1e6 / seconds, 3) if seconds > 0 else None,
            **self.extra,
        }


HINT = "pass --overwrite or choose another --out"


@contextlib.contextmanager
def stage_output(out: str | Path, overwrite: bool, stage: str) -> Iterator[Path]:
    """A local directory to write data stage `stage`'s output into, which becomes `out` when the
    block completes: `output.atomic_dir` for a local `out`; for a URL, a local staging directory
    published to it (`publish_output`). An existing `out` is a data error unless --overwrite."""
    storage.check_scheme(out, f"data {stage} --out")
    if not storage.is_url(out):
        with atomic_dir(
            storage.local(out), f"data {stage}", overwrite=overwrite, hint=HINT, error=DataError
        ) as tmp:
            yield tmp
        return
    url = str(out)
    if not overwrite and output_exists(url):
        raise DataError(f"data {stage}: {storage.redact(url)} already exists; {HINT}")
    staging = Path(tempfile.mkdtemp(prefix=f"shipyard-{stage}-"))
    try:
        with atomic_dir(staging / "out", f"data {stage}", error=DataError) as tmp:
            yield tmp
        publish_output(staging / "out", url, stage)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def output_exists(url: str) -> bool:
    """Whether anything is at output URL `url`: a publication (complete or not) or any object."""
    return storage.is_published(url) or bool(storage.list_files(url)) or storage.exists(url)


def publish_output(local_dir: Path, url: str, stage: str) -> None:
    """Publish a finished stage directory to `url`: the old marker and objects go first, then the
    stage tag (so a reader knows a marker is due), the files, and the marker last. The marker
    lists every file's size and sha256 (tokenizer downloads check them)."""
    files = sorted(p for p in local_dir.rglob("*") if p.is_file())
    listing = {
        p.relative_to(local_dir).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files
    }
    tag = {"stage": stage, "shipyard_version": __version__}
    (local_dir / storage.MARKER).write_text(json.dumps({**tag, "files": listing}, indent=2) + "\n")
    storage.remove(str(storage.join(url, storage.MARKER)))  # before anything else: no reader sees it again
    storage.remove(url)
    storage.write_bytes(str(storage.join(url, STAGE_TAG)), json.dumps(tag).encode())
    storage.publish_dir(local_dir, url, replace=False)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def config_record(read, **sections) -> dict:
    """What a stage records as its config in stats.json (and what `data prepare` compares to skip it)."""
    out = {
        name: (cfg.model_dump(mode="json") if hasattr(cfg, "model_dump") else cfg)
        for name, cfg in sections.items()
    }
    out["read"] = read.model_dump(mode="json")
    return out


class DocWriter:
    """Writes documents to one zstd-compressed jsonl file, opened on the first document."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = self._writer = None
        self.written = False

    def write(self, doc: Document) -> int:
        """Append one document; returns its text's UTF-8 size."""
        if self._writer is None:
            import zstandard

            self._file = open(self.path, "wb")  # noqa: SIM115
            self._writer = zstandard.ZstdCompressor(level=3).stream_writer(self._file, closefd=False)
            self.written = True
        line = json.dumps({"id": doc.id, "source": doc.source, "text": doc.text}, ensure_ascii=False) + "\n"
        self._writer.write(line.encode("utf-8"))
        return len(doc.text.encode("utf-8"))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()  # ends the zstd frame
            self._file.close()
            self._writer = self._file = None


def batches(docs: Iterable[Document], max_docs: int = BATCH_DOCS, max_bytes: int = BATCH_BYTES):
    """Group documents into lists of at most max_docs documents or about max_bytes characters."""
    batch: list[Document] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc.text)
        if len(batch) >= max_docs or size >= max_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def pool_map(
    fn: Callable, items: Iterable, workers: int, initializer: Callable | None = None, initargs: tuple = ()
) -> Iterator:
    """fn over items in input order: in-process for one worker, else a process pool (see _context)."""
    if workers <= 1:
        if initializer is not None:
            initializer(*initargs)
        yield from map(fn, items)
        return
    init = (storage_environment(), initializer, initargs)
    with _context().Pool(workers, initializer=_init_worker, initargs=init) as pool:
        # Not Pool.imap: its feeder thread drains the input as fast as it can.
        # Two items per worker in flight keep every worker busy with bounded memory.
        inflight: deque = deque()
        for item in items:
            inflight.append(pool.apply_async(fn, (item,)))
            if len(inflight) >= 2 * workers:
                yield inflight.popleft().get()
        while inflight:
            yield inflight.popleft().get()


STORAGE_ENV_PREFIXES = ("AWS_", "GOOGLE_", "GCS_", "FSSPEC_")


def storage_environment() -> dict[str, str]:
    """This process's object-storage settings (endpoint, region, credentials) from the environment."""
    return {k: v for k, v in os.environ.items() if k.startswith(STORAGE_ENV_PREFIXES)}


def _init_worker(env: dict[str, str], initializer: Callable | None, initargs: tuple) -> None:
    """A pool worker's setup. The fork server keeps the environment of the moment it started (the
    first pool of this process), so each worker takes the storage settings of now from its parent:
    a stage must reach the same store as the process that planned it. Each worker then builds its
    own fsspec client on first use (no client crosses a fork)."""
    for k in [k for k in os.environ if k.startswith(STORAGE_ENV_PREFIXES) and k not in env]:
        del os.environ[k]
    os.environ.update(env)
    if initializer is not None:
        initializer(*initargs)


# Imported once by the fork server; each pool's workers are then forked from it
# in milliseconds instead of paying ~0.5 s of imports per pool (per stage).
_PRELOAD = [
    "shipyard.data.stage",
    "shipyard.data.extract",
    "shipyard.data.filters",
    "shipyard.data.dedup",
    "shipyard.data.decontaminate",
    "shipyard.data.tokenize",
]


def _context():
    """forkserver where the platform has it (a fresh server process: safe even when this one runs
    JAX or tokenizers threads, which plain fork is not), else spawn."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def progress_bytes(stage: str, total_bytes: int):
    """A bar over input bytes (rate in MB/s, ETA)."""
    return progress(desc=stage, unit="B", total=total_bytes, unit_scale=True, unit_divisor=1000)


def plan(inputs: list[str]) -> list[Unit]:
    """Validate the input paths now (a missing one fails before any work) and cut them into units."""
    if not inputs:
        raise DataError("no inputs given (expected files or directories of documents)")
    units = plan_units(inputs)  # lists each input once (a bucket prefix: one listing, no HEAD per object)
    if not units:
        shown = ", ".join(storage.redact(i) for i in inputs)
        raise DataError(f"inputs {shown}: no readable document files found")
    return units


def run_units(
    stage: str,
    units: list[Unit],
    fn: Callable,
    items: Iterable,
    workers: int,
    initializer: Callable | None = None,
    initargs: tuple = (),
) -> Iterator:
    """fn over per-unit items with a progress bar advanced by each unit's input size."""
    with progress_bytes(stage, sum(u.size for u in units)) as bar:
        for unit, result in zip(units, pool_map(fn, items, workers, initializer, initargs)):
            bar.update(unit.size)
            yield result


def part_name(index: int) -> str:
    return f"part-{index:05d}.jsonl.zst"


def document_unit(item: tuple) -> dict:
    """Worker: read one unit, run the stage's batch function, write the kept documents as part `index`."""
    index, unit, out_dir, text_field, batch_fn = item
    read = ReadStats()
    writer = DocWriter(Path(out_dir) / part_name(index))
    r = {
        "documents_in": 0,
        "bytes_in": 0,
        "documents_out": 0,
        "bytes_out": 0,
        "dropped": Counter(),
        "examples": [],
    }
    try:
        for batch in batches(read_unit(unit, read, text_field)):
            kept, drops, examples = batch_fn(batch)
            r["documents_in"] += len(batch)
            r["dropped"].update(drops)
            r["examples"].extend(examples)  # each batch bounds its own; StageStats keeps the first few
            for doc in kept:
                r["bytes_out"] += writer.write(doc)
            r["documents_out"] += len(kept)
    finally:
        writer.close()
    r["bytes_in"] = read.bytes
    r["read"] = read
    r["part"] = part_name(index) if writer.written else None
    return r


def run_document_stage(
    stage: str,
    inputs: list[str],
    out: Path,
    cfg,
    read,
    worker: Callable[[list[Document]], tuple[list[Document], Counter, list[dict]]],
    *,
    workers: int,
    overwrite: bool,
    initializer: Callable | None = None,
    initargs: tuple = (),
    max_examples: int = MAX_EXAMPLES,
    postprocess: Callable[[dict], None] | None = None,
) -> dict:
    """Documents in, a subset (possibly transformed) out.

    `worker` maps a batch to (kept documents, drop counts by reason, examples
    worth showing a person); it runs in the worker processes, configured by
    `initializer(*initargs)`. `postprocess` may add to the stats before they
    are written. `cfg` (the stage's settings) and `read` are recorded in
    stats.json under the stage's name, as `data prepare` compares them.
    """
    inputs = [str(p) for p in inputs]
    units = plan(inputs)
    stats = StageStats(stage, inputs, config_record(read, **{stage: cfg}), workers, max_examples=max_examples)
    text_field = read.text_field
    with stage_output(out, overwrite, stage) as tmp:
        items = ((i, u, str(tmp), text_field, worker) for i, u in enumerate(units))
        parts = []
        for r in run_units(stage, units, document_unit, items, workers, initializer, initargs):
            stats.add(r)
            if r["part"]:
                parts.append(r["part"])
        check_bad_fraction(stats.read, read.max_bad_fraction, f"data {stage}")
        result = stats.as_dict()
        result["parts"] = parts
        if postprocess is not None:
            postprocess(result)
        write_json(tmp / "stats.json", result)
    return result
