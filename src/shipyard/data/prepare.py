"""`shipyard data prepare CONFIG`: the whole data chain, each stage into <out>/<NN-stage>.

extract (when configured) → filter → dedup → decontaminate (when configured)
→ tokenizer-train (unless tokenizer_path is given) → tokenize; validation
inputs are extracted (when configured) and tokenized with the same tokenizer.

A stage whose directory is complete (stages rename into place only when done)
with the same inputs and config is skipped, so rerunning after a failure
picks up where it stopped. A complete stage with a different config is
refused unless --overwrite: nothing is silently replaced. (The content-
addressed pipeline of `shipyard run` generalises this.)
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from shipyard.data.configs import PrepareConfig
from shipyard.data.stage import config_record, default_workers
from shipyard.errors import DataError
from shipyard.output import write_json


def _status(out: Path, inputs: list[str], record: dict) -> str:
    """'new', 'done' or 'changed' for a stage directory (stale: done, but upstream reran)."""
    stats = out / "stats.json"
    if not out.exists():
        return "new"
    try:
        old = json.loads(stats.read_text())
    except (OSError, json.JSONDecodeError):
        return "changed"
    return "done" if old.get("config") == record and old.get("inputs") == inputs else "changed"


class _Chain:
    """The stages of one `data prepare` run, numbered in order; each is skipped when its output holds
    the same inputs and config, and once one reruns everything after it reruns too."""

    def __init__(self, out: Path, overwrite: bool, log: Callable[[str], None]):
        self.out, self.overwrite, self.log = out, overwrite, log
        self.summary: dict = {"out": str(out), "stages": {}}
        self.rerun, self.count = False, 0

    def stage(self, name: str, inputs: list[str], record: dict, run: Callable[[Path, bool], dict]) -> str:
        self.count += 1
        name = f"{self.count:02d}-{name}"
        target = self.out / name
        status = _status(target, inputs, record)
        if status == "done" and self.rerun:
            status = "stale"
        if status == "done":
            self.log(f"[{name}] done already: {target}")
            result = json.loads((target / "stats.json").read_text())
        elif status == "changed" and not self.overwrite:
            raise DataError(
                f"data prepare: {target} holds a stage run with other inputs or config; "
                "pass --overwrite to redo it (and everything after it) or choose another out"
            )
        else:
            result = run(target, status != "new")
            self.rerun = True
            self.log(f"[{name}] {describe(result)}")
        self.summary["stages"][name] = {
            k: result.get(k) for k in ("documents_in", "documents_out", "dropped", "seconds")
        }
        return str(target)


def _document_stages():
    """(PrepareConfig field = stage name, stage function) of the document stages, in chain order."""
    from shipyard.data.decontaminate import run_decontaminate
    from shipyard.data.dedup import run_dedup
    from shipyard.data.extract import run_extract
    from shipyard.data.filters import run_filter

    return (
        ("extract", run_extract),
        ("filter", run_filter),
        ("dedup", run_dedup),
        ("decontaminate", run_decontaminate),
    )


def _run_documents(fn, inputs, stage_cfg, read, workers, target: Path, overwrite: bool) -> dict:
    return fn(inputs, target, stage_cfg, read, workers, overwrite)


def run_prepare(cfg: PrepareConfig, overwrite: bool = False, log: Callable[[str], None] = print) -> dict:
    from shipyard.data.extract import run_extract
    from shipyard.data.tokenize import run_tokenize
    from shipyard.data.tokenizer import run_tokenizer_train, tokenizer_record

    workers = cfg.workers or default_workers()
    chain = _Chain(Path(cfg.out), overwrite, log)
    started = time.time()
    current = list(cfg.inputs)
    for name, fn in _document_stages():
        c = getattr(cfg, name)
        if c is not None:
            record = config_record(cfg.read, **{name: c})
            run = partial(_run_documents, fn, current, c, cfg.read, workers)
            current = [chain.stage(name, current, record, run)]
    tokenizer = cfg.tokenizer_path
    if tokenizer is None:
        c = cfg.tokenizer
        tokenizer = chain.stage(
            "tokenizer",
            current,
            config_record(cfg.read, tokenizer=c),
            lambda t, ow, i=current: run_tokenizer_train(i, t, c, cfg.read, ow),
        )
    tokenizer_id = tokenizer_record(tokenizer)  # a changed tokenizer file reruns tokenization
    c = cfg.tokenize
    token_record = config_record(cfg.read, tokenize=c, tokenizer=tokenizer_id)
    summary = chain.summary
    summary["train_shards"] = chain.stage(
        "tokenize-train",
        current,
        token_record,
        lambda t, ow, i=current: run_tokenize(i, t, tokenizer, c, cfg.read, workers, ow),
    )
    if cfg.validation_inputs:
        val = list(cfg.validation_inputs)
        if cfg.extract is not None:
            e = cfg.extract
            val = [
                chain.stage(
                    "extract-validation",
                    val,
                    config_record(cfg.read, extract=e),
                    lambda t, ow, i=val: run_extract(i, t, e, cfg.read, workers, ow),
                )
            ]
        summary["validation_shards"] = chain.stage(
            "tokenize-validation",
            val,
            token_record,
            lambda t, ow, i=val: run_tokenize(i, t, tokenizer, c, cfg.read, workers, ow),
        )
    summary["tokenizer"] = tokenizer
    summary["seconds"] = round(time.time() - started, 3)
    write_json(Path(cfg.out) / "prepare.json", summary)
    return summary


def describe(stats: dict) -> str:
    """One line for a person: documents and bytes in → out, drops by reason, time and rate."""
    drops = ", ".join(f"{k} {v:,}" for k, v in stats.get("dropped", {}).items() if v)
    bad = sum(stats.get("bad_records", {}).values())
    parts = [
        f"{stats['documents_in']:,} → {stats['documents_out']:,} documents",
        f"{stats['bytes_in'] / 1e6:.1f} MB in",
    ]
    if "tokens" in stats:
        parts.append(f"{stats['tokens']:,} tokens in {stats['shards']} shard(s)")
    if drops:
        parts.append(f"dropped: {drops}")
    if bad:
        parts.append(f"{bad:,} bad records skipped")
    parts.append(f"{stats['seconds']:.1f} s ({stats['mb_per_s'] or 0:.1f} MB/s)")
    return "; ".join(parts)
