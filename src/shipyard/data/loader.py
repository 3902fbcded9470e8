"""Training batches from token shards with Grain: a pure function of the step.

A token-shard set (or a 1-D .npy of tokens) is a random-access source of
sequences: sequence i is tokens[i*L : i*L + L + 1] of the shards read as one
stream (L = seq_len; the extra token is the last target, so consecutive
sequences share one token and every token is a target exactly once per
epoch). Each set is shuffled globally per epoch by Grain (a bijective index
shuffle keyed by seed and epoch: no sequence repeats within an epoch, and
epochs follow one another without a boundary artifact) and repeated; several
sets are interleaved by `MapDataset.mix` with exact proportions.

Row r of the global batch for step s is element s*B + r of that dataset, so
the batch is a pure function of (manifests, weights, seed, s, B, L): the same
on any number of devices or processes, and resuming needs only s. Each process
builds only the rows its devices hold (`device_batch`), and a background
thread prepares the next steps' rows while the current one runs.

Any source may be a bucket URL (`s3://`, `gs://`, `memory://`): a shard set or a
.npy there is read by byte ranges (data/remote_array.py), and since each row is
then a network round trip, `BatchLoader` fetches the rows of a step from
ROW_THREADS threads at once (the fsspec clients are thread-safe: their requests
share one event loop). Rows come back in order, so batches are identical to a
local copy's, bit for bit.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from shipyard import storage
from shipyard.data.shards import open_shards
from shipyard.errors import DataError

ROW_THREADS = 16
"""Rows fetched at once from a source in a bucket (each is one ranged GET: latency, not bandwidth)."""


class SequenceSource:
    """Random access to the (L+1)-token sequences of one token-shard directory or .npy file, local or
    in a bucket (a URL: a .npy when it ends in .npy, else a shard directory).

    A shard directory is checked against its manifest when opened: sizes always, sha256 with
    `verify` (data.verify; cached per user, see data/shards.py: open_shards). A .npy has no
    recorded hash to check against (data/tokens.py validates its dtype and ids)."""

    def __init__(self, path: str | Path, seq_len: int, vocab_size: int, verify: bool = True):
        storage.check_scheme(path, "data")
        remote = storage.is_url(path)
        path = str(path) if remote else storage.local(path)
        self.path, self.seq_len, self.remote = path, seq_len, remote
        self.eos_id: int | None = None
        if (remote and not path.endswith(".npy")) or (not remote and path.is_dir()):
            # a token-shard directory; open_shards reports a missing manifest
            manifest, self.arrays = open_shards(path, verify=verify)
            self.eos_id = manifest["eos_id"]
            if manifest["vocab_size"] > vocab_size:
                raise DataError(
                    f"data: {storage.redact(path)} was tokenized with a vocabulary of {manifest['vocab_size']}, larger than "
                    f"model.vocab_size={vocab_size}; set model.vocab_size={manifest['vocab_size']}"
                )
        else:
            from shipyard.data.tokens import load_tokens

            self.arrays = [load_tokens(path, vocab_size, seq_len)]
        sizes = np.array([a.size for a in self.arrays], np.int64)
        self.starts = np.concatenate(([0], np.cumsum(sizes)))
        total = int(self.starts[-1])
        self.length = (total - 1) // seq_len
        if self.length < 1:
            raise DataError(
                f"data: {storage.redact(path)} has {total} tokens, fewer than one sequence (data.seq_len + 1 = {seq_len + 1})"
            )

    def __len__(self) -> int:
        return self.length

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the shards read as one stream, as int32."""
        out = np.empty(stop - start, np.int32)
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        pos = start
        for k in range(first, len(self.arrays)):
            if pos >= stop:
                break
            lo = pos - int(self.starts[k])
            hi = min(stop, int(self.starts[k + 1])) - int(self.starts[k])
            out[pos - start : pos - start + hi - lo] = self.arrays[k][lo:hi]
            pos += hi - lo
        return out

    def __getitem__(self, i: int) -> np.ndarray:
        i = int(i)
        return self.tokens(i * self.seq_len, i * self.seq_len + self.seq_len + 1)


def _set_seed(seed: int, index: int) -> int:
    # Each set gets its own shuffle stream; adding a set must not reorder the others.
    return (seed * 1_000_003 + index * 7_919 + 1) % (2**31 - 1)


def training_dataset(sources: Sequence[SequenceSource], weights: Sequence[float], seed: int):
    """The infinite, shuffled, mixed sequence dataset (grain MapDataset)."""
    import grain

    sets = [
        grain.MapDataset.source(src).shuffle(seed=_set_seed(seed, k)).repeat()
        for k, src in enumerate(sources)
    ]
    if len(sets) == 1:
        return sets[0]
    total = float(sum(weights))
    return grain.MapDataset.mix(sets, weights=[w / total for w in weights])


class BatchLoader:
    """Rows of the global batch for any step; `rows(step, lo, hi)` builds only rows lo..hi-1, from
    `threads` threads at once when threads > 1 (sources in a bucket; in order either way)."""

    def __init__(self, dataset, batch_size: int, seq_len: int, eos_id: int | None = None, threads: int = 1):
        self.dataset, self.batch_size, self.seq_len = dataset, batch_size, seq_len
        self.eos_id, self.threads = eos_id, threads
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = os.getpid()

    def rows(self, step: int, lo: int = 0, hi: int | None = None) -> np.ndarray:
        hi = self.batch_size if hi is None else hi
        base = step * self.batch_size
        if self.threads <= 1 or hi - lo <= 1:
            return np.stack([self.dataset[base + r] for r in range(lo, hi)])
        if self._pool is None or self._pool_pid != os.getpid():  # a forked child has no pool threads
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="shipyard-rows")
            self._pool_pid = os.getpid()
        return np.stack(list(self._pool.map(self.dataset.__getitem__, range(base + lo, base + hi))))

    def global_batch(self, step: int) -> np.ndarray:
        return self.rows(step)


def build_loader(
    paths: Sequence[str],
    weights: Sequence[float],
    seed: int,
    batch_size: int,
    seq_len: int,
    vocab_size: int,
    verify: bool = True,
) -> BatchLoader:
    """The batches of step s from the weighted `paths` (each checked as SequenceSource says)."""
    sources = [SequenceSource(p, seq_len, vocab_size, verify) for p in paths]
    eos = {s.eos_id for s in sources}
    # None: unknown (a .npy) or the sources disagree; document masking then needs data.eos_id
    eos_id = eos.pop() if len(eos) == 1 else None
    threads = ROW_THREADS if any(s.remote for s in sources) else 1  # local rows are memory copies
    return BatchLoader(training_dataset(sources, weights, seed), batch_size, seq_len, eos_id, threads)


def device_batch(loader, step: int, sharding) -> object:
    """The global batch for `step` as a jax.Array with `sharding`, built from only this process's rows.

    With a dict of shardings (loaders whose rows are dicts of arrays, e.g.
    packed chats, which name their per-row shapes in `row_shapes`): a dict of
    global arrays, one per key.
    """
    import jax

    cache: dict[tuple[int, int], object] = {}

    def rows_for(index):
        lo, hi, _ = index[0].indices(loader.batch_size)
        if (lo, hi) not in cache:  # replicas of the same rows (e.g. tensor parallelism) are built once
            cache[(lo, hi)] = loader.rows(step, lo, hi)
        return cache[(lo, hi)]

    def global_array(row_shape, sh, pick):
        return jax.make_array_from_callback(
            (loader.batch_size, *row_shape),
            sh,
            lambda index: pick(rows_for(index))[(slice(None), *index[1:])],
        )

    if not isinstance(sharding, dict):
        return global_array((loader.seq_len + 1,), sharding, lambda rows: rows)
    return {
        key: global_array(loader.row_shapes[key], sh, lambda rows, key=key: rows[key])
        for key, sh in sharding.items()
    }


class Prefetcher:
    """Builds the batches of the next steps on a background thread (numpy and Grain release the GIL
    for the copying), so the loader never stalls the train step."""

    def __init__(self, make: Callable[[int], object], start: int, stop: int, depth: int = 2):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(make, start, stop), daemon=True)
        self._thread.start()

    def _run(self, make, start, stop):
        try:
            for step in range(start, stop):
                item = (step, make(step), None)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as e:  # hand the error to the consumer, who raises it
            self._queue.put((None, None, e))

    def get(self, step: int):
        got, batch, err = self._queue.get()
        if err is not None:
            raise err
        assert got == step, f"prefetcher out of order: wanted step {step}, got {got}"
        return batch

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
