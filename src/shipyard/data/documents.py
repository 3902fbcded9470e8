"""Reading raw documents from jsonl (.gz/.zst), parquet, txt and html, streamed.

Every document keeps an id (`<file>:<line>` or `<file>#<row>`) and its
source file. Nothing is read whole into memory: jsonl is decompressed and
parsed line by line, parquet in record batches.

Bad records are not fatal one by one: a corrupt JSON line, invalid UTF-8, a
missing or non-string text field, a binary or empty file, a truncated
.gz/.zst/parquet file are each counted in `ReadStats` with file and line and
skipped. `check_bad_fraction` fails the stage with one line when more than a
configured fraction of records was bad.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from shipyard.data.sources import Location, as_location, list_url, name_of, open_binary, shown, size_of
from shipyard.errors import DataError

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
FILE_SUFFIXES = (*JSONL_SUFFIXES, ".parquet", ".txt", ".html", ".htm")
MAX_EXAMPLES = 20  # bad-record examples kept per run for the stats JSON


@dataclass(frozen=True)
class Document:
    id: str
    """Stable id: the record's `id` field when it has one, else `<file>:<line>` (jsonl), `<file>#<row>` (parquet) or the file path (txt, html)."""
    text: str
    """The document's text (raw HTML for .html files; extraction is a later stage)."""
    source: str
    """The file it came from (the record's `source` field when it has one, so it survives stages)."""


@dataclass
class ReadStats:
    """Counts for one reading pass: kept documents, bad records per reason, examples."""

    documents: int = 0
    bytes: int = 0
    bad: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)

    def reject(self, where: str, reason: str) -> None:
        self.bad[reason] = self.bad.get(reason, 0) + 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{where}: {reason}")

    @property
    def bad_total(self) -> int:
        return sum(self.bad.values())

    def merge(self, other: ReadStats) -> None:
        """Add another pass's counts (workers each read their own units)."""
        self.documents += other.documents
        self.bytes += other.bytes
        for reason, n in other.bad.items():
            self.bad[reason] = self.bad.get(reason, 0) + n
        self.examples.extend(other.examples[: MAX_EXAMPLES - len(self.examples)])


def expand_inputs(inputs: Iterable[str | Path]) -> list[Location]:
    """Files named directly, plus the readable files under named directories (sorted, so order is
    stable); a URL is an object or a prefix walked like a directory (see `sources.list_url`)."""
    out: list[Location] = []
    for item in inputs:
        path = as_location(item)
        if isinstance(path, str):
            out.extend(list_url(path, FILE_SUFFIXES))
        elif path.is_dir():
            out.extend(sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(FILE_SUFFIXES)))
        elif path.is_file():
            if not path.name.endswith(FILE_SUFFIXES):
                raise DataError(
                    f"input {path}: unsupported file type (expected one of {', '.join(FILE_SUFFIXES)})"
                )
            out.append(path)
        else:
            raise DataError(f"input {path}: no such file or directory")
    return out


def _zstd_lines(path: Location) -> Iterator[bytes]:
    """Lines of a .zst file; EOFError if the last frame is cut off.

    zstandard's stream reader ends quietly at a truncated frame, so frames
    are decoded by hand to tell "complete" from "cut short" (and a partial
    last line is never handed out as a record).
    """
    import zstandard

    pending = b""
    dobj = zstandard.ZstdDecompressor().decompressobj()
    with open_binary(path) as f:
        while chunk := f.read(1 << 20):
            while chunk:
                if dobj.eof:  # the previous frame is complete: this data starts the next one
                    dobj = zstandard.ZstdDecompressor().decompressobj()
                out = dobj.decompress(chunk)
                chunk = dobj.unused_data if dobj.eof else b""
                *lines, pending = (pending + out).split(b"\n")
                for line in lines:
                    yield line + b"\n"
    if not dobj.eof:
        raise EOFError("zstd stream ends inside a frame")
    if pending:
        yield pending


def _gzip_lines(path: Location) -> Iterator[bytes]:
    with open_binary(path) as raw, gzip.open(raw, "rb") as f:
        yield from f


def _open_lines(path: Location):
    """Context manager yielding an iterator of raw lines (decoded one by one, so bad UTF-8 stays local)."""
    if name_of(path).endswith(".gz"):
        return contextlib.closing(_gzip_lines(path))
    if name_of(path).endswith(".zst"):
        return contextlib.closing(_zstd_lines(path))
    return open_binary(path)


def _zstd_error() -> type[Exception]:
    import zstandard

    return zstandard.ZstdError


def _range_lines(path: Location, start: int, end: int):
    """Lines of a plain file from byte `start` (a line start) up to `end` (a line start, or -1 for EOF)."""
    with open_binary(path) as f:
        f.seek(start)
        pos = start
        for line in f:
            if end >= 0 and pos >= end:
                return
            pos += len(line)
            yield line


def _read_jsonl(
    path: Location, text_field: str, stats: ReadStats, unit: Unit | None = None
) -> Iterator[Document]:
    first = unit.first_line if unit else 1
    lineno = first - 1
    try:
        raw_cm = (
            contextlib.closing(_range_lines(path, unit.start, unit.end))
            if unit is not None and unit.kind == "jsonl_range"
            else _open_lines(path)
        )
        with raw_cm as raw:
            for lineno, line in enumerate(raw, first):
                if not line.strip():
                    continue
                where = f"{shown(path)}:{lineno}"
                try:
                    record = json.loads(line.decode("utf-8"))
                except UnicodeDecodeError:
                    stats.reject(where, "invalid UTF-8")
                    continue
                except json.JSONDecodeError:
                    stats.reject(where, "not valid JSON")
                    continue
                text = record.get(text_field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    stats.reject(where, f"missing or non-string field {text_field!r}")
                    continue
                # Stage outputs carry the original id and source along; raw
                # files without them get their position as the id.
                doc_id, source = record.get("id"), record.get("source")
                yield Document(
                    id=doc_id if isinstance(doc_id, str) else where,
                    text=text,
                    source=source if isinstance(source, str) else shown(path),
                )
    except (FileNotFoundError, PermissionError) as e:  # not a bad record: the file is not there for us
        raise unreadable_input(path, e) from None
    except (EOFError, OSError, zlib.error, _zstd_error()) as e:  # a cut-off or corrupt compressed stream
        stats.reject(f"{shown(path)}:{lineno + 1}", f"truncated or corrupt stream ({type(e).__name__})")


def _read_parquet(
    path: Location, text_field: str, stats: ReadStats, unit: Unit | None = None
) -> Iterator[Document]:
    with open_binary(path) as f:
        yield from _parquet_rows(f, shown(path), text_field, stats, unit)


def _parquet_rows(f, path: str, text_field: str, stats: ReadStats, unit: Unit | None) -> Iterator[Document]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(f)
    except (FileNotFoundError, PermissionError) as e:
        raise unreadable_input(path, e) from None
    except (pa.ArrowException, OSError) as e:
        stats.reject(path, f"unreadable parquet ({type(e).__name__})")
        return
    if text_field not in pf.schema_arrow.names:
        if unit is None or unit.start == 0:  # reported once per file, not once per row group
            stats.reject(path, f"missing column {text_field!r}")
        return
    groups = None
    row = 0
    if unit is not None and unit.kind == "parquet_groups":
        groups = list(range(unit.start, unit.end))
        row = unit.first_line
    try:
        for batch in pf.iter_batches(columns=[text_field], batch_size=1024, row_groups=groups):
            for text in batch.column(0).to_pylist():
                if isinstance(text, str):
                    yield Document(id=f"{path}#{row}", text=text, source=path)
                else:
                    stats.reject(f"{path}#{row}", f"missing or non-string field {text_field!r}")
                row += 1
    except (pa.ArrowException, OSError) as e:
        stats.reject(f"{path}#{row}", f"truncated or corrupt parquet ({type(e).__name__})")


def _read_whole(path: Location, stats: ReadStats) -> Iterator[Document]:
    with open_binary(path) as f:
        data = f.read()
    where = shown(path)
    if not data.strip():
        stats.reject(where, "empty file")
        return
    if b"\x00" in data[:8192]:
        stats.reject(where, "binary file")
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        stats.reject(where, "invalid UTF-8")
        return
    yield Document(id=where, text=text, source=where)


def unreadable_input(path, e: OSError) -> DataError:
    """An input that was there when the stage was planned but cannot be opened where a unit is read
    (another node of a cluster that does not mount it, or a file removed meanwhile)."""
    import socket

    why = e.strerror or type(e).__name__
    return DataError(
        f"input {shown(path)} cannot be read on {socket.gethostname()} ({why}); a stage reads its inputs "
        "where its units run: on a cluster, put them on a filesystem every node mounts or in a bucket"
    )


def read_file(
    path: Location, stats: ReadStats, text_field: str = "text", unit: Unit | None = None
) -> Iterator[Document]:
    """Documents of one file (or of the part of it `unit` names), by its suffix; bad records go to `stats`."""
    name = name_of(path)
    if name.endswith(JSONL_SUFFIXES):
        docs = _read_jsonl(path, text_field, stats, unit)
    elif name.endswith(".parquet"):
        docs = _read_parquet(path, text_field, stats, unit)
    else:
        docs = _read_whole(path, stats)
    for doc in docs:
        try:
            size = len(doc.text.encode("utf-8"))
        except UnicodeEncodeError:
            # JSON can spell a lone surrogate ("\ud800"), which no UTF-8 writer downstream accepts.
            stats.reject(doc.id, "lone surrogate (text not encodable as UTF-8)")
            continue
        stats.documents += 1
        stats.bytes += size
        yield doc


def read_documents(
    inputs: Iterable[str | Path], stats: ReadStats, text_field: str = "text"
) -> Iterator[Document]:
    """Stream every document of every input (files or directories), in a stable order."""
    for unit in plan_units(inputs):
        yield from read_unit(unit, stats, text_field)


# ----------------------------------------------------------------------------- work units

MIN_UNIT_BYTES = 1 << 20
MAX_UNIT_BYTES = 64 << 20
UNITS_TARGET = 64


@dataclass(frozen=True)
class Unit:
    """A piece of the input one worker reads on its own: a line range of a plain jsonl file,
    some row groups of a parquet file, a whole compressed file, or a group of small files."""

    kind: str
    """jsonl_range | parquet_groups | whole (one file read start to end) | files (several small files)."""
    paths: tuple[str, ...]
    """The file (one) or files (kind files)."""
    start: int = 0
    """jsonl_range: first byte; parquet_groups: first row group."""
    end: int = -1
    """jsonl_range: byte after the last line (-1: end of file); parquet_groups: row group after the last."""
    first_line: int = 1
    """jsonl_range: line number of the first line; parquet_groups: row number of the first row (ids stay global)."""
    size: int = 0
    """Bytes of input (on disk) this unit covers, for progress and balancing."""


def unit_bytes_for(total: int) -> int:
    """Unit size from the total input size only (never the worker count), so outputs do not depend on it."""
    return int(min(MAX_UNIT_BYTES, max(MIN_UNIT_BYTES, total // UNITS_TARGET)))


def _jsonl_ranges(path: Location, size: int, target: int) -> list[Unit]:
    """Split a plain jsonl file at line starts about every `target` bytes, counting lines for the ids."""
    units, start, line = [], 0, 1
    with open_binary(path) as f:
        while start + target < size:
            f.seek(start + target)
            boundary = start + target + len(f.readline())  # the next line start
            if boundary >= size:
                break
            f.seek(start)
            newlines, left = 0, boundary - start
            while left:
                block = f.read(min(left, 1 << 20))
                newlines += block.count(b"\n")
                left -= len(block)
            units.append(Unit("jsonl_range", (str(path),), start, boundary, line, boundary - start))
            start, line = boundary, line + newlines
    units.append(Unit("jsonl_range", (str(path),), start, -1, line, size - start))
    return units


def _parquet_groups(path: Location, file_size: int, target: int) -> list[Unit]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with open_binary(path) as f:
            meta = pq.ParquetFile(f).metadata
    except (pa.ArrowException, OSError):
        return [Unit("whole", (str(path),), size=file_size)]  # the reader reports it
    units, first, row, size, group_start = [], 0, 0, 0, 0
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        size += rg.total_byte_size
        if size >= target or g == meta.num_row_groups - 1:
            units.append(Unit("parquet_groups", (str(path),), group_start, g + 1, first, size))
            row += sum(meta.row_group(i).num_rows for i in range(group_start, g + 1))
            first, size, group_start = row, 0, g + 1
    return units or [Unit("whole", (str(path),), size=0)]


def plan_units(inputs: Iterable[str | Path]) -> list[Unit]:
    """The inputs as work units, in the stable order documents are read."""
    paths = expand_inputs(inputs)
    sizes = [size_of(p) for p in paths]
    target = unit_bytes_for(sum(sizes))
    units: list[Unit] = []
    small: list[tuple[str, int]] = []

    def flush_small():
        if small:
            units.append(Unit("files", tuple(p for p, _ in small), size=sum(n for _, n in small)))
            small.clear()

    for path, size in zip(paths, sizes):
        name = name_of(path)
        if name.endswith(".jsonl") and size > target:
            flush_small()
            units.extend(_jsonl_ranges(path, size, target))
        elif name.endswith(".parquet") and size > target:
            flush_small()
            units.extend(_parquet_groups(path, size, target))
        elif name.endswith((".txt", ".html", ".htm")):
            small.append((str(path), size))
            if sum(n for _, n in small) >= target:
                flush_small()
        else:
            flush_small()
            units.append(Unit("whole", (str(path),), size=size))
    flush_small()
    return units


def read_unit(unit: Unit, stats: ReadStats, text_field: str = "text") -> Iterator[Document]:
    """The documents of one work unit (what a worker reads by itself)."""
    if unit.kind == "files":
        for path in unit.paths:
            yield from read_file(as_location(path), stats, text_field)
    elif unit.kind == "whole":
        yield from read_file(as_location(unit.paths[0]), stats, text_field)
    else:
        yield from read_file(as_location(unit.paths[0]), stats, text_field, unit)


def check_bad_fraction(stats: ReadStats, max_bad_fraction: float, stage: str) -> None:
    """Fail the stage (one line, with the first example) when too many records were bad."""
    total = stats.documents + stats.bad_total
    if total and stats.bad_total / total > max_bad_fraction:
        reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(stats.bad.items(), key=lambda kv: -kv[1]))
        first = stats.examples[0] if stats.examples else ""
        raise DataError(
            f"{stage}: {stats.bad_total} of {total} records were bad ({reasons}), more than the allowed "
            f"{max_bad_fraction:.1%}; first: {first}"
        )
