import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from shipyard.data.documents import ReadStats, check_bad_fraction, read_documents
from shipyard.errors import DataError

TEXTS = [
    "The first document.\nIt has two lines.",
    "Ünïcödé and   runs   of spaces\t\ttabs",
    "def f(x):\n    return x + 1\n",
]


def _jsonl_bytes(texts, field="text"):
    return "".join(json.dumps({field: t, "meta": i}) + "\n" for i, t in enumerate(texts)).encode()


def _write_all_formats(d):
    (d / "a.jsonl").write_bytes(_jsonl_bytes(TEXTS))
    (d / "a.jsonl.gz").write_bytes(gzip.compress(_jsonl_bytes(TEXTS)))
    (d / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl_bytes(TEXTS)))
    pq.write_table(pa.table({"text": TEXTS, "n": [1, 2, 3]}), d / "a.parquet", row_group_size=2)


def test_every_format_yields_the_same_documents(tmp_path):
    _write_all_formats(tmp_path)
    per_file = {}
    for name in ("a.jsonl", "a.jsonl.gz", "a.jsonl.zst", "a.parquet"):
        stats = ReadStats()
        docs = list(read_documents([tmp_path / name], stats))
        per_file[name] = [d.text for d in docs]
        assert stats.bad_total == 0 and stats.documents == 3
        assert all(d.source == str(tmp_path / name) for d in docs)
        assert len({d.id for d in docs}) == 3
    assert all(texts == TEXTS for texts in per_file.values())


def test_txt_and_directories(tmp_path):
    (tmp_path / "sub").mkdir()
    for i, t in enumerate(TEXTS):
        (tmp_path / "sub" / f"{i}.txt").write_text(t)
    (tmp_path / "sub" / "ignored.bin").write_bytes(b"\x00\x01")
    stats = ReadStats()
    docs = list(read_documents([tmp_path / "sub"], stats))
    assert [d.text for d in docs] == TEXTS and stats.bad_total == 0


def test_bad_records_are_counted_with_file_and_line(tmp_path):
    lines = [
        json.dumps({"text": "good one"}),
        "{not json",
        json.dumps({"body": "no text field"}),
        json.dumps({"text": 7}),
        json.dumps({"text": "good two"}),
    ]
    raw = ("\n".join(lines) + "\n").encode() + b'{"text": "bad \xff utf8"}\n' + b'{"text": "lone \\ud800"}\n'
    (tmp_path / "b.jsonl").write_bytes(raw)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bin.txt").write_bytes(b"abc\x00def")
    stats = ReadStats()
    docs = list(read_documents([tmp_path / "b.jsonl", tmp_path / "empty.txt", tmp_path / "bin.txt"], stats))
    assert [d.text for d in docs] == ["good one", "good two"]
    assert stats.bad == {
        "not valid JSON": 1,
        "missing or non-string field 'text'": 2,
        "invalid UTF-8": 1,
        "lone surrogate (text not encodable as UTF-8)": 1,
        "empty file": 1,
        "binary file": 1,
    }
    assert f"{tmp_path / 'b.jsonl'}:2: not valid JSON" in stats.examples
    with pytest.raises(DataError, match="7 of 9 records were bad"):
        check_bad_fraction(stats, 0.5, "read")
    check_bad_fraction(stats, 0.8, "read")  # within the allowed fraction: no error


@pytest.mark.parametrize("name", ["t.jsonl.gz", "t.jsonl.zst", "t.parquet"])
def test_truncated_files_keep_what_was_readable(tmp_path, name):
    texts = [f"document number {i} " * 20 for i in range(2000)]
    whole = tmp_path / ("whole_" + name)
    if name.endswith(".gz"):
        whole.write_bytes(gzip.compress(_jsonl_bytes(texts)))
    elif name.endswith(".zst"):
        whole.write_bytes(zstandard.ZstdCompressor().compress(_jsonl_bytes(texts)))
    else:
        pq.write_table(pa.table({"text": texts}), whole, row_group_size=100)
    data = whole.read_bytes()
    cut = tmp_path / name
    cut.write_bytes(data[: len(data) // 2])
    stats = ReadStats()
    docs = list(read_documents([cut], stats))
    assert stats.bad_total == 1
    assert "truncated or corrupt" in next(iter(stats.bad)) or "unreadable parquet" in next(iter(stats.bad))
    assert len(docs) < len(texts)
    assert all(d.text == texts[i] for i, d in enumerate(docs))


def test_missing_input_and_unsupported_type(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        list(read_documents([tmp_path / "nope.jsonl"], ReadStats()))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(DataError, match="unsupported file type"):
        list(read_documents([tmp_path / "x.csv"], ReadStats()))


def test_parquet_missing_column(tmp_path):
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "c.parquet")
    stats = ReadStats()
    assert list(read_documents([tmp_path / "c.parquet"], stats)) == []
    assert stats.bad == {"missing column 'text'": 1}
    docs = list(read_documents([tmp_path / "c.parquet"], ReadStats(), text_field="body"))
    assert [d.text for d in docs] == ["x"]


def test_multi_frame_zstd(tmp_path):
    c = zstandard.ZstdCompressor()
    (tmp_path / "m.jsonl.zst").write_bytes(
        c.compress(_jsonl_bytes(TEXTS[:2])) + c.compress(_jsonl_bytes(TEXTS[2:]))
    )
    stats = ReadStats()
    assert [d.text for d in read_documents([tmp_path / "m.jsonl.zst"], stats)] == TEXTS
    assert stats.bad_total == 0


def test_stdlib_corpus_documents(tmp_path, capsys):
    from shipyard.cli.main import main
    from shipyard.data.stdlib import split_of

    out = tmp_path / "stdlib"
    assert main(["data", "stdlib", "--out", str(out)]) == 0
    stats = json.loads((out / "stats.json").read_text())
    assert (
        stats["train"]["documents"] > 300
        and 0 < stats["validation"]["documents"] < stats["train"]["documents"] / 10
    )
    docs = list(read_documents([out / "validation.jsonl"], ReadStats()))
    assert docs and all(
        split_of(d.text and json.loads((out / "validation.jsonl").read_text().splitlines()[0])["id"][7:])
        == "validation"
        for d in docs[:1]
    )
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".stdlib.")]  # no temporary left behind
    # a second run refuses to overwrite, in one line
    capsys.readouterr()
    assert main(["data", "stdlib", "--out", str(out)]) == 3
    assert "already exists" in capsys.readouterr().err


def test_work_units_read_exactly_the_documents_of_whole_files(tmp_path, monkeypatch):
    from shipyard.data import documents

    monkeypatch.setattr(documents, "MIN_UNIT_BYTES", 2000)
    texts = [f"document {i} " + "word " * (i % 50) for i in range(400)]
    lines = [json.dumps({"text": t}) for t in texts]
    lines[17] = "{broken"
    lines.insert(30, "")  # blank lines are skipped, but still counted for line numbers
    (tmp_path / "big.jsonl").write_text("\n".join(lines) + "\n")
    pq.write_table(pa.table({"text": texts}), tmp_path / "big.parquet", row_group_size=40)
    for i in range(30):
        (tmp_path / f"small{i:02d}.txt").write_text(texts[i] * 20)
    units = documents.plan_units([tmp_path])
    kinds = {u.kind for u in units}
    assert {"jsonl_range", "parquet_groups", "files"} <= kinds and len(units) > 10
    whole_stats, unit_stats = ReadStats(), ReadStats()
    whole = [d for p in documents.expand_inputs([tmp_path]) for d in documents.read_file(p, whole_stats)]
    by_unit = [d for u in units for d in documents.read_unit(u, unit_stats)]
    assert by_unit == whole and len(whole) == 399 + 400 + 30
    assert unit_stats.bad == whole_stats.bad == {"not valid JSON": 1}
    assert f"{tmp_path / 'big.jsonl'}:18: not valid JSON" in unit_stats.examples
    assert (
        by_unit[200].id == f"{tmp_path / 'big.jsonl'}:203"
    )  # text 201, after one blank line: global line numbers
    assert any(d.id == f"{tmp_path / 'big.parquet'}#123" and d.text == texts[123] for d in by_unit)
