"""Word n-gram hashes, vectorised in numpy (shared by fuzzy dedup and decontamination).

Hashing each shingle in Python (as MinHash libraries usually do, with sha1 per
shingle) dominates their cost. Here the text is normalised once in C (`lower`,
a regex for word characters, `join`), then every word's hash comes from one
polynomial prefix sum over the bytes, and every n-gram's hash from n shifted
adds of word hashes. All arithmetic is uint64 and wraps mod 2^64 on purpose.
Hashes are deterministic across processes and machines (no Python `hash`).
"""

from __future__ import annotations

import numpy as np

_P = np.uint64(0x100000001B3)  # odd, so it is invertible mod 2^64
_P_INV = np.uint64(pow(0x100000001B3, -1, 1 << 64))
_Q = np.uint64(0x9E3779B97F4A7C15)


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


# Word bytes: ASCII letters, digits, underscore, and every byte of a multi-byte
# UTF-8 character (so non-Latin scripts form words; they are not case-folded).
_IS_WORD = np.zeros(256, bool)
for _c in b"0123456789_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ":
    _IS_WORD[_c] = True
_IS_WORD[128:] = True
_LOWER = np.arange(256, dtype=np.uint64) + 1  # +1 so a zero byte still counts
_LOWER[65:91] += 32


def word_spans(text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(UTF-8 bytes, word start offsets, word end offsets): words as `word_hashes` sees them."""
    data = np.frombuffer(text.encode("utf-8", "surrogatepass"), np.uint8)
    edges = np.diff(_IS_WORD[data].view(np.int8), prepend=np.int8(0), append=np.int8(0))
    return data, np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)


def span_words(data: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> list[str]:
    """The lowercased words of some spans (for showing a person what matched)."""
    return [
        bytes(data[s:e]).lower().decode("utf-8", "replace") for s, e in zip(starts, ends)
    ]  # ASCII-only lower, as hashed


def normalized_words(text: str) -> list[str]:
    """The words of `text` as a list of strings (what the hashes below see, for tests and reports)."""
    return span_words(*word_spans(text))


def word_hashes(text: str) -> np.ndarray:
    """One well-mixed uint64 per word of `text`, independent of its position and case.

    Words are runs of letters/digits/underscore (ASCII case-folded) or non-ASCII
    characters; everything else separates them. Vectorised over the bytes: no
    Python-level loop or string per word.
    """
    return span_hashes(*word_spans(text))


def span_hashes(data: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """word_hashes for spans already found by word_spans."""
    if starts.size == 0:
        return np.zeros(0, np.uint64)
    n = data.size
    with np.errstate(over="ignore"):
        powers, inv_powers = _powers(n)
        prefix = np.zeros(n + 1, np.uint64)
        np.cumsum(_LOWER[data] * powers[:n], out=prefix[1:])
        # sum over the word of code * P^(j - start): shift the prefix difference back to position 0
        raw = (prefix[ends] - prefix[starts]) * inv_powers[starts]
        return _mix(raw + (ends - starts).astype(np.uint64))


def ngram_hashes(text: str, n: int) -> np.ndarray:
    """uint64 hash of every run of n consecutive words; one hash of all words when there are fewer than n."""
    return combine(word_hashes(text), n)


def combine(wh: np.ndarray, n: int) -> np.ndarray:
    """n-gram hashes from word hashes."""
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
