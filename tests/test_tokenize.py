import json

import numpy as np
import pytest
from data_fixtures import prose, write_jsonl

from shipyard.data.configs import ReadConfig, TokenizeConfig, TokenizerTrainConfig
from shipyard.data.shards import open_shards, verify_shards
from shipyard.data.tokenize import encode_document, run_tokenize
from shipyard.data.tokenizer import load_tokenizer, run_tokenizer_train, special_token_ids
from shipyard.errors import DataError

TRICKY = [
    "def f(x):\n\tif x:\n\t\treturn   x  # trailing   \n\n\n",
    "Ünïcödé — 日本語のテキスト 🙂🚀 \u00a0\u200b e\u0301 \r\n\r\n",
    "    four spaces, then tabs\t\t\tand a literal <|eos|> and <|user|> in text",
    "",
    " leading space and trailing newline\n",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    from shipyard.data.stdlib import stdlib_files

    code = [p.read_text() for _, p in stdlib_files()[:25]]
    texts = code + [prose(s) for s in range(30)] + TRICKY[:3]
    return write_jsonl(d / "docs.jsonl", texts), texts


@pytest.fixture(scope="module")
def tokenizer_dir(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "tok"
    run_tokenizer_train([str(corpus[0])], out, TokenizerTrainConfig(vocab_size=600), ReadConfig())
    return out


def test_tokenizer_round_trips_exactly(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    assert tok.get_vocab_size() == 600
    for text in TRICKY:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
    ids = special_token_ids(tokenizer_dir, tok)
    assert ids == {"bos_token": 0, "eos_token": 1, "pad_token": 2}
    # text that looks like a special token stays text: it can't fake a document boundary
    assert ids["eos_token"] not in tok.encode(TRICKY[2], add_special_tokens=False).ids
    cfg = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|eos|>" and "<|assistant|>" in cfg["additional_special_tokens"]


def test_transformers_loads_the_tokenizer(tokenizer_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ours = load_tokenizer(tokenizer_dir)
    assert hf.eos_token_id == 1 and hf.bos_token_id == 0
    assert hf(TRICKY[0], add_special_tokens=False)["input_ids"] == ours.encode(TRICKY[0]).ids


@pytest.mark.parametrize("workers", [1, 2])
def test_shards_equal_encode_of_documents_joined_by_eos(
    corpus, tokenizer_dir, tmp_path, workers, monkeypatch
):
    from shipyard.data import documents

    monkeypatch.setattr(documents, "MIN_UNIT_BYTES", 50_000)  # several work units
    path, texts = corpus
    assert len(documents.plan_units([path])) > 3
    out = tmp_path / "shards"
    cfg = TokenizeConfig(shard_tokens=20_000, batch_documents=7)
    stats = run_tokenize([str(path)], out, tokenizer_dir, cfg, ReadConfig(), workers=workers)
    manifest, arrays = open_shards(out)
    tok = load_tokenizer(tokenizer_dir)
    expected = np.concatenate([encode_document(tok, t, eos_id=1) for t in texts])
    assert np.array_equal(np.concatenate(arrays), expected)
    assert manifest["dtype"] == "uint16" and all(a.dtype == np.uint16 for a in arrays)
    assert len(arrays) > 1 and stats["shards"] == len(arrays)
    assert all(a[-1] == 1 for a in arrays)  # documents never straddle a shard
    assert sum(s["documents"] for s in manifest["shards"]) == len(texts) == manifest["documents"]
    assert manifest["sources"][str(path)]["tokens"] == expected.size
    assert (out / "tokenizer.json").is_file()
    verify_shards(out)


def test_flipped_byte_is_detected(corpus, tokenizer_dir, tmp_path):
    out = tmp_path / "shards"
    run_tokenize([str(corpus[0])], out, tokenizer_dir, TokenizeConfig(), ReadConfig(), workers=1)
    shard = out / "shard-00000.npy"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match="shard-00000.npy is corrupt"):
        verify_shards(out)


def test_add_bos_and_uint32_for_large_vocab(tmp_path):
    from shipyard.data.shards import token_dtype

    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    src = write_jsonl(tmp_path / "d.jsonl", ["hello world", "again"])
    tok_dir = tmp_path / "tok"
    run_tokenizer_train([str(src)], tok_dir, TokenizerTrainConfig(vocab_size=300), ReadConfig())
    run_tokenize([str(src)], tmp_path / "s", tok_dir, TokenizeConfig(add_bos=True), ReadConfig(), workers=1)
    _, (arr,) = open_shards(tmp_path / "s")
    assert arr[0] == 0 and list(arr).count(0) == 2 and list(arr).count(1) == 2


def test_bad_tokenizer_path_is_one_line(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path)


def test_tokenizer_sample_is_reproducible_and_bounded(corpus, tmp_path):
    path, texts = corpus
    cfg = TokenizerTrainConfig(vocab_size=400, sample_fraction=0.5)
    a = run_tokenizer_train([str(path)], tmp_path / "a", cfg, ReadConfig())
    b = run_tokenizer_train([str(path)], tmp_path / "b", cfg, ReadConfig())
    assert a["tokenizer_sha256"] == b["tokenizer_sha256"]  # same sample, same merges
    assert 0.25 * len(texts) < a["documents_out"] < 0.75 * len(texts)
    capped = run_tokenizer_train(
        [str(path)], tmp_path / "c", TokenizerTrainConfig(vocab_size=400, sample_bytes=20_000), ReadConfig()
    )
    assert capped["bytes_out"] <= 20_000 and capped["documents_out"] < len(texts)


def test_shard_tasks_cut_where_one_writer_would(corpus, tokenizer_dir, tmp_path, monkeypatch):
    """Several units, shards far smaller and far larger than a unit, two workers: every shard and the
    manifest's shard table equal what one ShardWriter fed a document at a time writes, and the stage
    leaves no scratch files."""
    from shipyard.data import documents
    from shipyard.data.documents import ReadStats, read_documents
    from shipyard.data.shards import ShardWriter

    monkeypatch.setattr(documents, "MIN_UNIT_BYTES", 20_000)
    path, _ = corpus
    tok = load_tokenizer(tokenizer_dir)
    eos = special_token_ids(tokenizer_dir, tok)["eos_token"]
    docs = [encode_document(tok, d.text, eos) for d in read_documents([path], ReadStats())]
    for shard_tokens in (997, 60_000, 10**8):
        out = tmp_path / f"s{shard_tokens}"
        run_tokenize(
            [str(path)], out, tokenizer_dir, TokenizeConfig(shard_tokens=shard_tokens), ReadConfig(), 2
        )
        ref = tmp_path / f"ref{shard_tokens}"
        ref.mkdir()
        writer = ShardWriter(ref, np.dtype(np.uint16), shard_tokens)
        for ids in docs:
            writer.write(np.asarray(ids), 1)
        want = writer.close()
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["shards"] == want and (len(want) > 3 or shard_tokens > 997)
        for s in want:
            assert (out / s["file"]).read_bytes() == (ref / s["file"]).read_bytes()
        assert not (out / "_tokens").exists()
