"""`shipyard data prepare CONFIG`: the whole data chain, each stage into <out>/<NN-stage>.

extract (when configured) → filter → dedup → decontaminate (when configured)
→ tokenizer-train (unless tokenizer_path is given) → tokenize; validation
inputs are extracted (when configured) and tokenized with the same tokenizer.

A stage whose directory is complete (stages rename into place only when done)
with the same inputs and config is skipped, so rerunning after a failure
picks up where it stopped. A complete stage with a different config is
refused unless --overwrite: nothing is silently replaced. (The content-
addressed pipeline of `shipyard run` generalises this.)

`out` may be a URL: each stage is then published under it (see
`stage.stage_output`), complete only once its `_SUCCESS` marker is there; a
stage whose publication was cut off is redone on the next run.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from shipyard import storage
from shipyard.data.cluster import RayCluster
from shipyard.data.configs import PrepareConfig
from shipyard.data.stage import config_record, default_workers, output_exists
from shipyard.errors import DataError
from shipyard.output import write_json


def _read_stats(out: str | Path) -> dict:
    if storage.is_url(out):
        return json.loads(storage.read_bytes(str(storage.join(out, "stats.json"))))
    return json.loads((Path(out) / "stats.json").read_text())


def _status(out: str | Path, inputs: list[str], record: dict) -> str:
    """'new', 'done', 'changed' or (a URL whose publication was cut off) 'interrupted' for a stage
    output (stale: done, but upstream reran)."""
    if storage.is_url(out) and not storage.is_published(str(out)):
        return "interrupted" if output_exists(str(out)) else "new"
    if not storage.is_url(out) and not Path(out).exists():
        return "new"
    try:
        old = _read_stats(out)
    except (OSError, json.JSONDecodeError, storage.StorageError):
        return "changed"
    same_inputs = old.get("inputs") == [storage.redact(i) for i in inputs]
    return "done" if old.get("config") == record and same_inputs else "changed"


class _Chain:
    """The stages of one `data prepare` run, numbered in order; each is skipped when its output holds
    the same inputs and config, and once one reruns everything after it reruns too."""

    def __init__(self, out: str | Path, overwrite: bool, log: Callable[[str], None]):
        self.out, self.overwrite, self.log = out, overwrite, log
        self.summary: dict = {"out": storage.redact(out), "stages": {}}
        self.rerun, self.count = False, 0

    def stage(self, name: str, inputs: list[str], record: dict, run: Callable[[Path, bool], dict]) -> str:
        self.count += 1
        name = f"{self.count:02d}-{name}"
        target = storage.join(self.out, name)
        status = _status(target, inputs, record)
        if status == "done" and self.rerun:
            status = "stale"
        if status == "done":
            self.log(f"[{name}] done already: {storage.redact(target)}")
            result = _read_stats(target)
        elif status == "changed" and not self.overwrite:
            raise DataError(
                f"data prepare: {storage.redact(target)} holds a stage run with other inputs or config; "
                "pass --overwrite to redo it (and everything after it) or choose another out"
            )
        else:
            if status == "interrupted":  # a cut-off publication is no one's result: replaced without asking
                self.log(f"[{name}] {storage.redact(target)} was not published completely; redoing it")
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

    workers = RayCluster(cfg.ray) if cfg.ray else (cfg.workers or default_workers())
    storage.check_scheme(cfg.out, "data prepare: out")
    out = cfg.out if storage.is_url(cfg.out) else storage.local(cfg.out)
    chain = _Chain(out, overwrite, log)
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
    summary_json = json.dumps(summary, indent=2) + "\n"
    if storage.is_url(out):
        storage.write_bytes(str(storage.join(out, "prepare.json")), summary_json.encode())
    else:
        write_json(out / "prepare.json", summary)
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
