"""Exact matches of generated text in the training token shards (OLMoTrace-style), for `shipyard browse`.

A person selects a span a model generated; the page shows where exactly those tokens occur in the
token shards (DESIGN.md, "Token shards") and the documents they occur in. The index is a suffix
array over the concatenation of every shard's tokens: the suffixes' start positions in sorted order,
so all occurrences of a token sequence form one contiguous range, found by bisection whatever the
corpus size. Building it costs O(n log n) (prefix doubling with numpy sorts), so it is built once per
shard set and kept under a cache directory as a .npy named by a digest of the manifest's shard table
(files, token counts, sha256): re-tokenized shards get a new index, an unchanged set loads at once
(memory-mapped).

Documents never straddle shards and each ends with the manifest's `eos_id`. An occurrence must lie
inside one document: one that runs over an EOS into the next document is not a match.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shipyard.data.shards import open_shards
from shipyard.errors import DataError

# Part of the cache key: a change to what the cached array holds must not load an old one.
INDEX_VERSION = 1
# A suffix-array range this small is searched with one vectorised searchsorted instead of a Python
# bisection (each Python step costs about as much as comparing a few hundred tokens in numpy).
_SCAN = 256


@dataclass(frozen=True)
class Match:
    """One occurrence of a token sequence. Offsets are token positions within shard `shard` (its index
    in the manifest's shard list); the document (`document`: its index within the shard) is
    [doc_start, doc_end), its EOS included."""

    shard: int
    position: int
    length: int
    document: int
    doc_start: int
    doc_end: int


@dataclass(frozen=True)
class Found:
    """The occurrences of one token sequence: how many there are, and the first `limit` in corpus order."""

    count: int
    matches: tuple[Match, ...]


@dataclass(frozen=True)
class Span:
    """A maximal run of the selected tokens, [start, end) within them, that occurs in the shards."""

    start: int
    end: int
    count: int
    matches: tuple[Match, ...]


@dataclass(frozen=True)
class DocumentText:
    """A matched document's text; text[start:end] is the matched tokens' text (to highlight)."""

    text: str
    start: int
    end: int


def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """The suffix array of `tokens` (int64 start positions, suffixes in lexicographic order; a suffix
    sorts before any longer one it is a prefix of), by prefix doubling: after round k every suffix is
    ranked by its first 2^k tokens, so log2(longest repeat) rounds of one argsort each suffice."""
    n = int(tokens.size)
    if n == 0:
        return np.zeros(0, np.int64)
    rank = np.unique(tokens, return_inverse=True)[1].astype(np.int64).reshape(-1)  # dense: ranks < n
    width = 1
    while True:
        # second key: the rank `width` tokens on (0 past the end, so a shorter suffix sorts first)
        second = np.zeros(n, np.int64)
        second[: n - width] = rank[width:] + 1
        key = rank * (n + 1) + second  # < n * (n + 1): no overflow below 3e9 tokens
        order = np.argsort(key)
        ranked = key[order]
        rank[order] = np.concatenate(([0], np.cumsum(ranked[1:] != ranked[:-1])))
        if rank[order[-1]] == n - 1 or width >= n:  # every suffix apart
            return order.astype(np.int64)
        width *= 2


def shard_digest(manifest: dict) -> str:
    """What names a shard set's cached index: its shard table (a re-tokenized or changed shard has a
    new sha256 in the manifest, so it gets a new index; a copy of the same shards shares one)."""
    table = [[s["file"], s["tokens"], s["sha256"]] for s in manifest["shards"]]
    blob = json.dumps({"version": INDEX_VERSION, "dtype": manifest["dtype"], "shards": table})
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


@dataclass(frozen=True, eq=False)
class TraceIndex:
    """A shard set's tokens (all shards concatenated in manifest order) and their suffix array, with
    where each shard starts and where each document ends: what `find` and `spans` search."""

    shard_dir: str
    manifest: dict
    tokens: np.ndarray
    sa: np.ndarray
    shard_starts: np.ndarray  # int64, one per shard plus the total: shard k is tokens[starts[k]:starts[k+1]]
    ends: np.ndarray  # int64, sorted: every document's last position (its EOS, or a shard's last token)
    first_doc: np.ndarray  # int64 per shard: the index in `ends` of the shard's first document
    loose_ends: bool  # a shard does not end with EOS, so any occurrence may run over a document's end

    @property
    def eos_id(self) -> int:
        return int(self.manifest["eos_id"])

    def find(self, tokens: Sequence[int], limit: int = 20) -> Found:
        """Every occurrence of exactly `tokens` inside one document: the count, and the first `limit`
        occurrences in corpus order (shard, then position)."""
        query = self._query(tokens)
        lo, hi = 0, int(self.sa.size)
        for depth, token in enumerate(query):
            lo, hi = self._narrow(lo, hi, depth, token)
        return self._found(lo, hi, query, limit)

    def spans(self, tokens: Sequence[int], min_len: int = 4, limit: int = 3) -> list[Span]:
        """The maximal runs of at least `min_len` of the selected `tokens` that occur in the shards, in
        order, each with its count and first `limit` occurrences. As OLMoTrace does: the longest match
        starting at each token, less those inside an earlier one."""
        query = self._query(tokens)
        if min_len < 1:
            raise DataError(f"trace: min_len is {min_len}; expected a span length of at least 1 token")
        out, reach = [], 0
        for start in range(len(query)):
            length, lo, hi = self._longest(query, start)
            # kept spans start at or before `start`, so this one is inside one of them iff it ends by `reach`
            if length >= min_len and start + length > reach:
                reach = start + length
                found = self._found(lo, hi, query[start:reach], limit)
                out.append(Span(start, reach, found.count, found.matches))
        return out

    def document_tokens(self, match: Match) -> np.ndarray:
        """The tokens of the document `match` lies in, its EOS included."""
        base = int(self.shard_starts[match.shard])
        return self.tokens[base + match.doc_start : base + match.doc_end]

    def _query(self, tokens: Sequence[int]) -> list[int]:
        """The selected tokens as Python ints, checked: a non-empty 1-D sequence of ids in the vocabulary."""
        try:
            arr = np.asarray(tokens)
        except (TypeError, ValueError) as e:
            raise DataError(f"trace: the span is not a sequence of token ids ({e})") from e
        if arr.ndim != 1 or arr.size == 0:
            raise DataError(f"trace: the span has shape {arr.shape}; expected a non-empty list of token ids")
        if arr.dtype.kind not in "iu":
            raise DataError(f"trace: the span holds {arr.dtype} values; expected integer token ids")
        vocab = int(self.manifest["vocab_size"])
        bad = arr[(arr < 0) | (arr >= vocab)]
        if bad.size:
            raise DataError(f"trace: token id {int(bad[0])} is outside the shards' vocabulary [0, {vocab})")
        return [int(t) for t in arr]

    def _longest(self, query: list[int], start: int) -> tuple[int, int, int]:
        """The longest prefix of query[start:] that occurs inside a document: (length, its range in sa)."""
        lo, hi, length = 0, int(self.sa.size), 0
        for depth in range(len(query) - start):
            nlo, nhi = self._narrow(lo, hi, depth, query[start + depth])
            # a longer sequence occurs only where its prefix does, so the first miss ends the search
            prefix = query[start : start + depth + 1]
            if nlo == nhi or (self._may_cross(prefix) and not self._starts(nlo, nhi, prefix).size):
                break
            lo, hi, length = nlo, nhi, depth + 1
        return length, lo, hi

    def _narrow(self, lo: int, hi: int, depth: int, token: int) -> tuple[int, int]:
        """Of sa[lo:hi] (suffixes that agree on their first `depth` tokens, so sorted by the next one),
        the subrange whose token at `depth` is `token`."""
        if lo == hi:
            return lo, hi
        first = self._bound(lo, hi, depth, token, right=False)
        return first, self._bound(first, hi, depth, token, right=True)

    def _bound(self, lo: int, hi: int, depth: int, token: int, right: bool) -> int:
        """The first index in [lo, hi) whose token at `depth` is >= `token` (> with `right`)."""
        n = int(self.tokens.size)
        while hi - lo > _SCAN:
            mid = (lo + hi) // 2
            at = int(self.sa[mid]) + depth
            key = int(self.tokens[at]) if at < n else -1
            if key < token or (right and key == token):
                lo = mid + 1
            else:
                hi = mid
        at = np.asarray(self.sa[lo:hi]) + depth
        column = np.full(at.size, -1, np.int64)  # -1: the suffix ends before `depth`, so sorts first
        column[at < n] = self.tokens[at[at < n]]
        return lo + int(np.searchsorted(column, token, side="right" if right else "left"))

    def _starts(self, lo: int, hi: int, query: list[int]) -> np.ndarray:
        """The start positions in sa[lo:hi] (the occurrences of `query`) that lie inside one document."""
        starts = np.asarray(self.sa[lo:hi])
        if self._may_cross(query):
            last = self.ends[np.searchsorted(self.ends, starts)]
            starts = starts[last >= starts + len(query) - 1]
        return starts

    def _may_cross(self, query: list[int]) -> bool:
        """Whether an occurrence of `query` could run over a document's end: only if a document ends
        before its last token, which (every shard ending in EOS) needs an EOS in the query before it."""
        return self.loose_ends or self.eos_id in query[:-1]

    def _found(self, lo: int, hi: int, query: list[int], limit: int) -> Found:
        if limit < 0:
            raise DataError(f"trace: limit is {limit}; expected 0 or more matches to return")
        starts = self._starts(lo, hi, query)
        first = starts[:0] if limit == 0 else starts
        if limit and starts.size > limit:
            first = np.partition(starts, limit - 1)[:limit]  # the `limit` smallest without a full sort
        return Found(int(starts.size), tuple(self._match(int(p), len(query)) for p in np.sort(first)))

    def _match(self, at: int, length: int) -> Match:
        """The Match of an occurrence at `at` in the concatenated tokens."""
        shard = int(np.searchsorted(self.shard_starts, at, side="right")) - 1
        doc = int(np.searchsorted(self.ends, at))  # the first document end at or after `at`
        base = int(self.shard_starts[shard])
        start = int(self.ends[doc - 1]) + 1 if doc else 0
        return Match(
            shard=shard,
            position=at - base,
            length=length,
            document=doc - int(self.first_doc[shard]),
            doc_start=start - base,
            doc_end=int(self.ends[doc]) + 1 - base,
        )


def build_index(shard_dir: str | Path, cache_dir: str | Path) -> TraceIndex:
    """The trace index of a shard set: its suffix array loaded from `cache_dir` when this shard table
    was indexed before, else built and written there (atomically, as .npy) for the next start."""
    manifest, arrays = open_shards(shard_dir, verify=False)
    eos = manifest["eos_id"]
    if not isinstance(eos, int) or isinstance(eos, bool):
        raise DataError(f"token shards {shard_dir}: manifest eos_id is {eos!r}; expected a token id")
    # memory-mapped shards are copied once: the search reads tokens at random, all over the set
    parts = [np.asarray(a) for a in arrays]
    tokens = np.concatenate(parts) if parts else np.zeros(0, np.dtype(manifest["dtype"]))
    path = Path(cache_dir) / f"trace-{shard_digest(manifest)}.npy"
    sa = _load_cached(path, int(tokens.size))
    if sa is None:
        sa = suffix_array(tokens)
        _save_atomic(path, sa)
    return _index(str(shard_dir), manifest, tokens, sa)


def _index(shard_dir: str, manifest: dict, tokens: np.ndarray, sa: np.ndarray) -> TraceIndex:
    """A TraceIndex with its document ends found from the EOS positions."""
    sizes = [int(s["tokens"]) for s in manifest["shards"]]
    starts = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64))).astype(np.int64)
    lasts = starts[1:][np.asarray(sizes) > 0] - 1
    eos = np.flatnonzero(tokens == manifest["eos_id"]).astype(np.int64)
    # a shard's last token ends a document even without an EOS (the contract says it has one; a
    # shard set that breaks it must still not match across shards)
    ends = np.union1d(eos, lasts).astype(np.int64)
    loose = bool(lasts.size) and not bool(np.all(tokens[lasts] == manifest["eos_id"]))
    first_doc = np.searchsorted(ends, starts[:-1]).astype(np.int64)
    return TraceIndex(shard_dir, manifest, tokens, sa, starts, ends, first_doc, loose)


def _load_cached(path: Path, n: int) -> np.ndarray | None:
    """The cached suffix array (memory-mapped), or None when there is none or it is not one for n tokens
    (a file from an interrupted copy, or another version): then it is built again."""
    if not path.is_file():
        return None
    try:
        sa = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError):
        return None
    return sa if sa.shape == (n,) and sa.dtype == np.int64 else None


def _save_atomic(path: Path, sa: np.ndarray) -> None:
    """Write the suffix array via a temporary file and rename: a reader never sees half an index. A
    cache directory that cannot be written is ignored (the index is still served, just rebuilt at the
    next start), as the sha256 cache does."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, sa, allow_pickle=False)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def document_text(index: TraceIndex, match: Match, tokenizer) -> DocumentText:
    """The text of the document `match` lies in and the character range of the matched tokens in it.

    Character offsets come from decoding token prefixes, not from searching the text (the matched
    words may occur earlier in the document). With byte-level BPE a token may hold part of a UTF-8
    character; a prefix that ends inside one decodes to a replacement character, so each offset is
    where the decoded prefix stops agreeing with the text: the start rounds down and the end up to
    whole characters, and the highlight covers every byte of the match."""
    ids = [int(t) for t in index.document_tokens(match)]
    a = match.position - match.doc_start
    text = tokenizer.decode(ids)
    start = _agreement(tokenizer.decode(ids[:a]), text)
    upto = tokenizer.decode(ids[: a + match.length])
    end = _agreement(upto, text)
    if end < len(upto):  # the match ends inside a character: include it
        end += 1
    return DocumentText(text, start, min(max(end, start), len(text)))


def _agreement(prefix: str, text: str) -> int:
    """How many leading characters of `prefix` agree with `text`."""
    if text.startswith(prefix):
        return len(prefix)
    return len(os.path.commonprefix([prefix, text]))
