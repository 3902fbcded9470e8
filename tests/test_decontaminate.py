from data_fixtures import prose, write_jsonl

from shipyard.data.configs import DecontaminateConfig, ReadConfig
from shipyard.data.decontaminate import run_decontaminate
from shipyard.data.documents import ReadStats, read_documents

EVAL = [
    "Question: which planet in the solar system has the largest number of confirmed moons as of this year? Answer: Saturn.",
    "The quick brown fox jumps over the lazy dog while the farmer watches from the old wooden porch at sunset.",
]


def _train(tmp_path):
    texts = [prose(s) for s in range(20)]
    ids = [f"doc{i}" for i in range(20)]
    words = EVAL[1].split()
    # 13 consecutive eval words, with other case and punctuation: contaminated
    texts[3] = texts[3] + " " + " ".join(words[2:15]).upper() + "!"
    texts[7] = " ".join(w + "," for w in words[5:18]) + " " + texts[7]
    q = EVAL[0].split()
    texts[11] = texts[11][:200] + " " + " ".join(q[1:14]) + " " + texts[11][200:]
    # only 12 consecutive words: not contaminated
    texts[15] = texts[15] + " " + " ".join(words[:12]) + " and then something else entirely"
    return write_jsonl(tmp_path / "train.jsonl", texts, ids)


def test_drops_exactly_the_documents_with_a_planted_13gram(tmp_path):
    train = _train(tmp_path)
    ev = write_jsonl(tmp_path / "eval.jsonl", EVAL)
    cfg = DecontaminateConfig(eval_sets=(str(ev),))
    stats = run_decontaminate([str(train)], tmp_path / "out", cfg, ReadConfig(), workers=1)
    kept = {d.id for d in read_documents([tmp_path / "out"], ReadStats())}
    assert {f"doc{i}" for i in range(20)} - kept == {"doc3", "doc7", "doc11"}
    assert stats["contaminated_documents"] == 3 and stats["per_eval_set"] == {str(ev): 3}
    assert {e["id"] for e in stats["examples"]} == {"doc3", "doc7", "doc11"}
    assert all(len(e["ngram"].split()) == 13 for e in stats["examples"])


def test_report_mode_keeps_everything_and_counts(tmp_path):
    train = _train(tmp_path)
    ev1 = write_jsonl(tmp_path / "e1.jsonl", EVAL[:1])
    ev2 = write_jsonl(tmp_path / "e2.jsonl", EVAL[1:])
    cfg = DecontaminateConfig(eval_sets=(str(ev1), str(ev2)), mode="report")
    stats = run_decontaminate([str(train)], tmp_path / "out", cfg, ReadConfig(), workers=1)
    assert stats["documents_out"] == 20 and stats["dropped"] == {}
    assert stats["per_eval_set"] == {str(ev1): 1, str(ev2): 2}
