"""browse/trace.py: exact n-gram matches of a selected span in real token shards (tokenizer trained and
documents tokenized by the real stages), checked against a brute-force scan of the shards."""

from __future__ import annotations

import json
import shutil
from dataclasses import FrozenInstanceError
from pathlib import Path

import numpy as np
import pytest
from data_fixtures import prose, write_jsonl

from shipyard.browse import trace
from shipyard.browse.trace import Match, build_index, document_text
from shipyard.data.configs import ReadConfig, TokenizeConfig, TokenizerTrainConfig
from shipyard.data.hashcache import file_sha256
from shipyard.data.shards import open_shards
from shipyard.data.tokenize import run_tokenize
from shipyard.data.tokenizer import load_tokenizer, run_tokenizer_train
from shipyard.errors import DataError

# Multi-byte characters, so some tokens of the byte-level BPE hold part of a character.
UNICODE_DOC = "Kabel lodor 日本語 mifin, ünïcödé 🙂 pegat zumon. Ravix 日本 tolis."
DIGITS = "0123456789"  # the corpus has no digits: their tokens occur nowhere


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(shard dir, tokenizer, documents' texts in shard order, a built index) for 40 prose documents and
    one with multi-byte characters, in shards of about 3000 tokens (several shards)."""
    d = tmp_path_factory.mktemp("trace")
    texts = [prose(s, words=120) for s in range(40)] + [UNICODE_DOC]
    docs = write_jsonl(d / "docs.jsonl", texts)
    run_tokenizer_train([str(docs)], d / "tok", TokenizerTrainConfig(vocab_size=400), ReadConfig())
    cfg = TokenizeConfig(shard_tokens=3000)
    run_tokenize([str(docs)], d / "shards", d / "tok", cfg, ReadConfig(), workers=1)
    return d / "shards", load_tokenizer(d / "tok"), texts, build_index(d / "shards", d / "cache")


def shard_arrays(shard_dir: Path) -> tuple[list[np.ndarray], int]:
    manifest, arrays = open_shards(shard_dir, verify=False)
    return [np.asarray(a, np.int64) for a in arrays], manifest["eos_id"]


def brute(shard_dir: Path, query: list[int]) -> list[Match]:
    """Every occurrence of `query` inside one document, by comparing it at every position of every shard."""
    shards, eos = shard_arrays(shard_dir)
    out, m = [], len(query)
    for k, arr in enumerate(shards):
        if arr.size < m:
            continue
        windows = np.lib.stride_tricks.sliding_window_view(arr, m)
        ends = np.flatnonzero(arr == eos)
        for p in np.flatnonzero((windows == np.asarray(query)).all(axis=1)):
            if (arr[p : p + m - 1] == eos).any():  # runs over a document's EOS into the next one
                continue
            doc = int(np.searchsorted(ends, p))
            start = int(ends[doc - 1]) + 1 if doc else 0
            out.append(Match(k, int(p), m, doc, start, int(ends[doc]) + 1))
    return out


def crossing_count(shard_dir: Path, query: list[int]) -> int:
    """Occurrences of `query` anywhere in a shard, document ends or not."""
    shards, _ = shard_arrays(shard_dir)
    q = np.asarray(query)
    return sum(
        int((np.lib.stride_tricks.sliding_window_view(a, len(q)) == q).all(axis=1).sum())
        for a in shards
        if a.size >= len(q)
    )


def test_find_is_every_occurrence_inside_a_document(corpus):
    shard_dir, _, _, index = corpus
    shards, eos = shard_arrays(shard_dir)
    rng = np.random.default_rng(0)
    queries = []
    for length in (1, 2, 3, 5, 8, 12):
        for _ in range(4):
            k = int(rng.integers(len(shards)))
            p = int(rng.integers(shards[k].size - length))
            queries.append(shards[k][p : p + length].tolist())
    for k in (0, len(shards) - 1):  # around a document end: ending with EOS, and running over it
        e = int(np.flatnonzero(shards[k] == eos)[2])
        queries += [shards[k][e - 3 : e + 1].tolist(), shards[k][e - 2 : e + 3].tolist()]
    queries.append([eos, eos])
    crossed = 0
    for q in queries:
        want = brute(shard_dir, q)
        got = index.find(q, limit=10**9)
        assert got.count == len(want) and list(got.matches) == want, q
        crossed += crossing_count(shard_dir, q) - len(want)
    assert crossed > 0  # some occurrences ran over a document end and were left out


def test_find_limits_the_matches_but_counts_all(corpus):
    shard_dir, _, _, index = corpus
    shards, _ = shard_arrays(shard_dir)
    common = [int(np.bincount(shards[0]).argmax())]
    got, want = index.find(common), brute(shard_dir, common)
    assert got.count == len(want) > 20
    assert list(got.matches) == want[:20]  # the first ones in corpus order
    assert index.find(common, limit=0).matches == ()
    with pytest.raises(FrozenInstanceError):
        got.matches[0].position = 0


def test_spans_are_the_maximal_runs_that_occur(corpus):
    shard_dir, tok, _, index = corpus
    shards, eos = shard_arrays(shard_dir)
    junk = tok.encode(DIGITS, add_special_tokens=False).ids
    assert crossing_count(shard_dir, junk[:1]) == 0
    a, b = shards[0][40:52].tolist(), shards[-1][7:16].tolist()  # from two documents in two shards
    assert eos not in a + b
    selected = a + junk + b
    spans = index.spans(selected)
    assert [(s.start, s.end) for s in spans] == [(0, len(a)), (len(a) + len(junk), len(selected))]
    for s, (k, p) in zip(spans, [(0, 40), (len(shards) - 1, 7)]):
        want = brute(shard_dir, selected[s.start : s.end])
        assert s.count == len(want) and list(s.matches) == want[:3]
        assert any((m.shard, m.position) == (k, p) for m in want)
    # maximal: a token more on either side occurs nowhere
    for s in spans:
        if s.start:
            assert not brute(shard_dir, selected[s.start - 1 : s.end])
        if s.end < len(selected):
            assert not brute(shard_dir, selected[s.start : s.end + 1])
    assert [(s.start, s.end) for s in index.spans(selected, min_len=len(b) + 1)] == [(0, len(a))]
    assert index.spans(junk) == []


def test_spans_agree_with_a_brute_force_longest_match(corpus):
    shard_dir, _, _, index = corpus
    shards, _ = shard_arrays(shard_dir)
    # 6-token pieces of different documents glued together: the longest matches stop at or near a seam
    selected = [t for k, p in [(0, 50), (1, 900), (0, 1700), (1, 20)] for t in shards[k][p : p + 6].tolist()]
    longest = []
    for i in range(len(selected)):
        n = 0
        while i + n < len(selected) and brute(shard_dir, selected[i : i + n + 1]):
            n += 1
        longest.append(n)
    want, reach = [], 0
    for i, n in enumerate(longest):
        if n >= 4 and i + n > reach:
            want.append((i, i + n))
            reach = i + n
    assert [(s.start, s.end) for s in index.spans(selected)] == want


def test_the_index_is_cached_and_rebuilt_when_a_shard_changes(corpus, tmp_path, monkeypatch):
    shard_dir, _, _, _ = corpus
    built = []
    real = trace.suffix_array
    monkeypatch.setattr(trace, "suffix_array", lambda tokens: built.append(tokens.size) or real(tokens))
    cache = tmp_path / "cache"
    first = build_index(shard_dir, cache)
    (file,) = cache.glob("trace-*.npy")
    stamp = file.stat().st_mtime_ns
    again = build_index(shard_dir, cache)
    assert len(built) == 1 and file.stat().st_mtime_ns == stamp  # loaded, not rebuilt
    assert isinstance(again.sa, np.memmap) and np.array_equal(again.sa, first.sa)
    assert not list(cache.glob(".*"))  # no temporary file left behind

    # change a token of shard 0 (and its manifest entry, as re-tokenizing would): a new index
    changed = tmp_path / "changed"
    shutil.copytree(shard_dir, changed)
    manifest = json.loads((changed / "manifest.json").read_text())
    name = manifest["shards"][0]["file"]
    tokens = np.load(changed / name)
    query = tokens[100:106].tolist()
    tokens[103] = tokens[103] + 1 if tokens[103] + 1 != manifest["eos_id"] else tokens[103] + 2
    np.save(changed / name, tokens)
    manifest["shards"][0]["sha256"] = file_sha256(changed / name)
    (changed / "manifest.json").write_text(json.dumps(manifest))
    index = build_index(changed, cache)
    assert len(built) == 2 and len(list(cache.glob("trace-*.npy"))) == 2
    assert index.find(query).count == len(brute(changed, query)) == first.find(query).count - 1


def test_document_text_highlights_the_matched_text(corpus):
    shard_dir, tok, texts, index = corpus
    manifest, _ = open_shards(shard_dir, verify=False)
    shards, _ = shard_arrays(shard_dir)
    q = shards[1][30:37].tolist()
    for m in index.find(q).matches:
        doc = document_text(index, m, tok)
        ids = index.document_tokens(m).tolist()
        assert doc.text[doc.start : doc.end] == tok.decode(ids[m.position - m.doc_start :][: m.length])
        before = sum(s["documents"] for s in manifest["shards"][: m.shard])
        assert doc.text == texts[before + m.document]


def byte_level_bytes(tok, ids: list[int]) -> bytes:
    """The bytes a byte-level BPE's tokens stand for (GPT-2's byte <-> printable character table)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return bytes(chars[c] for i in ids for c in tok.id_to_token(i))


def test_document_text_rounds_a_split_character_outward(corpus):
    _, tok, _, index = corpus
    ids = tok.encode(UNICODE_DOC, add_special_tokens=False).ids

    def inside_a_character(k: int) -> bool:  # ids[:k] ends with part of a character
        return byte_level_bytes(tok, ids[:k]).decode("utf-8", "ignore") != tok.decode(ids[:k])

    cuts = [k for k in range(1, len(ids)) if inside_a_character(k)]
    assert len(cuts) > 5
    pairs = [(a, b) for a in range(len(ids)) for b in range(a + 1, min(a + 4, len(ids)))]
    pairs = [(a, b) for a, b in pairs if a in cuts or b in cuts]
    assert any(a in cuts and b in cuts for a, b in pairs)
    for a, b in pairs:
        (m,) = [m for m in index.find(ids[a:b]).matches if m.position - m.doc_start == a]
        doc = document_text(index, m, tok)
        assert doc.text == UNICODE_DOC
        head, upto = byte_level_bytes(tok, ids[:a]), byte_level_bytes(tok, ids[:b])
        assert doc.start == len(head.decode("utf-8", "ignore")), (a, b)  # down to a character's start
        assert doc.end == len(upto.decode("utf-8", "replace")), (a, b)  # up to the end of the last one
        assert byte_level_bytes(tok, ids[a:b]) in doc.text[doc.start : doc.end].encode()


def test_bad_input_is_one_clear_error(corpus, tmp_path):
    _, _, _, index = corpus
    (tmp_path / "notes.txt").write_text("not shards")
    with pytest.raises(
        DataError, match=r"no manifest\.json \(expected the output of `shipyard data tokenize`\)"
    ):
        build_index(tmp_path, tmp_path / "cache")
    vocab = index.manifest["vocab_size"]
    for bad, says in [
        ([], "expected a non-empty list of token ids"),
        ([[1, 2]], "expected a non-empty list of token ids"),
        (["a"], "expected integer token ids"),
        ([1.5], "expected integer token ids"),
        ([3, vocab], f"token id {vocab} is outside the shards' vocabulary"),
        ([-1], "token id -1 is outside"),
    ]:
        with pytest.raises(DataError, match=says):
            index.find(bad)
        with pytest.raises(DataError, match=says):
            index.spans(bad)
    with pytest.raises(DataError, match="min_len is 0"):
        index.spans([1, 2], min_len=0)
