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
could deadlock if it has started JAX or tokenizers' threads. Given a
`cluster.RayCluster` instead of a worker count, a stage runs its units as Ray
tasks on that cluster (cluster.py) with the same outputs; a URL output then
gets its parts uploaded by the tasks themselves (`StageDir.parts`), so no
node needs the driver's disk. So does a resumable stage's (one given a
`resume.header`) on any workers: its parts and journal live in the unpublished
prefix, where a rerun finds them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from shipyard import __version__, storage
from shipyard.data import resume
from shipyard.data.cluster import RayCluster, count_nodes, ray_map
from shipyard.data.documents import (
    FILE_SUFFIXES,
    Document,
    ReadStats,
    Unit,
    check_bad_fraction,
    plan_units,
    read_unit,
)
from shipyard.data.hashcache import file_sha256
from shipyard.data.resume import RESUME, Journal, header, intact, open_partial
from shipyard.data.sources import STAGE_TAG
from shipyard.errors import DataError, ShipyardError
from shipyard.output import atomic_dir, progress, refuse_existing, write_json

BATCH_DOCS = 256
BATCH_BYTES = 4 << 20
MAX_EXAMPLES = 20


Workers = int | RayCluster
"""Where a stage's units run: this many local processes, or the tasks of a Ray cluster."""


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def step_workers() -> Workers:
    """Where a pipeline step's units run: as tasks of the Ray cluster this process is a task of
    (`shipyard run --ray` runs each step as one), else on every local core."""
    import sys

    ray = sys.modules.get("ray")  # never imported here unless something already uses Ray
    if ray is not None and ray.is_initialized():
        return RayCluster("auto")
    return default_workers()


def in_process(workers: Workers) -> bool:
    """Whether the units run in this very process (one local worker)."""
    return isinstance(workers, int) and workers <= 1


def describe_workers(workers: Workers) -> int | str:
    """stats.json's `workers`: the process count, or the Ray address (a host field: the output does
    not depend on it)."""
    return f"ray {workers.address}" if isinstance(workers, RayCluster) else workers


@dataclass
class StageStats:
    """Counts for one stage run; written as stats.json."""

    stage: str
    inputs: list[str]
    config: dict
    workers: Workers
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

    def as_dict(self, nodes: Counter | None = None) -> dict:
        """stats.json; given `nodes` (`StageDir.nodes`: a Ray run's tasks by node), also `ray_nodes` (the
        ids of the nodes the tasks ran on, sorted) and `ray_tasks` (how many ran on each)."""
        seconds = time.time() - self.started
        ran_on = {}
        if nodes is not None:  # a Ray run: where its tasks ran
            ran_on = {"ray_nodes": sorted(nodes), "ray_tasks": dict(sorted(nodes.items()))}
        return {
            "stage": self.stage,
            "inputs": [storage.redact(i) for i in self.inputs],
            "config": self.config,
            "workers": describe_workers(self.workers),
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
            **ran_on,
            **self.extra,
        }


HINT = "pass --overwrite or choose another --out"


@dataclass
class StageDir:
    """Where a running stage writes: `local` (a directory here) and `parts`, where unit workers write
    their parts: `local` itself (absolute, so a Ray task on another node of a shared filesystem finds
    it), or for a URL output run on a Ray cluster the URL, which the tasks upload to directly."""

    local: Path
    parts: str
    uploaded: dict[str, dict] = field(default_factory=dict)
    """Parts the workers uploaded to `parts` (a URL): name -> {bytes, sha256}, for the marker."""
    resumable: bool = False
    """Whether `local` is a partial output whose finished units are journaled (resume.py)."""
    nodes: Counter | None = None
    """On a Ray cluster: the stage's tasks so far by the id of the node each ran on (`cluster.count_nodes`);
    None on local workers."""

    def journal(self, name: str = "units") -> Journal | None:
        """The journal of pass `name` (for `run_units`), or None when this output is not resumable;
        it lives where the parts go (`parts`: the partial directory, or the output URL)."""
        return Journal(self.parts, name) if self.resumable else None

    def add(self, result: dict) -> None:
        """Note a unit's uploaded part (its result's `uploaded` entry)."""
        self.uploaded.update(result.get("uploaded") or {})


@contextlib.contextmanager
def stage_output(
    out: str | Path, overwrite: bool, stage: str, workers: Workers = 1, run: dict | None = None
) -> Iterator[StageDir]:
    """Where to write data stage `stage`'s output; it becomes `out` when the block completes:
    `output.atomic_dir` for a local `out`; for a URL, a local staging directory published to it
    (`publish_output`). With a Ray cluster and a URL, the parts go straight to the URL from the
    tasks: the old marker and objects are removed and the stage tag written first (a reader then
    refuses the prefix until the marker comes, last). An existing `out` is a data error unless
    --overwrite. Given `run` (a `resume.header`), a local `out` is built in a partial directory
    that a rerun of the same run resumes (resume.py). With a Ray cluster, the StageDir's `nodes` counts
    the block's tasks by the node each ran on (for `StageStats.as_dict`)."""
    with _output_dir(out, overwrite, stage, workers, run) as dest:
        if not isinstance(workers, RayCluster):
            yield dest
            return
        with count_nodes() as nodes:
            dest.nodes = nodes
            yield dest


@contextlib.contextmanager
def _output_dir(out: str | Path, overwrite: bool, stage: str, workers: Workers, run: dict | None):
    """`stage_output`'s directory (or staging directory and URL)."""
    storage.check_scheme(out, f"data {stage} --out")
    if not storage.is_url(out) and run is not None:
        with resumable_dir(storage.local(out), f"data {stage}", overwrite, run) as tmp:
            yield StageDir(tmp, str(tmp.resolve()), resumable=True)
        return
    if not storage.is_url(out):
        with atomic_dir(
            storage.local(out), f"data {stage}", overwrite=overwrite, hint=HINT, error=DataError
        ) as tmp:
            yield StageDir(tmp, str(tmp.resolve()))
        return
    url = str(out)
    what = f"data {stage}"
    # a resumable run's parts, scratch and journal go to the URL itself, from the tasks (resume.py)
    remote_parts = isinstance(workers, RayCluster) or run is not None
    resuming = run is not None and resume.open_remote(url, run, overwrite, what)
    if not resuming:
        if not overwrite and output_exists(url):
            raise DataError(f"{what}: {storage.redact(url)} already exists; {HINT}")
        if remote_parts:
            unpublish(url, stage)
        if run is not None:
            resume.start_remote(url, run)
    staging = Path(tempfile.mkdtemp(prefix=f"shipyard-{stage}-"))
    try:
        with atomic_dir(staging / "out", what, error=DataError) as tmp:
            dest = StageDir(tmp, url if remote_parts else str(tmp), resumable=run is not None)
            try:
                yield dest
            except ShipyardError:
                if run is not None:  # bad input or settings: a rerun changes something; start it afresh
                    # best effort: the store may be what failed, and that error is the one to show
                    with contextlib.suppress(storage.StorageError):
                        storage.remove(url, retry=storage.Retry(attempts=1))
                raise
        if run is not None:
            storage.remove(str(storage.join(url, RESUME)))
        publish_output(staging / "out", url, stage, dest.uploaded if remote_parts else None)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def resumable_dir(out: Path, what: str, overwrite: bool, run: dict) -> Iterator[Path]:
    """`output.atomic_dir`, but built in `resume.partial_dir(out)`: kept when the run is cut off
    (killed, interrupted, a crash) so the next one resumes it; removed on a data error (bad input
    or settings: a rerun must change something anyway)."""
    if not overwrite:
        refuse_existing(out, what, hint=HINT, error=DataError)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = open_partial(out, run, overwrite, what)
    try:
        yield partial
    except ShipyardError:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    shutil.rmtree(partial / RESUME)
    if out.exists():
        shutil.rmtree(out)
    os.replace(partial, out)


def output_exists(url: str) -> bool:
    """Whether anything is at output URL `url`: a publication (complete or not) or any object."""
    return storage.is_published(url) or bool(storage.list_files(url)) or storage.exists(url)


def publish_output(local_dir: Path, url: str, stage: str, uploaded: dict[str, dict] | None = None) -> None:
    """Publish a finished stage directory to `url`: the old marker and objects go first, then the
    stage tag (so a reader knows a marker is due), the files, and the marker last. The marker
    lists every file's size and sha256 (tokenizer downloads check them). `uploaded`: parts Ray
    tasks already put at `url` (after `unpublish`), listed in the marker and kept."""
    files = sorted(p for p in local_dir.rglob("*") if p.is_file())
    listing = {
        p.relative_to(local_dir).as_posix(): {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
        for p in files
    }
    listing = dict(sorted({**listing, **(uploaded or {})}.items()))
    tag = {"stage": stage, "shipyard_version": __version__}
    (local_dir / storage.MARKER).write_text(json.dumps({**tag, "files": listing}, indent=2) + "\n")
    if uploaded is None:
        unpublish(url, stage)
    storage.publish_dir(local_dir, url, replace=False)


def unpublish(url: str, stage: str) -> None:
    """Make `url` an unfinished output of `stage`: the marker first (no reader sees it again), every
    other object, then the stage tag (a reader then knows a marker is due and refuses the prefix)."""
    storage.remove(str(storage.join(url, storage.MARKER)))
    storage.remove(url)
    tag = {"stage": stage, "shipyard_version": __version__}
    storage.write_bytes(str(storage.join(url, STAGE_TAG)), json.dumps(tag).encode())


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
        # written beside and renamed on close: a reader (or a rerun after this process was killed)
        # never takes a part cut short for a whole one
        self._partial = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        self._file = self._writer = None
        self.written = False

    @classmethod
    def part(cls, dest: str, index: int) -> DocWriter:
        """A writer of part `index` for `dest` (see `part_path`)."""
        return cls(part_path(dest, index))

    def write(self, doc: Document) -> int:
        """Append one document; returns its text's UTF-8 size."""
        if self._writer is None:
            import zstandard

            self._file = open(self._partial, "wb")  # noqa: SIM115
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
            os.replace(self._partial, self.path)


def part_path(dest: str, index: int) -> Path:
    """Where a unit worker writes part `index` of a stage writing to `dest` (`StageDir.parts`): in
    the directory `dest`, or for a URL in a temporary directory of its own (`publish_part` uploads it)."""
    if storage.is_url(dest):
        return Path(tempfile.mkdtemp(prefix="shipyard-part-")) / part_name(index)
    return Path(dest) / part_name(index)


def publish_part(path: Path, written: bool, dest: str) -> dict:
    """After a unit's part at `path` (from `part_path`) is closed: the unit result's `part` (its name,
    or None when it kept nothing) and, for a URL `dest`, `uploaded` ({name: {bytes, sha256}}): the
    part is put there whole (one object PUT: a retried unit replaces it with the same bytes), and
    the local copy removed."""
    name = path.name if written else None
    if not storage.is_url(dest):
        return {"part": name, "files": {name: file_sha256(path)} if name else {}}
    try:
        if name is None:
            return {"part": None, "uploaded": {}}
        data = path.read_bytes()
        storage.write_bytes(str(storage.join(dest, name)), data)
        digest = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        return {"part": name, "uploaded": {name: digest}, "files": {name: digest["sha256"]}}
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)


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
    fn: Callable, items: Iterable, workers: Workers, initializer: Callable | None = None, initargs: tuple = ()
) -> Iterator:
    """fn over items in input order: in-process for one worker, a process pool (see _context), or the
    tasks of a Ray cluster (cluster.ray_map)."""
    if isinstance(workers, RayCluster):
        yield from ray_map(fn, items, workers, storage.environment(), initializer, initargs)
        return
    if isinstance(workers, LocalPool):
        if initializer not in (None, workers.initializer):
            raise ValueError("a shared pool's workers ran another initializer (open_pool)")
        yield from _in_order(workers.pool, fn, items, workers.size)
        return
    if workers <= 1:
        if initializer is not None:
            initializer(*initargs)
        yield from map(fn, items)
        return
    with open_pool(workers, initializer, initargs) as opened:
        yield from _in_order(opened.pool, fn, items, workers)


@dataclass(frozen=True)
class LocalPool:
    """A process pool a stage opened once for all of its steps (`open_pool`); passed where a
    `Workers` goes."""

    pool: object
    """The multiprocessing pool."""
    size: int
    """Its worker processes."""
    initializer: Callable | None
    """What each worker ran when it started (a step asking for another is a bug)."""


@contextlib.contextmanager
def open_pool(workers: Workers, initializer: Callable | None = None, initargs: tuple = ()) -> Iterator:
    """For a stage of several steps (dedup's shuffles, tokenize's shards): one pool for them all
    (starting a pool per step costs a few tenths of a second each), its workers set up by
    `initializer(*initargs)`; one worker or a Ray cluster comes back as it is."""
    if isinstance(workers, (RayCluster, LocalPool)) or workers <= 1:
        yield workers
        return
    init = (storage.environment(), initializer, initargs)
    with _context().Pool(workers, initializer=_init_worker, initargs=init) as pool:
        yield LocalPool(pool, workers, initializer)


def _in_order(pool, fn: Callable, items: Iterable, workers: int) -> Iterator:
    # Not Pool.imap: its feeder thread drains the input as fast as it can.
    # Two items per worker in flight keep every worker busy with bounded memory.
    inflight: deque = deque()
    for item in items:
        inflight.append(pool.apply_async(fn, (item,)))
        if len(inflight) >= 2 * workers:
            yield inflight.popleft().get()
    while inflight:
        yield inflight.popleft().get()


def _init_worker(env: dict[str, str], initializer: Callable | None, initargs: tuple) -> None:
    """A pool worker's setup. The fork server keeps the environment of the moment it started (the
    first pool of this process), so each worker takes the storage settings of now from its parent:
    a stage must reach the same store as the process that planned it. Each worker then builds its
    own fsspec client on first use (no client crosses a fork)."""
    storage.apply_environment(env)
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
        raise DataError(
            f"inputs {shown}: no readable document files found (expected files named "
            f"*{', *'.join(FILE_SUFFIXES)}; other files in a directory are skipped)"
        )
    return units


def run_units(
    stage: str,
    units: list[Unit],
    fn: Callable,
    items: Iterable,
    workers: Workers,
    initializer: Callable | None = None,
    initargs: tuple = (),
    journal: Journal | None = None,
) -> Iterator:
    """fn over per-unit items with a progress bar advanced by each unit's input size. With a
    `journal` (`StageDir.journal`), units a cut-off earlier run finished are not run again: their
    recorded results come back in their place, and each new result is recorded."""
    items = list(items)
    done = finished(journal, len(items), workers, stage)
    todo = [item for i, item in enumerate(items) if i not in done]
    fresh = pool_map(fn, todo, workers, initializer, initargs)
    with progress_bytes(stage, sum(u.size for u in units)) as bar:
        for i, unit in enumerate(units):
            if i in done:
                result = done[i]
            else:
                result = next(fresh)
                if journal is not None:
                    journal.record(i, result)
            bar.update(unit.size)
            yield result


def run_tasks(desc: str, fn: Callable, items: list, workers: Workers, journal: Journal | None = None) -> list:
    """fn over `items` (tasks that are not input units: a shuffle's partitions) with a bar counting
    tasks; the results in item order. With a `journal`, as `run_units`: the tasks a cut-off earlier
    run finished (their results' `files` all there with their digests) are not run again."""
    done = finished(journal, len(items), workers, desc)
    fresh = pool_map(fn, [item for i, item in enumerate(items) if i not in done], workers)
    with progress(desc=desc, unit="task", total=len(items)) as bar:
        results = []
        for i in range(len(items)):
            if i in done:
                r = done[i]
            else:
                r = next(fresh)
                if journal is not None:
                    journal.record(i, r)
            bar.update(1)
            results.append(r)
        return results


def finished(journal: Journal | None, count: int, workers: Workers, desc: str) -> dict[int, dict]:
    """The results of the first `count` units or tasks that `journal` holds as finished, their files
    verified by the stage's workers; says so when there are any."""
    if journal is None:
        return {}
    done = journal.finished(count, lambda checks: pool_map(intact, checks, workers))
    if done:
        print(f"data {desc}: resuming: {len(done)} of {count} units already done", file=sys.stderr)
    return done


def part_name(index: int) -> str:
    return f"part-{index:05d}.jsonl.zst"


def document_unit(item: tuple) -> dict:
    """Worker: read one unit, run the stage's batch function, write the kept documents as part `index`."""
    index, unit, out_dir, text_field, batch_fn = item
    read = ReadStats()
    writer = DocWriter.part(out_dir, index)
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
    r.update(publish_part(writer.path, writer.written, out_dir))
    return r


def run_document_stage(
    stage: str,
    inputs: list[str],
    out: Path,
    cfg,
    read,
    worker: Callable[[list[Document]], tuple[list[Document], Counter, list[dict]]],
    *,
    workers: Workers,
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
    run = header(stage, [storage.redact(i) for i in inputs], stats.config, units)
    with stage_output(out, overwrite, stage, workers, run) as dest:
        tmp = dest.local
        items = ((i, u, dest.parts, text_field, worker) for i, u in enumerate(units))
        parts = []
        journal = dest.journal()
        for r in run_units(stage, units, document_unit, items, workers, initializer, initargs, journal):
            stats.add(r)
            dest.add(r)
            if r["part"]:
                parts.append(r["part"])
        check_bad_fraction(stats.read, read.max_bad_fraction, f"data {stage}")
        result = stats.as_dict(dest.nodes)
        result["parts"] = parts
        if postprocess is not None:
            postprocess(result)
        write_json(tmp / "stats.json", result)
    return result
