"""What every data stage shares: an atomic output directory, document parts,
a process pool over document batches, a progress bar and the stats JSON.

A stage's output directory holds `part-NNNNN.jsonl.zst` (records with id,
source, text: readable by every stage as input) and `stats.json`. It is built
under a temporary name next to the destination and renamed into place only
when complete, so an interrupted stage never leaves a directory that looks
finished.

Work is spread over processes in batches of documents; results come back in
input order (`Pool.imap`), so a stage's output is the same for any number of
workers. The pool uses `spawn`: forking a process that has started JAX or
tokenizers' threads can deadlock.
"""

from __future__ import annotations

import contextlib
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

from tqdm import tqdm

from shipyard.data.documents import Document, ReadStats, check_bad_fraction, expand_inputs, read_documents
from shipyard.errors import DataError

PART_BYTES = 256 << 20  # uncompressed text per output part
BATCH_DOCS = 256
BATCH_BYTES = 4 << 20


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
    extra: dict = field(default_factory=dict)
    examples: list = field(default_factory=list)
    started: float = field(default_factory=time.time)

    def as_dict(self, read: ReadStats) -> dict:
        seconds = time.time() - self.started
        return {
            "stage": self.stage,
            "inputs": self.inputs,
            "config": self.config,
            "workers": self.workers,
            "documents_in": self.documents_in,
            "bytes_in": self.bytes_in,
            "documents_out": self.documents_out,
            "bytes_out": self.bytes_out,
            "dropped": dict(sorted(self.dropped.items())),
            "bad_records": dict(sorted(read.bad.items())),
            "bad_examples": read.examples,
            "examples": self.examples,
            "seconds": round(seconds, 3),
            "mb_per_s": round(self.bytes_in / 1e6 / seconds, 3) if seconds > 0 else None,
            **self.extra,
        }


@contextlib.contextmanager
def stage_output(out: Path, overwrite: bool, stage: str) -> Iterator[Path]:
    """Yield a temporary directory that becomes `out` when the block completes without error."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise DataError(f"data {stage}: {out} already exists; pass --overwrite or choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def config_record(read, **sections) -> dict:
    """What a stage records as its config in stats.json (and what `data prepare` compares to skip it)."""
    out = {
        name: (cfg.model_dump(mode="json") if hasattr(cfg, "model_dump") else cfg)
        for name, cfg in sections.items()
    }
    out["read"] = read.model_dump(mode="json")
    return out


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


class DocWriter:
    """Writes documents as zstd-compressed jsonl parts of about PART_BYTES each."""

    def __init__(self, out_dir: Path, part_bytes: int = PART_BYTES):
        self.out_dir, self.part_bytes = Path(out_dir), part_bytes
        self.parts: list[str] = []
        self._file = self._writer = None
        self._bytes = 0

    def _open(self) -> None:
        import zstandard

        name = f"part-{len(self.parts):05d}.jsonl.zst"
        self.parts.append(name)
        self._file = open(self.out_dir / name, "wb")  # noqa: SIM115
        self._writer = zstandard.ZstdCompressor(level=3).stream_writer(self._file, closefd=False)
        self._bytes = 0

    def write(self, doc: Document) -> int:
        """Append one document; returns its text's UTF-8 size."""
        if self._writer is None or self._bytes >= self.part_bytes:
            self.close()
            self._open()
        line = json.dumps({"id": doc.id, "source": doc.source, "text": doc.text}, ensure_ascii=False) + "\n"
        self._writer.write(line.encode("utf-8"))
        n = len(doc.text.encode("utf-8"))
        self._bytes += n
        return n

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
    """fn over items in input order: in-process for one worker, else a spawn process pool."""
    if workers <= 1:
        if initializer is not None:
            initializer(*initargs)
        yield from map(fn, items)
        return
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=initializer, initargs=initargs) as pool:
        # Not Pool.imap: its feeder thread drains the input as fast as it can,
        # which would pull a whole corpus into memory. Two batches per worker
        # in flight keep every worker busy with bounded memory.
        inflight: deque = deque()
        for item in items:
            inflight.append(pool.apply_async(fn, (item,)))
            if len(inflight) >= 2 * workers:
                yield inflight.popleft().get()
        while inflight:
            yield inflight.popleft().get()


def known_document_count(inputs: Iterable[str | Path]) -> int | None:
    """Total documents when every input is a stage output with stats.json, else None (no ETA then)."""
    total = 0
    for item in inputs:
        stats = Path(item) / "stats.json"
        if not stats.is_file():
            return None
        try:
            total += int(json.loads(stats.read_text())["documents_out"])
        except (ValueError, KeyError, TypeError):
            return None
    return total


def progress(stage: str, inputs: Iterable[str | Path]) -> tqdm:
    """A documents progress bar with rate, ETA when the count is known, and MB/s."""
    return tqdm(
        total=known_document_count(inputs),
        desc=stage,
        unit="doc",
        unit_scale=True,
        dynamic_ncols=True,
        disable=None if sys.stderr.isatty() else True,
        mininterval=0.5,
    )


def read_inputs(inputs: list[str], text_field: str) -> tuple[ReadStats, Iterator[Document]]:
    """Validate the input paths now (a missing one fails before any work) and stream their documents."""
    if not inputs:
        raise DataError("no inputs given (expected files or directories of documents)")
    if not expand_inputs(inputs):
        raise DataError(f"inputs {', '.join(inputs)}: no readable document files found")
    read = ReadStats()
    return read, read_documents(inputs, read, text_field)


def run_document_stage(
    stage: str,
    inputs: list[str],
    out: Path,
    config: dict,
    worker: Callable[[list[Document]], tuple[list[Document], Counter, list[dict]]],
    *,
    workers: int,
    text_field: str,
    max_bad_fraction: float,
    overwrite: bool,
    initializer: Callable | None = None,
    initargs: tuple = (),
    max_examples: int = 20,
    postprocess: Callable[[dict], None] | None = None,
) -> dict:
    """Documents in, a subset (possibly transformed) out.

    `worker` maps a batch to (kept documents, drop counts by reason, examples
    worth showing a person); `postprocess` may add to the stats before they
    are written.
    """
    inputs = [str(p) for p in inputs]
    read, docs = read_inputs(inputs, text_field)
    stats = StageStats(stage, inputs, config, workers)
    with stage_output(out, overwrite, stage) as tmp:
        writer = DocWriter(tmp)
        bar = progress(stage, inputs)
        try:
            for batch_in, (kept, drops, examples) in zip_in_out(docs, worker, workers, initializer, initargs):
                stats.examples.extend(examples[: max_examples - len(stats.examples)])
                stats.documents_in += len(batch_in)
                stats.bytes_in += sum(len(d.text.encode("utf-8")) for d in batch_in)
                stats.dropped.update(drops)
                for doc in kept:
                    stats.bytes_out += writer.write(doc)
                stats.documents_out += len(kept)
                bar.update(len(batch_in))
                bar.set_postfix(kept=f"{stats.documents_out / max(stats.documents_in, 1):.0%}", refresh=False)
        finally:
            writer.close()
            bar.close()
        check_bad_fraction(read, max_bad_fraction, f"data {stage}")
        result = stats.as_dict(read)
        result["parts"] = writer.parts
        if postprocess is not None:
            postprocess(result)
        write_json(tmp / "stats.json", result)
    return result


def zip_in_out(docs, worker, workers, initializer, initargs):
    """Pairs (input batch, worker result), keeping only a bounded number of batches alive."""
    pending: deque[list[Document]] = deque()

    def feed():
        for batch in batches(docs):
            pending.append(batch)
            yield batch

    for result in pool_map(worker, feed(), workers, initializer, initargs):
        yield pending.popleft(), result
