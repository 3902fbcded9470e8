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
