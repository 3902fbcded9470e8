"""`shipyard plan data`: what preparing a corpus of a given size costs on N nodes, before renting them.

From the corpus size (bytes, documents or tokens), the node count and shape, and per-core rates
measured by `bench/data_throughput.py`, it estimates for each stage: the work units, the bytes the
stage reads, shuffles and keeps in scratch storage, the memory of its largest task and of a node
running one task per core, the storage requests of its shuffles, and the wall time. Dedup's numbers
follow its actual shuffles (dedup_steps.py): the same partition and group counts, record sizes and
rounds. They are estimates: rates differ per machine and corpus (pass your own bench output with
--rates), and the duplicate fraction decides dedup's pair volume.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from shipyard.data.configs import DedupConfig
from shipyard.data.dedup import partitions_for
from shipyard.data.documents import MAX_UNIT_BYTES, MIN_UNIT_BYTES, UNITS_TARGET
from shipyard.errors import ConfigError

# MB/s per core, from bench/results/data_throughput.repeat.json (bench/repeat.py over
# bench/data_throughput.py, 3 runs on 2026-12-03, 2 worker processes on a 2-core VM, the stdlib
# corpus): the medians divided by the 2 cores. Decontaminate was not measured: it is assumed as
# fast as filter.
MEASURED_MB_PER_CORE_S = {
    "extract": 15.24 / 2,
    "filter": 21.49 / 2,
    "decontaminate": 21.49 / 2,
    "dedup": 14.71 / 2,
    "tokenize": 2.17 / 2,
}
STAGES = tuple(MEASURED_MB_PER_CORE_S)


@dataclass(frozen=True)
class Cluster:
    """The machines a plan is for."""

    nodes: int
    """Worker nodes."""
    cpus_per_node: int = 64
    """Cores per node (one task per core)."""
    memory_per_node: int = 256 << 30
    """Bytes of memory per node."""
    bandwidth_per_node: float = 1.25e9
    """Bytes/s a node reads and writes to the shared storage (10 Gb/s)."""


@dataclass(frozen=True)
class Corpus:
    """The text going in."""

    bytes: int
    """UTF-8 bytes of document text."""
    bytes_per_document: float = 4_500
    """Average document size (FineWeb-like web text is 3-5 KB)."""
    bytes_per_token: float = 4.2
    """Text bytes per token of the tokenizer (about 4.2 for a 128k-vocabulary BPE on English web text)."""
    duplicate_fraction: float = 0.3
    """Share of documents that have a near-duplicate (sets dedup's pair volume)."""

    @property
    def documents(self) -> int:
        return int(self.bytes / self.bytes_per_document)

    @property
    def tokens(self) -> int:
        return int(self.bytes / self.bytes_per_token)


_SCALE = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BINARY = {"KI": 1 << 10, "MI": 1 << 20, "GI": 1 << 30, "TI": 1 << 40, "PI": 1 << 50}


def parse_amount(text: str, flag: str, what: str, examples: str = "10TB, 2.5PiB, 15T or 1.5e13") -> float:
    """'10TB', '2.5 PiB', '15T', '1.5e13' -> a number (decimal suffixes are powers of 1000, 'i' ones
    of 1024; a trailing B is optional). A bad one is a ConfigError naming `flag`."""
    t = text.strip().upper().replace(" ", "").removesuffix("B")
    num = t.rstrip("KMGTPI")
    unit = t[len(num) :]
    scale = _BINARY.get(unit, _SCALE.get(unit))
    try:
        value = float(num)
    except ValueError:
        value = float("nan")
    if scale is None or not value > 0 or math.isinf(value):
        raise ConfigError(f"{flag}: {text!r} is not {what}; expected e.g. {examples}")
    return value * scale


def units_for(total: int) -> tuple[int, int]:
    """(work units, bytes per unit) of an input of `total` bytes (documents.unit_bytes_for)."""
    size = int(min(MAX_UNIT_BYTES, max(MIN_UNIT_BYTES, total // UNITS_TARGET)))
    return max(1, math.ceil(total / size)), size


def dedup_shuffles(corpus: Corpus, cfg: DedupConfig, units: int) -> dict:
    """Bytes, files and ranged reads of dedup's shuffles, and its largest task's memory."""
    docs = corpus.documents
    partitions = partitions_for(units, corpus.bytes)
    groups = min(units, partitions)
    pairs = int(docs * corpus.duplicate_fraction * 2)  # first-member and predecessor pairs
    band_record = 12 + 4 * cfg.rows
    shuffled = {
        "exact keys": docs * 24,
        "bands": docs * cfg.bands * band_record,
        "pairs": pairs * 16 * 2,  # a pair can come from several bands: about two copies
        "pairs with signatures": pairs * (16 + 4 * cfg.num_perm),
        "components": pairs * 16 * 2 * 4,  # edges both ways, about four rounds
    }
    # two ranged reads per (map file, reduce task); the map side is a group of units (dedup_steps.py)
    g, p = groups, partitions
    reads = {
        "exact keys": units + g * p * 2,  # the groups read their units' key files, then the shuffle
        "exact removals": p * g * 2 * 2,  # read by the band and the drop-list tasks
        "bands": units + g * p * 2,
        "pairs": p * g * 2,
        "pairs with signatures": g * g * 2,
        "components": 4 * p * p * 2 + p * g * 2,  # about four rounds, then the drop lists
        "drop lists": 2 * units,  # written by the groups, read by the unit tasks
    }
    signatures = docs * cfg.num_perm * 4
    task_memory = max(
        3 * shuffled["bands"] / partitions,  # a bucket task sorts its band records
        signatures / groups + 2 * shuffled["pairs with signatures"] / groups,  # a verification group
        2 * MAX_UNIT_BYTES,  # a unit task: its documents and signatures
    )
    return {
        "partitions": partitions,
        "groups": groups,
        "shuffled_bytes": shuffled,
        "ranged_reads": reads,
        "scratch_bytes": signatures + docs * 32 + sum(shuffled.values()),
        "signature_bytes": signatures,
        "task_memory_bytes": int(task_memory),
    }


def plan_data(corpus: Corpus, cluster: Cluster, rates: dict[str, float] | None = None) -> dict:
    """Per stage and in all: units, bytes, memory, requests and wall time (see the module docstring)."""
    if cluster.nodes < 1 or cluster.cpus_per_node < 1:
        raise ConfigError("plan data: --nodes and --cpus-per-node must be at least 1")
    if corpus.bytes <= 0:
        raise ConfigError("plan data: the corpus size must be positive (--bytes, --documents or --tokens)")
    rates = {**MEASURED_MB_PER_CORE_S, **(rates or {})}
    cores = cluster.nodes * cluster.cpus_per_node
    units, unit_bytes = units_for(corpus.bytes)
    stages = {}
    for stage in STAGES:
        compute_s = corpus.bytes / (rates[stage] * 1e6 * cores)
        io = 2 * corpus.bytes  # read the input, write about as much
        entry = {
            "units": units,
            "input_bytes": corpus.bytes,
            "task_memory_bytes": 2 * unit_bytes,
            "shuffled_bytes": 0,
            "scratch_bytes": 0,
            "ranged_reads": units,
        }
        if stage == "dedup":
            d = dedup_shuffles(corpus, DedupConfig(), units)
            entry.update(
                partitions=d["partitions"],
                groups=d["groups"],
                task_memory_bytes=d["task_memory_bytes"],
                shuffled_bytes=sum(d["shuffled_bytes"].values()),
                shuffle=d["shuffled_bytes"],
                scratch_bytes=d["scratch_bytes"],
                signature_bytes=d["signature_bytes"],
                ranged_reads=units + sum(d["ranged_reads"].values()),
            )
            io += 2 * entry["shuffled_bytes"]  # every shuffled byte is written once and read once
            compute_s *= 1.3  # the shuffle tasks on top of sketching (bench/data_cluster.py)
        if stage == "tokenize":
            entry["tokens"] = corpus.tokens
            entry["output_bytes"] = corpus.tokens * 4
            entry["scratch_bytes"] = corpus.tokens * 4  # each unit's tokens, for the shard tasks
            io = corpus.bytes + 3 * entry["output_bytes"]  # tokens to scratch, back, into shards
        io_s = io / (cluster.bandwidth_per_node * cluster.nodes)
        entry["node_memory_bytes"] = entry["task_memory_bytes"] * cluster.cpus_per_node
        entry["fits"] = entry["node_memory_bytes"] <= cluster.memory_per_node
        entry["wall_s"] = max(compute_s, io_s)
        entry["bound_by"] = "compute" if compute_s >= io_s else "storage bandwidth"
        stages[stage] = entry
    return {
        "corpus": {
            "bytes": corpus.bytes,
            "documents": corpus.documents,
            "tokens": corpus.tokens,
            "duplicate_fraction": corpus.duplicate_fraction,
        },
        "cluster": {
            "nodes": cluster.nodes,
            "cpus_per_node": cluster.cpus_per_node,
            "memory_per_node": cluster.memory_per_node,
            "bandwidth_per_node": cluster.bandwidth_per_node,
        },
        "rates_mb_per_core_s": rates,
        "stages": stages,
        "wall_s": sum(s["wall_s"] for s in stages.values()),
        "fits": all(s["fits"] for s in stages.values()),
    }


def rates_from_bench(path: Path) -> dict[str, float]:
    """Per-core MB/s from a `bench/data_throughput.py` output (its stages' mb_per_s over its cores)."""
    try:
        report = json.loads(Path(path).read_text())
        cores = report["machine"]["cores"]
        return {s: v["mb_per_s"] / cores for s, v in report["stages"].items() if s in STAGES}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"--rates {path}: not a bench/data_throughput.py output ({type(e).__name__}: {e}); "
            "expected its JSON with machine.cores and stages.<stage>.mb_per_s"
        ) from None


def _size(n: float) -> str:
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def _hours(s: float) -> str:
    return f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.1f} min"


def render(plan: dict) -> str:
    c, k = plan["corpus"], plan["cluster"]
    lines = [
        f"corpus: {_size(c['bytes'])}, {_count(c['documents'])} documents, {_count(c['tokens'])} tokens "
        f"({c['duplicate_fraction']:.0%} with a near-duplicate)",
        f"cluster: {k['nodes']} nodes x {k['cpus_per_node']} cores, {_size(k['memory_per_node'])} and "
        f"{_size(k['bandwidth_per_node'])}/s of storage bandwidth each",
        "",
        f"{'stage':<14}{'units':>9}{'shuffled':>11}{'scratch':>11}{'task mem':>10}{'node mem':>10}"
        f"{'requests':>10}{'wall':>10}  bound by",
    ]
    for name, s in plan["stages"].items():
        lines.append(
            f"{name:<14}{_count(s['units']):>9}{_size(s['shuffled_bytes']):>11}{_size(s['scratch_bytes']):>11}"
            f"{_size(s['task_memory_bytes']):>10}{_size(s['node_memory_bytes']):>10}"
            f"{_count(s['ranged_reads']):>10}{_hours(s['wall_s']):>10}  {s['bound_by']}"
            + ("" if s["fits"] else "  (does not fit in a node's memory)")
        )
    d = plan["stages"]["dedup"]
    lines += [
        "",
        f"dedup: {d['partitions']} partitions, {d['groups']} groups of units; signatures "
        f"{_size(d['signature_bytes'])} in scratch (never in one process)",
        "  shuffled: " + ", ".join(f"{n} {_size(b)}" for n, b in d["shuffle"].items()),
        f"total: {_hours(plan['wall_s'])}"
        + ("" if plan["fits"] else "; a stage does not fit: add memory or nodes"),
    ]
    return "\n".join(lines)
