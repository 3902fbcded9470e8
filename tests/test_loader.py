"""The loader: the batch for a step is a pure function of (sources, weights, seed, step, B, L)."""

import subprocess
import sys
from collections import Counter

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from shipyard.data.loader import BatchLoader, SequenceSource, build_loader, device_batch, training_dataset
from shipyard.data.shards import ShardWriter
from shipyard.errors import DataError


def _shards(path, tokens, shard_tokens):
    """A shard directory holding `tokens` (manifest written the way the tokenize stage does)."""
    import json

    path.mkdir()
    w = ShardWriter(path, np.dtype(np.uint16), shard_tokens)
    for i in range(0, tokens.size, 100):
        w.write(tokens[i : i + 100], 1)
    shards = w.close()
    manifest = {
        "vocab_size": 512,
        "dtype": "uint16",
        "eos_id": 1,
        "shards": shards,
        "tokens": int(tokens.size),
    }
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def test_sequences_cross_shard_boundaries(tmp_path):
    tokens = np.arange(5000, dtype=np.uint16) % 500
    src = SequenceSource(_shards(tmp_path / "s", tokens, 700), seq_len=64, vocab_size=512)
    assert len(src) == (5000 - 1) // 64
    for i in (0, 10, len(src) - 1):
        assert np.array_equal(src[i], tokens[i * 64 : i * 64 + 65].astype(np.int32))


def test_no_sequence_repeats_within_an_epoch_and_epochs_reshuffle(tmp_path):
    src = SequenceSource(_shards(tmp_path / "s", np.arange(6401, dtype=np.uint16) % 500, 1000), 64, 512)
    ds = training_dataset([src], [1.0], seed=3)
    n = len(src)
    first = [tuple(ds[i][:4]) for i in range(n)]
    second = [tuple(ds[n + i][:4]) for i in range(n)]
    assert len(set(first)) == n and set(first) == set(second) and first != second


def test_mixture_proportions_within_one_percent(tmp_path):
    paths = []
    for k, size in enumerate((20000, 3000, 1000)):
        paths.append(_shards(tmp_path / f"s{k}", np.full(size, 10 + k, np.uint16), 4096))
    weights = [0.926, 0.061, 0.013]
    loader = build_loader(paths, weights, seed=0, batch_size=100, seq_len=16, vocab_size=512)
    counts = Counter(int(t) - 10 for step in range(100) for t in loader.rows(step)[:, 0])
    for k, w in enumerate(weights):
        assert abs(counts[k] / 10_000 - w) < 0.01 * w + 1e-4, (k, counts)


def test_same_global_batch_on_1_2_and_8_devices(tmp_path, byte_tokens):
    loader = build_loader([byte_tokens], [1.0], seed=5, batch_size=16, seq_len=32, vocab_size=512)
    expect = loader.global_batch(7)
    for n in (1, 2, 8):
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("data",))
        arr = device_batch(loader, 7, NamedSharding(mesh, PartitionSpec("data", None)))
        assert np.array_equal(np.asarray(arr), expect)
        rows = {s.index[0].start or 0 for s in arr.addressable_shards}
        assert len(rows) == n  # each device holds its own rows


def test_each_of_two_processes_builds_its_half(byte_tokens):
    """Two separate processes, each building only its rows, give the global batch together."""
    code = (
        "import sys, numpy as np; from shipyard.data.loader import build_loader;"
        f"l = build_loader([{str(byte_tokens)!r}], [1.0], 5, 16, 32, 512);"
        "p = int(sys.argv[1]); sys.stdout.buffer.write(l.rows(7, 8 * p, 8 * p + 8).tobytes())"
    )
    halves = [
        np.frombuffer(
            subprocess.run([sys.executable, "-c", code, str(p)], capture_output=True, check=True).stdout,
            np.int32,
        )
        for p in (0, 1)
    ]
    loader = build_loader([byte_tokens], [1.0], seed=5, batch_size=16, seq_len=32, vocab_size=512)
    assert np.array_equal(np.concatenate(halves).reshape(16, 33), loader.global_batch(7))


def test_batches_depend_on_seed_and_step_only(byte_tokens):
    a = build_loader([byte_tokens], [1.0], seed=1, batch_size=4, seq_len=32, vocab_size=512)
    b = build_loader([byte_tokens], [1.0], seed=1, batch_size=4, seq_len=32, vocab_size=512)
    c = build_loader([byte_tokens], [1.0], seed=2, batch_size=4, seq_len=32, vocab_size=512)
    assert np.array_equal(a.global_batch(100), b.global_batch(100))  # no history needed
    assert not np.array_equal(a.global_batch(100), c.global_batch(100))
    assert isinstance(a, BatchLoader)


def test_vocabulary_too_large_for_the_model(tmp_path):
    d = _shards(tmp_path / "s", np.arange(1000, dtype=np.uint16), 1000)
    with pytest.raises(DataError, match="larger than model.vocab_size=256"):
        SequenceSource(d, 16, 256)
