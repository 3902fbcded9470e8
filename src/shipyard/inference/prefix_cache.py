"""The prefix cache: the keys and values of recent prompts, kept so a prompt that starts the same way
computes only what differs.

Why it can be exact: a prompt's K/V at its i-th token depend only on its first i+1 tokens and on
RoPE positions counted from its first token (inference/decode.py), not on the slot the prompt sits
at in a left-padded prefill. So the store keeps each remembered prompt aligned at slot 0, and an
admission puts the remembered part back at whatever offset its own prefill bucket gives it, then
runs the model over only the last Q slots (a power-of-two bucket covering the new part). The
positions of the chunk that the cache already held are recomputed from the same tokens, so the
cache row the request decodes from has its usual layout (`Engine._start`), and the first token's
logits come from the same model over the same keys. The prefill the cache skips runs the same
attention over the same keys (its bucket's) with fewer query rows; tests/test_prefix_cache.py checks
that replies and log-probs equal those with the cache off.

The store is `entries` rows of up to `SLOTS` slots on the device (the prefill's [layers, rows,
slots, kv_heads, head_dim] layout; a longer prompt keeps its first `SLOTS` tokens, the part a
system prompt or few-shot examples share); `PrefixIndex` keeps on the host which prompt each row holds and when
it was last used, and picks the row with the longest common prefix (no block granularity: any
prefix length can be reused, as each row holds a whole prompt). A new prompt replaces the row it
extends (a conversation's next turn), else the least recently used one.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from shipyard.config import ModelConfig
from shipyard.inference.decode import KVCache, init_cache

SLOTS = 2048
"""The most tokens of a prompt the store keeps (a row of a server with a shorter context: its length).
A row of a 135M-class model's 8,192-slot context takes 360 MiB in fp32; 2,048 slots, 90 MiB."""


def init_store(cfg: ModelConfig, entries: int, max_len: int, dtype) -> KVCache:
    """An empty store of `entries` prompts of up to `min(max_len, SLOTS)` tokens each."""
    return init_cache(cfg, entries, min(max_len, SLOTS), dtype)


def recall(store: KVCache, cache: KVCache, entry, length, start) -> KVCache:
    """`cache` (one row) with the first `length` tokens of store row `entry` at slots start..start+length
    (everything else zero, as a fresh prefill cache is). All three are traced int32 scalars."""
    max_len = cache.k.shape[2]
    idx = jnp.arange(max_len) - start
    valid = (idx >= 0) & (idx < length)

    def put(rows, buf):
        row = jax.lax.dynamic_index_in_dim(rows, entry, axis=1, keepdims=False)  # [layers, slots, h, d]
        row = jnp.take(row, jnp.clip(idx, 0, rows.shape[2] - 1), axis=1)
        row = jnp.where(valid[None, :, None, None], row, 0).astype(buf.dtype)
        return buf.at[:, 0].set(row)

    return KVCache(put(store.k, cache.k), put(store.v, cache.v))


def keep(store: KVCache, cache: KVCache, start, entry) -> KVCache:
    """`store` with row `entry` holding the prompt that starts at slot `start` of `cache`'s first row,
    moved to slot 0 (an `entry` past the last row: the store unchanged)."""
    max_len = cache.k.shape[2]
    idx = jnp.clip(jnp.arange(store.k.shape[2]) + start, 0, max_len - 1)

    def put(rows, buf):
        row = jnp.take(buf[:, 0], idx, axis=1).astype(rows.dtype)
        return rows.at[:, entry].set(row, mode="drop")

    return KVCache(put(store.k, cache.k), put(store.v, cache.v))


@dataclasses.dataclass(frozen=True)
class Reuse:
    """What an admission takes from the store and where it keeps its own prompt."""

    entry: int
    """The store row the prompt shares its prefix with (-1: none)."""
    length: int
    """How many of the prompt's first tokens that row holds (0: none)."""
    put: int
    """The store row the prompt is written to (`entries`: it is not kept, a row holds it already)."""


class PrefixIndex:
    """Which prompt each store row holds, and the least recently used one (host side; engine thread)."""

    def __init__(self, entries: int, slots: int):
        self.entries = entries
        self.slots = slots
        """Tokens a row holds: a longer prompt is kept up to there (its prefix is what others share)."""
        self._held: list[np.ndarray | None] = [None] * entries
        self._used = [0] * entries
        self._clock = 0
        self.hits = 0
        """Admissions that reused a prefix."""
        self.hit_tokens = 0
        """Prompt tokens whose K/V came from the store."""
        self.saved_tokens = 0
        """Prefill positions not computed (the bucket's length minus the chunk's)."""
        self.lookups = 0
        """Admissions that asked the store."""

    def plan(self, prompt: list[int]) -> Reuse:
        """The row sharing the longest prefix with `prompt` (at most all but its last token, which must
        be computed for the first reply token's logits), and the row to keep `prompt` in."""
        tokens = np.asarray(prompt)
        best, length = -1, 0
        for e, held in enumerate(self._held):
            if held is None:
                continue
            n = min(len(held), len(tokens))
            differ = np.flatnonzero(held[:n] != tokens[:n])
            common = int(differ[0]) if differ.size else n
            if common > length:
                best, length = e, common
        length = min(length, len(tokens) - 1)
        if best >= 0 and len(self._held[best]) == len(tokens) and length == len(tokens) - 1:
            put = self.entries  # the same prompt again: its row holds it already
        elif best >= 0 and length == len(self._held[best]):
            put = best  # it extends the row's prompt (a conversation's next turn): replace that one
        else:
            free = [e for e, held in enumerate(self._held) if held is None]
            put = free[0] if free else int(np.argmin(self._used))
        return Reuse(best if length > 0 else -1, length if best >= 0 else 0, put)

    def commit(self, prompt: list[int], reuse: Reuse, saved: int) -> None:
        """An admission planned with `reuse` ran, `saved` prefill positions shorter than the whole
        bucket (0: it prefilled all, the prefix unused); counted here."""
        self._clock += 1
        self.lookups += 1
        if reuse.entry >= 0 and saved:
            self._used[reuse.entry] = self._clock
            self.hits += 1
            self.hit_tokens += reuse.length
            self.saved_tokens += saved
        if reuse.put < self.entries:
            self._held[reuse.put] = np.asarray(prompt[: self.slots])
            self._used[reuse.put] = self._clock

    def clear(self) -> None:
        """Forget every row (new weights: the K/V held were computed by the old ones)."""
        self._held = [None] * self.entries

    def held_tokens(self) -> int:
        """Prompt tokens the store holds now (read from another thread: a snapshot)."""
        return sum(len(h) for h in list(self._held) if h is not None)
