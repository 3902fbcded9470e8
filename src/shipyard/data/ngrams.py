"""Word n-gram hashes, vectorised in numpy (shared by fuzzy dedup and decontamination).

Hashing each shingle in Python (as MinHash libraries usually do, with sha1 per
shingle) dominates their cost. Here the text is normalised once in C (`lower`,
a regex for word characters, `join`), then every word's hash comes from one
polynomial prefix sum over the bytes, and every n-gram's hash from n shifted
adds of word hashes. All arithmetic is uint64 and wraps mod 2^64 on purpose.
Hashes are deterministic across processes and machines (no Python `hash`).
"""

from __future__ import annotations

import re

import numpy as np

_WORD = re.compile(r"\w+")
_P = np.uint64(0x100000001B3)  # odd, so it is invertible mod 2^64
_P_INV = np.uint64(pow(0x100000001B3, -1, 1 << 64))
_Q = np.uint64(0x9E3779B97F4A7C15)


def normalized_words(text: str) -> list[str]:
    """Lowercased runs of letters/digits/underscore: punctuation and whitespace differences do not count."""
    return _WORD.findall(text.lower())


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: spreads every input bit over the whole word."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


_POWERS = {"n": 0, "p": np.ones(1, np.uint64), "inv": np.ones(1, np.uint64)}  # memo, grown on demand


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """P^j and P^-j for j = 0..n (recomputing them per document was a third of the time)."""
    if _POWERS["n"] < n:
        size = max(n, 2 * _POWERS["n"], 1 << 16)
        with np.errstate(over="ignore"):
            p = np.empty(size + 1, np.uint64)
            p[0] = 1
            p[1:] = np.cumprod(np.full(size, _P, np.uint64))
            inv = np.empty(size + 1, np.uint64)
            inv[0] = 1
            inv[1:] = np.cumprod(np.full(size, _P_INV, np.uint64))
        _POWERS.update(n=size, p=p, inv=inv)
    return _POWERS["p"], _POWERS["inv"]


def word_hashes(words: list[str]) -> np.ndarray:
    """One well-mixed uint64 per word, independent of the word's position."""
    if not words:
        return np.zeros(0, np.uint64)
    data = np.frombuffer(" ".join(words).encode("utf-8"), np.uint8)
    n = data.size
    with np.errstate(over="ignore"):
        powers, inv_powers = _powers(n)
        prefix = np.zeros(n + 1, np.uint64)
        np.cumsum((data.astype(np.uint64) + np.uint64(1)) * powers[:n], out=prefix[1:])
        spaces = np.flatnonzero(data == 32)
        starts = np.concatenate(([0], spaces + 1))
        ends = np.concatenate((spaces, [n]))
        # sum over the word of (byte+1) * P^(j - start): shift the prefix difference back to position 0
        raw = (prefix[ends] - prefix[starts]) * inv_powers[starts]
        return _mix(raw + (ends - starts).astype(np.uint64))


def ngram_hashes(words: list[str], n: int) -> np.ndarray:
    """uint64 hash of every run of n consecutive words; one hash of all words when there are fewer than n."""
    wh = word_hashes(words)
    if wh.size == 0:
        return wh
    if wh.size < n:
        n = wh.size
    count = wh.size - n + 1
    with np.errstate(over="ignore"):
        acc = np.zeros(count, np.uint64)
        for k in range(n):
            acc = acc * _Q + wh[k : k + count]
        return _mix(acc)
