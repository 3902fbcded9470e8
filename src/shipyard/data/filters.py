"""Heuristic quality filters: one function per rule, the first failing rule names the drop.

Rules follow Gopher (Rae et al. 2021: word counts and shape, symbol ratio,
alphabetic words, repeated lines and n-grams) and C4 (lines ending in
terminal punctuation). The `code` profile keeps only the rules that make sense
for source code (length, repetition), so code is not thrown out by prose rules.
"""

from __future__ import annotations

from collections import Counter

from shipyard.config import FilterConfig

TERMINAL = (".", "!", "?", '"', "'", "”", "’")


def _ngram_stats(words: list[str], n: int) -> tuple[float, float]:
    """(top n-gram char fraction, char fraction covered by n-grams seen more than once)."""
    if len(words) < n:
        return 0.0, 0.0
    total = sum(len(w) for w in words) or 1
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    counts = Counter(grams)
    top, top_count = counts.most_common(1)[0]
    top_frac = sum(len(w) for w in top) * top_count / total if top_count > 1 else 0.0
    covered = [False] * len(words)
    for i, g in enumerate(grams):
        if counts[g] > 1:
            for j in range(i, i + n):
                covered[j] = True
    dup_frac = sum(len(w) for w, c in zip(words, covered) if c) / total
    return top_frac, dup_frac


def failed_rule(text: str, cfg: FilterConfig) -> str | None:
    """Name of the first rule `text` fails, or None when it passes them all."""
    words = text.split()
    n_words = len(words)
    prose = cfg.profile == "prose"
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
    if max_top is not None and _ngram_stats(words, 2)[0] > max_top:
        return "top_ngram"
    if max_dup_ngrams is not None and _ngram_stats(words, 5)[1] > max_dup_ngrams:
        return "duplicate_ngrams"
    if prose and cfg.min_terminal_punct_line_fraction is not None and lines:
        ended = sum(line.endswith(TERMINAL) for line in lines) / len(lines)
        if ended < cfg.min_terminal_punct_line_fraction:
            return "terminal_punctuation"
    return None
