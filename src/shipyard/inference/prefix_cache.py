"""The prefix cache: the keys and values of prompt blocks computed before, reused by any prompt that
starts with the same tokens.

Why it is exact, bitwise: the engine prefills every prompt left-aligned (token i at slot i) in chunks
of `chunk` tokens on a fixed grid (`engine._admit`): chunk j runs the same program over the same
shapes, fed tokens [jC, (j+1)C) and the K/V of slots < jC. So a block's K/V (a chunk's tokens) are a
function of the prompt's tokens up to the block's end, not of the prompt's length, bucket or of what
else runs, and a prefill that takes blocks 0..h-1 from the store and computes chunks h.. runs exactly
the computation a prefill without the store runs from chunk h on (tests/test_prefix_cache.py checks
replies and log-probs with the cache on and off for equality, not closeness). A prompt shorter than
a chunk is prefilled in one piece of its own length and neither reads nor fills the store.

A block is keyed by a digest of every token up to its end (a chain: block j's key hashes block j-1's
key and its own tokens), so a block is stored once and shared by every prompt with that prefix: a
system prompt in front of many conversations takes its own length of store, whatever the number of
conversations. The store is a pool of `blocks` blocks on the device ([layers, blocks, chunk,
kv_heads, head_dim]); when it is full, a new block takes the least recently used one. A prompt uses
every block it reads or writes, so a block is never used later than the blocks before it; of blocks
used at the same time the deepest goes first, so a block never outlives its ancestors.
"""

from __future__ import annotations

import dataclasses
import hashlib

import jax.numpy as jnp
import numpy as np

from shipyard.config import ModelConfig
from shipyard.inference.decode import KVCache, init_cache

SLOTS = 2048
"""The prompt length `--prefix-cache N` sizes the store for: N x min(max_len, SLOTS) tokens. A row of
a 135M-class model's 8,192-slot context takes 360 MiB in fp32; 2,048 slots, 90 MiB."""


def prefill_grid(P: int, chunk: int) -> tuple[int, int]:
    """(chunk length, scratch slots) of the prefill of a P-slot bucket: `chunk`-token pieces over a
    scratch rounded up to whole pieces, or one piece of P tokens when P is at most a chunk."""
    if chunk >= P:
        return P, P
    return chunk, -(-P // chunk) * chunk


def init_store(cfg: ModelConfig, blocks: int, chunk: int, dtype) -> KVCache:
    """An empty store of `blocks` blocks of `chunk` tokens."""
    return init_cache(cfg, blocks, chunk, dtype)


def recall(store: KVCache, scratch: KVCache, ids, count) -> KVCache:
    """`scratch` (a left-aligned prefill cache) with store blocks ids[0..count) at its first row's
    slots [0, count x chunk); the rest as it was. `ids` [n] (n x chunk <= the scratch's slots)."""
    layers, _, chunk = store.k.shape[:3]
    n = ids.shape[0]
    valid = jnp.arange(n * chunk) < count * chunk

    def put(blocks, buf):
        got = jnp.take(blocks, ids, axis=1, mode="clip")
        got = got.reshape(layers, n * chunk, *got.shape[3:]).astype(buf.dtype)
        row = jnp.where(valid[None, :, None, None], got, buf[:, 0, : n * chunk])
        return buf.at[:, 0, : n * chunk].set(row)

    return KVCache(put(store.k, scratch.k), put(store.v, scratch.v))


def keep(store: KVCache, scratch: KVCache, put) -> KVCache:
    """`store` with block put[j] holding chunk j of `scratch`'s first row (an id past the last block:
    that chunk is not kept). `put` [n]."""
    layers, _, chunk = store.k.shape[:3]
    n = put.shape[0]

    def write(blocks, buf):
        rows = buf[:, 0, : n * chunk].reshape(layers, n, chunk, *buf.shape[3:]).astype(blocks.dtype)
        return blocks.at[:, put].set(rows, mode="drop")

    return KVCache(write(store.k, scratch.k), write(store.v, scratch.v))


@dataclasses.dataclass(frozen=True)
class Reuse:
    """What an admission takes from the store and which blocks it fills."""

    ids: tuple[int, ...]
    """Store blocks holding the prompt's first blocks, in order (empty: a miss)."""
    put: tuple[int, ...]
    """The store block each of the prompt's next full blocks goes to (after `ids`'s)."""
    keys: tuple[bytes, ...]
    """The digests of the blocks in `put` (recorded by `BlockIndex.commit`)."""
    chunk: int
    """Tokens a block holds."""

    @property
    def length(self) -> int:
        """Prompt tokens whose K/V come from the store."""
        return len(self.ids) * self.chunk

    def arrays(self, n: int, blocks: int) -> tuple[np.ndarray, np.int32, np.ndarray]:
        """The prefill's (ids [n], count, put [n]) arguments: put is `blocks` (out of range, dropped)
        for the chunks not kept."""
        ids = np.zeros(n, np.int32)
        ids[: len(self.ids)] = self.ids
        put = np.full(n, blocks, np.int32)
        put[len(self.ids) : len(self.ids) + len(self.put)] = self.put
        return ids, np.int32(len(self.ids)), put


def _chain(prompt: np.ndarray, chunk: int, n: int) -> list[bytes]:
    """The digests of the prompt's first n blocks (each covers every token up to its end)."""
    keys, key = [], b""
    for j in range(n):
        key = hashlib.blake2b(key + prompt[j * chunk : (j + 1) * chunk].tobytes(), digest_size=16).digest()
        keys.append(key)
    return keys


class BlockIndex:
    """Which prefix each store block holds, and when it was last used (host side; engine thread)."""

    def __init__(self, blocks: int, chunk: int, entries: int):
        self.blocks = blocks
        """Blocks the store holds."""
        self.chunk = chunk
        """Tokens a block holds (the engine's prefill chunk)."""
        self.entries = entries
        """Prompts of up to `SLOTS` tokens the store was sized for (`--prefix-cache`)."""
        self._where: dict[bytes, int] = {}  # a prefix's digest -> its block
        self._key: list[bytes | None] = [None] * blocks  # each block's digest (None: free)
        self._used = [0] * blocks
        self._depth = [0] * blocks
        self._clock = 0
        self.hits = 0
        """Admissions that reused a prefix."""
        self.hit_tokens = 0
        """Prompt tokens whose K/V came from the store."""
        self.saved_tokens = 0
        """Prefill positions not computed (whole chunks: the hit tokens)."""
        self.lookups = 0
        """Admissions that asked the store."""
        self.evicted = 0
        """Blocks given to a new prefix while they held another (the store was full)."""

    def plan(self, prompt: list[int], most: int) -> Reuse:
        """The store blocks holding `prompt`'s longest cached prefix (whole blocks, and never the block
        of its last token, which must be computed for the first reply token's logits) and the blocks
        its next full blocks go to, within the `most` blocks its prefill covers. Blocks it reads
        count as used now; the blocks it is given are free or the least recently used others."""
        tokens = np.asarray(prompt, np.int32)
        chunk = self.chunk
        full = min(len(tokens) // chunk, most)
        keys = _chain(tokens, chunk, full)
        self._clock += 1
        ids: list[int] = []
        for key in keys[: (len(tokens) - 1) // chunk]:
            block = self._where.get(key)
            if block is None:
                break
            ids.append(block)
            self._used[block] = self._clock
        # the blocks after the hit are all new (a block is never kept without its ancestors), except
        # the block of the last token when the prompt ends a block: held already, computed anyway
        new = [key for key in keys[len(ids) :] if key not in self._where]
        put = self._take(len(new))
        for depth, block in enumerate(put, start=len(ids)):
            self._depth[block] = depth
        return Reuse(tuple(ids), tuple(put), tuple(new[: len(put)]), chunk)

    def cached(self, prompt: list[int]) -> int:
        """Prompt tokens `plan` would take from the store now (nothing used or given: a look)."""
        tokens = np.asarray(prompt, np.int32)
        n = 0
        for key in _chain(tokens, self.chunk, (len(tokens) - 1) // self.chunk):
            if key not in self._where:
                break
            n += 1
        return n * self.chunk

    def _take(self, n: int) -> list[int]:
        """Up to n blocks for new prefixes: free ones, then the least recently used (deepest first)
        of those not used now; they are forgotten at once (a failed prefill leaves them free)."""
        free = [b for b, key in enumerate(self._key) if key is None]
        if len(free) < n:
            old = [b for b, key in enumerate(self._key) if key is not None and self._used[b] < self._clock]
            old.sort(key=lambda b: (self._used[b], -self._depth[b]))
            for b in old[: n - len(free)]:
                del self._where[self._key[b]]
                self._key[b] = None
                self.evicted += 1
            free += old[: n - len(free)]
        return free[:n]

    def commit(self, reuse: Reuse) -> None:
        """The prefill planned with `reuse` ran: its new blocks hold their prefixes now."""
        self.lookups += 1
        if reuse.ids:
            self.hits += 1
            self.hit_tokens += reuse.length
            self.saved_tokens += reuse.length
        for block, key in zip(reuse.put, reuse.keys):
            self._where[key] = block
            self._key[block] = key
            self._used[block] = self._clock

    def clear(self) -> None:
        """Forget every block (new weights: the K/V held were computed by the old ones)."""
        self._where.clear()
        self._key = [None] * self.blocks

    def held_tokens(self) -> int:
        """Prompt tokens the store holds now (read from another thread: a snapshot)."""
        return self.chunk * sum(key is not None for key in list(self._key))
