import json

import numpy as np
import pytest
from data_fixtures import mutate, prose, shingle_jaccard, write_jsonl

from shipyard.data.configs import DedupConfig, ReadConfig
from shipyard.data.dedup import hash_params, run_dedup, signature
from shipyard.data.documents import ReadStats, read_documents


def _corpus():
    """30 originals; 10 near copies (J≈0.9), 10 far copies (J≈0.4), 5 exact copies modulo case/space."""
    texts, ids, expect_removed = [], [], set()
    originals = [prose(seed) for seed in range(30)]
    for i, t in enumerate(originals):
        texts.append(t)
        ids.append(f"orig{i}")
    for i in range(10):
        texts.append(mutate(originals[i], 0.01, seed=100 + i))
        ids.append(f"near{i}")
        expect_removed.add(f"near{i}")
    for i in range(10, 20):
        texts.append(mutate(originals[i], 0.10, seed=100 + i))
        ids.append(f"far{i}")
    for i in range(20, 25):
        texts.append("  " + originals[i].upper().replace(" ", "\n  "))
        ids.append(f"exact{i}")
        expect_removed.add(f"exact{i}")
    return texts, ids, expect_removed, originals


def test_minhash_estimates_jaccard():
    cfg = DedupConfig()
    a, b = hash_params(cfg.num_perm, cfg.seed)
    base = prose(7, 600)
    for fraction in (0.01, 0.03, 0.08):
        other = mutate(base, fraction, 3)
        est = float((signature(base, cfg, a, b) == signature(other, cfg, a, b)).mean())
        assert abs(est - shingle_jaccard(base, other)) < 0.1


def test_dedup_removes_near_and_exact_duplicates_keeps_distant(tmp_path):
    texts, ids, expect_removed, originals = _corpus()
    for i in range(10):
        assert shingle_jaccard(originals[i], texts[30 + i]) > 0.85
        assert shingle_jaccard(originals[10 + i], texts[40 + i]) < 0.5
    src = write_jsonl(tmp_path / "in.jsonl", texts, ids)
    stats = run_dedup([str(src)], tmp_path / "out", DedupConfig(), ReadConfig(), workers=1)
    kept = [d.id for d in read_documents([tmp_path / "out"], ReadStats())]
    assert set(ids) - set(kept) == expect_removed
    assert kept == [i for i in ids if i not in expect_removed]  # input order preserved
    assert stats["dropped"] == {"exact_duplicate": 5, "fuzzy_duplicate": 10}
    pairs = {(e["removed"], e["kept"]) for e in stats["removed_examples"]}
    assert ("near3", "orig3") in pairs and ("exact20", "orig20") in pairs
    on_disk = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert on_disk["documents_in"] == 55 and on_disk["documents_out"] == 40


def test_cluster_keeps_first_in_input_order(tmp_path):
    base = prose(1)
    near = mutate(base, 0.01, 5)
    src = write_jsonl(tmp_path / "in.jsonl", [near, prose(2), base], ["near", "other", "base"])
    run_dedup([str(src)], tmp_path / "out", DedupConfig(exact=False), ReadConfig(), workers=1)
    assert [d.id for d in read_documents([tmp_path / "out"], ReadStats())] == ["near", "other"]


def test_threshold_and_fuzzy_switch(tmp_path):
    texts, ids, _, _ = _corpus()
    src = write_jsonl(tmp_path / "in.jsonl", texts, ids)
    loose = run_dedup(
        [str(src)], tmp_path / "a", DedupConfig(threshold=0.3, bands=64, rows=2), ReadConfig(), workers=1
    )
    assert loose["dropped"]["fuzzy_duplicate"] == 20  # with bands that catch J≈0.4 the far copies count too
    off = run_dedup([str(src)], tmp_path / "b", DedupConfig(fuzzy=False), ReadConfig(), workers=1)
    assert off["dropped"] == {"exact_duplicate": 5, "fuzzy_duplicate": 0}


def test_bands_rows_must_fit_num_perm():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="exceeds num_perm"):
        DedupConfig(num_perm=64, bands=16, rows=8)


def test_same_output_with_two_worker_processes(tmp_path, monkeypatch):
    from shipyard.data import documents

    monkeypatch.setattr(documents, "MIN_UNIT_BYTES", 20_000)  # several work units, so workers share them
    texts, ids, _, _ = _corpus()
    src = write_jsonl(tmp_path / "in.jsonl", texts * 3, [f"{i}-{k}" for k in range(3) for i in ids])
    one = run_dedup([str(src)], tmp_path / "one", DedupConfig(), ReadConfig(), workers=1)
    two = run_dedup([str(src)], tmp_path / "two", DedupConfig(), ReadConfig(), workers=2)
    assert one["documents_out"] == two["documents_out"] == 40
    assert len(one["parts"]) > 3 and one["parts"] == two["parts"]
    for part in one["parts"]:
        assert (tmp_path / "one" / part).read_bytes() == (tmp_path / "two" / part).read_bytes()


def test_empty_documents_are_not_fuzzy_matched():
    cfg = DedupConfig()
    a, b = hash_params(cfg.num_perm, cfg.seed)
    assert (signature("", cfg, a, b) == np.uint32(0xFFFFFFFF)).all()


def _chains_corpus(root, files=4, originals=60, seed=0):
    """Originals with chains of copies of copies (each a few words changed), exact copies and empty
    documents, shuffled across `files` input files: clusters span files, units and partitions."""
    import random

    rng = random.Random(seed)
    docs = [[] for _ in range(files)]
    for i in range(originals):
        text = prose(seed * 1000 + i, rng.randint(40, 300))
        docs[i % files].append((f"o{i}", text))
        for k in range(rng.randint(0, 4)):
            text = mutate(text, rng.choice([0.005, 0.01, 0.03, 0.1]), seed=1000 * i + k)
            docs[rng.randrange(files)].append((f"c{i}-{k}", text))
        if i % 7 == 0:
            docs[rng.randrange(files)].append((f"x{i}", "  " + text.upper()))
    docs[1 % files].append(("empty", ""))
    paths = []
    for f, part in enumerate(docs):
        rng.shuffle(part)
        paths.append(str(write_jsonl(root / f"in{f}.jsonl", [t for _, t in part], [d for d, _ in part])))
    return paths


def _reference(texts: list[str], ids: list[str], cfg: DedupConfig) -> dict:
    """Dedup in one process, as the stage did before it was distributed: every key and signature in
    memory, candidate pairs per band bucket (first member and predecessor), union-find."""
    from shipyard.data.dedup import exact_key

    a, b = hash_params(cfg.num_perm, cfg.seed)
    n = len(texts)
    sigs = np.stack([signature(t, cfg, a, b) for t in texts])
    kept, examples = np.ones(n, bool), []
    exact = fuzzy = candidates = similar_count = 0
    if cfg.exact:
        first = {}
        for i, t in enumerate(texts):
            j = first.setdefault(exact_key(t), i)
            if j != i:
                kept[i] = False
                exact += 1
                if len(examples) < cfg.max_examples // 2:
                    examples.append((i, j, 1.0))
    if cfg.fuzzy:
        idx = np.flatnonzero(kept & (sigs[:, 0] != 0xFFFFFFFF))
        pairs = set()
        for band in range(cfg.bands):
            buckets = {}
            for i in idx:
                buckets.setdefault(sigs[i, band * cfg.rows : (band + 1) * cfg.rows].tobytes(), []).append(
                    int(i)
                )
            for members in buckets.values():
                for pos in range(1, len(members)):
                    pairs.add((members[0], members[pos]))
                    pairs.add((members[pos - 1], members[pos]))
        candidates = len(pairs)
        parent = list(range(n))

        def find(x):
            while parent[x] != x:
                x = parent[x]
            return x

        edge_of = {}
        for i, j in sorted(pairs):
            s = float((sigs[i] == sigs[j]).mean())
            if s >= cfg.threshold:
                similar_count += 1
                edge_of[j] = (i, s)
                ri, rj = find(i), find(j)
                parent[max(ri, rj)] = min(ri, rj)
        for i in np.flatnonzero(kept):
            if find(int(i)) != i:
                kept[i] = False
                fuzzy += 1
                if len(examples) < cfg.max_examples and int(i) in edge_of:
                    examples.append((int(i), *edge_of[int(i)]))
    return {
        "kept": [ids[i] for i in np.flatnonzero(kept)],
        "dropped": {"exact_duplicate": exact, "fuzzy_duplicate": fuzzy},
        "candidate_pairs": candidates,
        "similar_pairs": similar_count,
        "removed_examples": [
            {"removed": ids[i], "kept": ids[j], "jaccard_estimate": round(s, 3)} for i, j, s in examples
        ],
    }


@pytest.mark.parametrize(
    "cfg",
    [
        DedupConfig(),
        DedupConfig(threshold=0.3, bands=64, rows=2, max_examples=7),
        DedupConfig(exact=False),
        DedupConfig(fuzzy=False, max_examples=5),
    ],
    ids=["default", "loose", "fuzzy-only", "exact-only"],
)
def test_the_shuffled_dedup_decides_as_one_process_does(tmp_path, monkeypatch, cfg):
    """Clusters spread over files, units and partitions: kept documents, counts and examples equal the
    in-memory reference for 1, 3 and the default number of partitions."""
    from shipyard.data import documents

    monkeypatch.setattr(documents, "MIN_UNIT_BYTES", 20_000)
    paths = _chains_corpus(tmp_path)
    docs = list(read_documents(paths, ReadStats()))
    want = _reference([d.text for d in docs], [d.id for d in docs], cfg)
    assert want["dropped"]["fuzzy_duplicate"] > 20 or not cfg.fuzzy  # the corpus has clusters to find
    results = {}
    for partitions in (1, 3, None):
        out = tmp_path / f"out-{partitions}"
        stats = run_dedup(paths, out, cfg, ReadConfig(), workers=1, partitions=partitions)
        assert len(stats["parts"]) > 8
        assert [d.id for d in read_documents([out], ReadStats())] == want["kept"]
        for key in ("dropped", "candidate_pairs", "similar_pairs", "removed_examples"):
            assert stats[key] == want[key], key
        assert sorted(p.name for p in out.iterdir()) == sorted(stats["parts"] + ["stats.json"])  # no scratch
        results[partitions] = {p: (out / p).read_bytes() for p in stats["parts"]}
    assert results[1] == results[3] == results[None]


def test_components_find_every_cluster_and_its_smallest_member():
    """Random graphs with long chains (many rounds) against a plain breadth-first search."""
    import random
    import tempfile

    from shipyard.data import components, shuffle

    rng = random.Random(5)
    nodes = [(u << 32) | k for u in range(3) for k in range(60)]
    edges = set()
    for _ in range(3):  # chains in shuffled order: the worst case for label propagation
        chain = rng.sample(nodes, 25)
        edges.update(zip(chain, chain[1:]))
    edges.update(tuple(rng.sample(nodes, 2)) for _ in range(30))
    neighbours = {}
    for x, y in edges:
        neighbours.setdefault(x, set()).add(y)
        neighbours.setdefault(y, set()).add(x)
    want, seen = set(), set()
    for start in neighbours:
        if start in seen:
            continue
        comp, todo = set(), [start]
        while todo:
            v = todo.pop()
            if v not in comp:
                comp.add(v)
                todo.extend(neighbours[v] - comp)
        seen |= comp
        want |= comp - {min(comp)}
    for partitions in (1, 4):
        with tempfile.TemporaryDirectory() as work:
            x = np.array([e[0] for e in edges], np.uint64)
            y = np.array([e[1] for e in edges], np.uint64)
            components.write_edges(f"{work}/in/0.bin", x, y, partitions)
            files = components.non_centres(work, [f"{work}/in/0.bin"], partitions, (3, 2), workers=1)
            got = {int(v) for g in range(2) for v in shuffle.gather(files, g, 2, components.NODE)["idx"]}
        assert got == want


@pytest.mark.slow
def test_the_driver_holds_nothing_per_document():
    """Dedup of 10k and 60k documents: the driver's peak RSS does not grow with the corpus. At 60k
    the signatures alone are 31 MB, over 20x the 1.5 MB of growth allowed (the in-memory dedup
    this replaced grew 107 MB from 20k to 100k documents)."""
    import subprocess
    import sys
    from pathlib import Path

    probe = Path(__file__).with_name("dedup_rss_probe.py")
    peaks = {}
    for n in (10_000, 60_000):
        out = subprocess.run([sys.executable, str(probe), str(n)], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        assert r["documents"] == n
        peaks[n] = r["peak_kib"] - r["before_kib"]
    signature_kib = 60_000 * DedupConfig().num_perm * 4 / 1024
    assert peaks[60_000] - peaks[10_000] < signature_kib / 20, peaks
