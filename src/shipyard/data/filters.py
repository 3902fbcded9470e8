"""Heuristic quality filters: one function per rule, the first failing rule names the drop.

Rules follow Gopher (Rae et al. 2021: word counts and shape, symbol ratio,
alphabetic words, repeated lines and n-grams) and C4 (lines ending in
terminal punctuation). The `code` profile keeps only the rules that make sense
for source code (length, repetition), so code is not thrown out by prose rules.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from shipyard.data.configs import FilterConfig, ReadConfig
from shipyard.data.documents import Document
from shipyard.data.stage import Workers, run_document_stage

TERMINAL = (".", "!", "?", '"', "'", "”", "’")


class _Words:
    """A document's whitespace-separated words as arrays: per-word hash and length.

    The repetition rules count n-grams; doing that with tuples of strings in
    a Counter was 90% of the filter's time. Here an n-gram is a wrapping
    int64 combination of its words' hashes (Python's `hash` of str: salted
    per process, but only compared within one document, so results do not
    depend on it; a 64-bit collision is negligible) and counting is np.unique.
    """

    def __init__(self, words: list[str]):
        self.n = len(words)
        self.hashes = np.fromiter(map(hash, words), np.int64, self.n)
        self.lengths = np.fromiter(map(len, words), np.int64, self.n)
        self.chars = int(self.lengths.sum())

    def gram_ids(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(per-position n-gram id, count of each id) for the n-grams starting at 0..len-n."""
        count = self.n - n + 1
        with np.errstate(over="ignore"):
            acc = np.zeros(count, np.int64)
            for k in range(n):
                acc = acc * np.int64(1_000_003) + self.hashes[k : k + count]
        _, inverse, counts = np.unique(acc, return_inverse=True, return_counts=True)
        return inverse, counts


def _top_ngram_fraction(words: _Words, n: int) -> float:
    """Fraction of word characters taken by the most frequent n-gram's repeats (0 if none repeats)."""
    if words.n < n:
        return 0.0
    inverse, counts = words.gram_ids(n)
    top = int(np.argmax(counts))  # ties: the smallest id, a fixed choice
    if counts[top] < 2:
        return 0.0
    first = int(np.argmax(inverse == top))
    return int(words.lengths[first : first + n].sum()) * int(counts[top]) / (words.chars or 1)


def _duplicate_ngram_fraction(words: _Words, n: int) -> float:
    """Fraction of word characters inside n-grams that occur more than once."""
    if words.n < n:
        return 0.0
    inverse, counts = words.gram_ids(n)
    starts = np.flatnonzero(counts[inverse] > 1)
    # mark words start..start+n-1 of every repeated n-gram: +1/-1 at the ends, cumulative sum
    delta = np.zeros(words.n + 1, np.int64)
    np.add.at(delta, starts, 1)
    np.add.at(delta, starts + n, -1)
    covered = np.cumsum(delta[:-1]) > 0
    return int(words.lengths[covered].sum()) / (words.chars or 1)


def profile_for(source: str, cfg: FilterConfig) -> str:
    """The profile a document from `source` gets: cfg.profile, or by file suffix when it is auto."""
    if cfg.profile != "auto":
        return cfg.profile
    return "code" if source.endswith(cfg.code_extensions) else "prose"


def failed_rule(text: str, cfg: FilterConfig, source: str = "") -> str | None:
    """Name of the first rule `text` (from file `source`) fails, or None when it passes them all."""
    words = text.split()
    n_words = len(words)
    prose = profile_for(source, cfg) == "prose"
    if cfg.min_chars is not None and len(text) < cfg.min_chars:
        return "min_chars"
    if cfg.min_words is not None and n_words < cfg.min_words:
        return "min_words"
    if cfg.max_words is not None and n_words > cfg.max_words:
        return "max_words"
    if n_words == 0:
        return "min_words"
    if prose:
        mean_len = sum(len(w) for w in words) / n_words
        if cfg.min_mean_word_length is not None and mean_len < cfg.min_mean_word_length:
            return "mean_word_length"
        if cfg.max_mean_word_length is not None and mean_len > cfg.max_mean_word_length:
            return "mean_word_length"
        if cfg.min_alpha_word_fraction is not None:
            alpha = sum(any(c.isalpha() for c in w) for w in words) / n_words
            if alpha < cfg.min_alpha_word_fraction:
                return "alpha_words"
        if cfg.max_symbol_word_ratio is not None:
            symbols = text.count("#") + text.count("...") + text.count("…")
            if symbols / n_words > cfg.max_symbol_word_ratio:
                return "symbol_ratio"
    if prose:
        max_dup_lines, max_top, max_dup_ngrams = (
            cfg.max_duplicate_line_fraction,
            cfg.max_top_ngram_fraction,
            cfg.max_duplicate_ngram_fraction,
        )
    else:
        max_dup_lines, max_top, max_dup_ngrams = (
            cfg.code_max_duplicate_line_fraction,
            cfg.code_max_top_ngram_fraction,
            cfg.code_max_duplicate_ngram_fraction,
        )
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if max_dup_lines is not None and lines and (len(lines) - len(set(lines))) / len(lines) > max_dup_lines:
        return "duplicate_lines"
    if max_top is not None or max_dup_ngrams is not None:
        arrays = _Words(words)
        if max_top is not None and _top_ngram_fraction(arrays, 2) > max_top:
            return "top_ngram"
        if max_dup_ngrams is not None and _duplicate_ngram_fraction(arrays, 5) > max_dup_ngrams:
            return "duplicate_ngrams"
    if prose and cfg.min_terminal_punct_line_fraction is not None and lines:
        ended = sum(line.endswith(TERMINAL) for line in lines) / len(lines)
        if ended < cfg.min_terminal_punct_line_fraction:
            return "terminal_punctuation"
    return None


def rule_measure(rule: str, text: str, cfg: FilterConfig, source: str = "") -> dict | None:
    """What `rule` (a name `failed_rule` returns) measured on `text` and the limit it holds it to:
    {"value", "limit", "needs"} ("needs" says which side of the limit passes), or None for an
    unknown rule. What `shipyard browse` shows beside a dropped document."""
    words = text.split()
    n = max(len(words), 1)
    prose = profile_for(source, cfg) == "prose"
    lines = [line.strip() for line in text.splitlines() if line.strip()]

    def prose_or_code(name: str):
        return getattr(cfg, name if prose else f"code_{name}")

    measures = {
        "min_chars": lambda: (len(text), cfg.min_chars, ">="),
        "min_words": lambda: (len(words), cfg.min_words, ">="),
        "max_words": lambda: (len(words), cfg.max_words, "<="),
        "mean_word_length": lambda: (
            sum(len(w) for w in words) / n,
            f"{cfg.min_mean_word_length}..{cfg.max_mean_word_length}",
            "within",
        ),
        "alpha_words": lambda: (
            sum(any(c.isalpha() for c in w) for w in words) / n,
            cfg.min_alpha_word_fraction,
            ">=",
        ),
        "symbol_ratio": lambda: (
            (text.count("#") + text.count("...") + text.count("…")) / n,
            cfg.max_symbol_word_ratio,
            "<=",
        ),
        "duplicate_lines": lambda: (
            (len(lines) - len(set(lines))) / max(len(lines), 1),
            prose_or_code("max_duplicate_line_fraction"),
            "<=",
        ),
        "top_ngram": lambda: (
            _top_ngram_fraction(_Words(words), 2),
            prose_or_code("max_top_ngram_fraction"),
            "<=",
        ),
        "duplicate_ngrams": lambda: (
            _duplicate_ngram_fraction(_Words(words), 5),
            prose_or_code("max_duplicate_ngram_fraction"),
            "<=",
        ),
        "terminal_punctuation": lambda: (
            sum(line.endswith(TERMINAL) for line in lines) / max(len(lines), 1),
            cfg.min_terminal_punct_line_fraction,
            ">=",
        ),
    }
    if rule not in measures:
        return None
    value, limit, needs = measures[rule]()
    return {"value": float(value), "limit": limit, "needs": needs}


# ----------------------------------------------------------------------------- the filter stage

# Set once per worker process by the pool initializer (a worker serves one stage).
_CFG: FilterConfig | None = None


def _init(cfg: FilterConfig) -> None:
    global _CFG
    _CFG = cfg


def filter_batch(docs: list[Document]) -> tuple[list[Document], Counter, list[dict]]:
    kept, drops, examples = [], Counter(), []
    for doc in docs:
        rule = failed_rule(doc.text, _CFG, doc.source)
        if rule is None:
            kept.append(doc)
        else:
            if not drops[rule]:  # the first drop of each rule in a batch, to see what a rule catches
                examples.append({"id": doc.id, "rule": rule, "start": doc.text[:120]})
            drops[rule] += 1
    return kept, drops, examples


def run_filter(
    inputs: list[str],
    out: Path,
    cfg: FilterConfig,
    read: ReadConfig,
    workers: Workers,
    overwrite: bool = False,
) -> dict:
    return run_document_stage(
        "filter",
        inputs,
        out,
        cfg,
        read,
        filter_batch,
        workers=workers,
        overwrite=overwrite,
        initializer=_init,
        initargs=(cfg,),
    )
