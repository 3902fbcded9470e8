"""Token shards read from a bucket (moto_server on 127.0.0.1) by byte ranges: the same batches as the
local copy, bit for bit (through a proxy that drops connections too), corruption and truncation caught,
and far fewer bytes fetched than the shards hold."""

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from s3_fixtures import SECRET_KEY, FaultProxy

from shipyard import storage
from shipyard.data import hashcache
from shipyard.data.loader import SequenceSource, build_loader
from shipyard.data.shards import ShardWriter, open_shards, verify_shards
from shipyard.errors import DataError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory):
    """Shards written by the real tokenize stage (BPE tokenizer, several shards)."""
    from hf_fixtures import tokenized_shards

    shards = tokenized_shards(tmp_path_factory.mktemp("bucket-loader"), documents=300, shard_tokens=2000)
    assert len(json.loads((shards / "manifest.json").read_text())["shards"]) >= 3
    return shards


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """Two shards of 600k random uint16 tokens (1.2 MB each), for counting the bytes a loader fetches."""
    path = tmp_path_factory.mktemp("big") / "shards"
    path.mkdir()
    tokens = np.random.default_rng(0).integers(0, 500, 1_200_000).astype(np.uint16)
    w = ShardWriter(path, np.dtype(np.uint16), 600_000)
    for i in range(0, tokens.size, 1000):
        w.write(tokens[i : i + 1000], 1)
    manifest = {"vocab_size": 512, "dtype": "uint16", "eos_id": 1, "shards": w.close(), "tokens": tokens.size}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def _batches(path, steps=range(6), verify=False, vocab=320, batch=8, seq=32):
    loader = build_loader(
        [str(path)], [1.0], seed=5, batch_size=batch, seq_len=seq, vocab_size=vocab, verify=verify
    )
    return [loader.rows(s) for s in steps]


def test_batches_from_a_bucket_equal_the_local_copy_through_dropped_connections(
    tokenized, bucket, s3_server, monkeypatch
):
    url = f"{bucket}/shards"
    storage.publish_dir(tokenized, url)
    local = _batches(tokenized)
    assert all(np.array_equal(a, b) for a, b in zip(local, _batches(url, verify=True), strict=True))

    import s3fs

    # botocore and s3fs retry by themselves; with theirs down to one try, what rides out the resets is
    # shipyard's retry of each ranged GET (RemoteArray reads through storage.RangeReader)
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    proxy = FaultProxy(s3_server.port, drop_every=4)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)  # a fresh client, through the proxy
    try:
        remote = _batches(url, steps=range(6, 12))
        assert proxy.dropped >= 3, proxy.dropped  # the reads did go through dropped connections
    finally:
        proxy.close()
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    assert all(np.array_equal(a, b) for a, b in zip(_batches(tokenized, range(6, 12)), remote, strict=True))


def test_remote_verify_is_cached_by_etag_and_catches_a_flipped_byte(tokenized, bucket, monkeypatch):
    url = f"{bucket}/shards"
    storage.publish_dir(tokenized, url)
    hashed = []
    real = hashcache.url_sha256
    monkeypatch.setattr(hashcache, "url_sha256", lambda u: hashed.append(u) or real(u))
    manifest = json.loads((tokenized / "manifest.json").read_text())
    n = len(manifest["shards"])
    open_shards(url, verify=True)
    open_shards(url, verify=True)  # a restart: sizes and ETags match the cache, nothing re-hashed
    assert len(hashed) == n

    # the same size, one bit different: the new ETag makes the cached digest stale
    name = manifest["shards"][1]["file"]
    data = bytearray(storage.read_bytes(f"{url}/{name}"))
    data[len(data) // 2] ^= 0x01
    storage.write_bytes(f"{url}/{name}", bytes(data))
    with pytest.raises(DataError) as e:
        open_shards(url, verify=True)
    assert str(e.value).count("\n") == 0
    assert f"token shards {url}: {name} is corrupt" in str(e.value)
    with pytest.raises(DataError, match=f"{name} is corrupt"):
        verify_shards(url)
    # open_shards re-hashed only the flipped shard; verify_shards trusts no cache and hashes them all
    assert len(hashed) == n + 1 + n and hashed[n] == f"{url}/{name}"


def test_truncated_missing_and_unlisted_remote_shards_are_refused(tokenized, bucket):
    url = f"{bucket}/shards"
    storage.publish_dir(tokenized, url)
    manifest = json.loads((tokenized / "manifest.json").read_text())
    name = manifest["shards"][0]["file"]
    whole = storage.read_bytes(f"{url}/{name}")
    storage.write_bytes(f"{url}/{name}", whole[:-2])
    with pytest.raises(
        DataError, match=rf"{name} is {len(whole) - 2} bytes, expected {len(whole)} .*truncated"
    ):
        SequenceSource(url, 32, 320, verify=False)
    storage.remove(f"{url}/{name}")
    with pytest.raises(DataError, match=f"{name} is missing"):
        SequenceSource(url, 32, 320)
    with pytest.raises(DataError, match="no manifest.json"):
        SequenceSource(f"{bucket}/nothing-here", 32, 320)


def test_a_few_batches_fetch_a_small_part_of_the_shards_and_scans_use_blocks(
    big, bucket, s3_server, monkeypatch
):
    url = f"{bucket}/big"
    storage.publish_dir(big, url)
    proxy = FaultProxy(s3_server.port)  # drops nothing: counts the bytes the server sends
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        remote = _batches(url, steps=range(3), vocab=512, seq=128)
        down = proxy.bytes_down
    finally:
        proxy.close()
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    assert all(
        np.array_equal(a, b) for a, b in zip(_batches(big, range(3), vocab=512, seq=128), remote, strict=True)
    )
    shard_bytes = sum(p.stat().st_size for p in big.glob("shard-*.npy"))
    rows_bytes = 3 * 8 * 129 * 2
    # 24 rows of 258 bytes, plus the manifest, headers and HTTP overhead: far below 2.4 MB of shards
    assert down < shard_bytes / 20, (down, shard_bytes)
    assert down > rows_bytes

    src = SequenceSource(url, 128, 512, verify=False)
    random_rows = [src[i] for i in (5000, 100, 7000, 20, 3000)]
    fetched = sum(a.requests for a in src.arrays) - 2  # less the header reads, one per shard
    assert fetched == 5  # a random row is one ranged GET of its own bytes, not a block
    for i in range(0, 2000):  # a scan: 256 KB of rows, a block (1 MiB) per request
        src[i]
    scan = sum(a.requests for a in src.arrays) - 2 - fetched
    assert scan <= 2, scan
    local = SequenceSource(big, 128, 512, verify=False)
    assert all(
        np.array_equal(r, local[i]) for r, i in zip(random_rows, (5000, 100, 7000, 20, 3000), strict=True)
    )
    assert np.array_equal(src[1999], local[1999]) and np.array_equal(src[4600], local[4600])
    # a whole shard in memory (the unigram baseline's bincount): 16 MiB ranged GETs, the same tokens
    assert np.array_equal(np.asarray(src.arrays[1]), local.arrays[1])


def test_a_forked_child_reads_rows_with_its_own_client(big, bucket):
    url = f"{bucket}/big"
    storage.publish_dir(big, url)
    src = SequenceSource(url, 128, 512, verify=False)
    want = SequenceSource(big, 128, 512, verify=False)[300]
    assert np.array_equal(src[300], want)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's s3fs client refuses to run here ("not fork-safe")
        try:
            os.write(w, np.asarray(src[300], np.int32).tobytes())
        finally:
            os._exit(0)
    os.close(w)
    got, deadline = b"", time.monotonic() + 60
    while time.monotonic() < deadline:  # a child stuck on the parent's client must fail, not hang
        if select.select([r], [], [], 1)[0]:
            if not (chunk := os.read(r, 65536)):
                break
            got += chunk
    else:
        os.kill(pid, 9)
    os.close(r)
    os.waitpid(pid, 0)
    assert np.array_equal(np.frombuffer(got, np.int32), want)


def _train(tokens: str, run_dir: Path, env: dict) -> tuple[list[float], str]:
    argv = [sys.executable, "-m", "shipyard.cli.main", "train", "tiny", f"data.train_tokens={tokens}"]
    argv += ["model.vocab_size=320", "data.seq_len=32", "train.steps=3", "train.logging.log_every=1"]
    argv += ["train.logging.progress=false", "train.logging.tensorboard=false", "--run-dir", str(run_dir)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r], done.stdout + done.stderr


@pytest.mark.slow
def test_training_from_bucket_shards_matches_the_local_copy(tokenized, bucket, tmp_path):
    url = f"{bucket}/shards"
    storage.publish_dir(tokenized, url)
    env = dict(os.environ)
    local, _ = _train(str(tokenized), tmp_path / "local", env)
    remote, out = _train(url, tmp_path / "remote", env)
    assert len(local) == 3 and remote == local
    # provenance names the bucket's shards, with the same content hash as the local copy's, verified
    was = json.loads((tmp_path / "local" / "provenance.json").read_text())["inputs"]["train_tokens"]
    now = json.loads((tmp_path / "remote" / "provenance.json").read_text())["inputs"]["train_tokens"]
    assert now == {**was, "path": url} and now["verified"] is True
    # the shards' tokenizer travels with the run as it does from a local shard directory
    tok = "tokenizer/tokenizer.json"
    assert (tmp_path / "remote" / tok).read_bytes() == (tmp_path / "local" / tok).read_bytes()
    assert SECRET_KEY not in out
    for p in (tmp_path / "remote").rglob("*"):
        if p.is_file():
            assert SECRET_KEY.encode() not in p.read_bytes(), p


def test_a_token_npy_in_a_bucket_reads_as_the_local_file(byte_tokens, bucket):
    url = f"{bucket}/tokens.npy"
    storage.write_bytes(url, byte_tokens.read_bytes())
    local, remote = SequenceSource(byte_tokens, 64, 512), SequenceSource(url, 64, 512)
    assert len(remote) == len(local) and remote.remote
    for i in (0, 7, len(local) - 1):
        assert np.array_equal(remote[i], local[i])
    with pytest.raises(
        DataError, match=r"tokens.npy has token id \d+ at position \d+, outside model.vocab_size=100"
    ):
        SequenceSource(url, 64, 100)  # the ids are checked as for a local file (streamed once)
    storage.write_bytes(url, byte_tokens.read_bytes()[:-3])
    with pytest.raises(DataError, match="tokens.npy is .* bytes, expected .*truncated"):
        SequenceSource(url, 64, 512)


def test_ids_of_a_token_npy_in_a_bucket_are_checked_against_the_runs_tokenizer(byte_tokens, bucket, tmp_path):
    from hf_fixtures import write_bpe

    from shipyard.config import load_config
    from shipyard.train.startup import check_ids_fit

    url = f"{bucket}/ids.npy"
    storage.write_bytes(url, byte_tokens.read_bytes())  # byte ids up to 255
    cfg = load_config("tiny", [f"data.train_tokens={url}"])
    check_ids_fit(cfg, write_bpe(tmp_path / "big", vocab_size=320))
    from tokenizers import Tokenizer, models

    small = tmp_path / "small"
    small.mkdir()
    Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).save(
        str(small / "tokenizer.json")
    )
    top = int(np.load(byte_tokens).max())
    with pytest.raises(DataError, match=f"ids.npy holds token id {top}, but the model's tokenizer"):
        check_ids_fit(cfg, small)


def test_shards_a_killed_tokenize_was_still_publishing_are_refused(tokenized, bucket):
    from shipyard.data.stage import publish_output

    root, url = tokenized.parent, f"{bucket}/killed"
    argv = [sys.executable, "-m", "shipyard.cli.main", "data", "tokenize", str(root / "docs.jsonl")]
    argv += ["--out", url, "--tokenizer", str(root / "tok"), "--set", "shard_tokens=40", "--workers", "1"]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while proc.poll() is None and not storage.exists(f"{url}/manifest.json"):
            time.sleep(0.005)
        proc.kill()  # SIGKILL mid-upload: the manifest is up (it sorts first), shards are going up
    finally:
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == -9, f"tokenize ended on its own ({proc.returncode}): {err.decode()[-500:]}"
    assert not storage.is_published(url)
    with pytest.raises(DataError, match=f"token shards {url}: not a complete stage output"):
        SequenceSource(url, 32, 320)

    # a publication cut between its last shard and its marker: every shard there, still refused
    complete = f"{bucket}/complete"
    publish_output(tokenized, complete, "tokenize")
    assert len(_batches(complete, steps=range(1))) == 1
    storage.remove(f"{complete}/{storage.MARKER}")
    with pytest.raises(DataError, match="not a complete stage output"):
        SequenceSource(complete, 32, 320)
