"""Drop (or report) training documents sharing a word n-gram with evaluation data.

The evaluation sets' n-grams (default 13 words, lowercased letters/digits,
as in GPT-3's contamination study) are hashed to uint64 and kept as one
sorted array per set; a training document is contaminated when any of its
n-gram hashes is found there (binary search, vectorised). A 64-bit hash
makes a false match on 13-grams astronomically unlikely; the reported
example names the matching words so a person can check.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from shipyard.data.configs import DecontaminateConfig, ReadConfig
from shipyard.data.documents import Document, ReadStats, read_documents
from shipyard.data.ngrams import combine, span_hashes, span_words, word_hashes, word_spans
from shipyard.data.stage import Workers, run_document_stage
from shipyard.errors import DataError


def eval_ngrams(eval_sets: tuple[str, ...], n: int, text_field: str) -> dict[str, np.ndarray]:
    """Sorted unique n-gram hashes of each evaluation set (documents shorter than n words add none)."""
    if not eval_sets:
        raise DataError(
            "data decontaminate: no evaluation sets given (set eval_sets, e.g. --eval path/to/eval.jsonl)"
        )
    out = {}
    for name in eval_sets:
        stats = ReadStats()
        hashes = [
            combine(w, n)
            for d in read_documents([name], stats, text_field)
            if len(w := word_hashes(d.text)) >= n
        ]
        if stats.documents == 0:
            raise DataError(f"data decontaminate: evaluation set {name} holds no readable documents")
        out[name] = np.unique(np.concatenate(hashes)) if hashes else np.zeros(0, np.uint64)
    return out


def _contains(sorted_hashes: np.ndarray, query: np.ndarray) -> np.ndarray:
    if sorted_hashes.size == 0:
        return np.zeros(query.size, bool)
    pos = np.minimum(np.searchsorted(sorted_hashes, query), sorted_hashes.size - 1)
    return sorted_hashes[pos] == query


# Set once per worker process by the pool initializer (a worker serves one stage).
_STATE: dict = {}


def _init(cfg: DecontaminateConfig, sets: dict[str, np.ndarray]) -> None:
    _STATE.update(cfg=cfg, sets=sets)


def decontaminate_batch(docs: list[Document]) -> tuple[list[Document], Counter, list[dict]]:
    cfg, sets = _STATE["cfg"], _STATE["sets"]
    kept, drops, examples = [], Counter(), []
    for doc in docs:
        data, starts, ends = word_spans(doc.text)
        hits = []
        if len(starts) >= cfg.ngram:
            grams = combine(span_hashes(data, starts, ends), cfg.ngram)
            for name, table in sets.items():
                found = np.flatnonzero(_contains(table, grams))
                if found.size:
                    at = slice(found[0], found[0] + cfg.ngram)
                    hits.append((name, " ".join(span_words(data, starts[at], ends[at]))))
        if hits:
            drops.update(f"contaminated:{name}" for name, _ in hits)
            drops["contaminated"] += 1
            if len(examples) < cfg.max_examples:
                examples.append({"id": doc.id, "eval_set": hits[0][0], "ngram": hits[0][1]})
            if cfg.mode == "drop":
                continue
        kept.append(doc)
    return kept, drops, examples


def run_decontaminate(
    inputs: list[str],
    out: Path,
    cfg: DecontaminateConfig,
    read: ReadConfig,
    workers: Workers,
    overwrite: bool = False,
) -> dict:
    sets = eval_ngrams(cfg.eval_sets, cfg.ngram, read.text_field)
    result = run_document_stage(
        "decontaminate",
        inputs,
        out,
        cfg,
        read,
        decontaminate_batch,
        workers=workers,
        overwrite=overwrite,
        initializer=_init,
        initargs=(cfg, sets),
        max_examples=cfg.max_examples,
        postprocess=lambda stats: _summarise(stats, cfg),
    )
    return result


def _summarise(stats: dict, cfg: DecontaminateConfig) -> None:
    """Per-set counts next to the total; in report mode nothing was dropped."""
    counts = stats.pop("dropped")
    stats["contaminated_documents"] = counts.get("contaminated", 0)
    stats["per_eval_set"] = {name: counts.get(f"contaminated:{name}", 0) for name in cfg.eval_sets}
    stats["mode"] = cfg.mode
    stats["dropped"] = {"contaminated": stats["contaminated_documents"]} if cfg.mode == "drop" else {}
