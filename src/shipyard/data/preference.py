"""Preference pairs for DPO / SimPO: read, render with a chat template, count bad pairs, pack into rows.

A pair is a conversation that ends with a user turn plus two candidate
assistant replies, `chosen` (preferred) and `rejected`. Each reply is rendered
as its own sequence, `messages + [assistant: reply]`, with the same chat
template as SFT (data/chat_format.py). The loss mask covers only the final
reply: its content and the end-of-turn token that closes it, as SFT trains an
assistant turn. Earlier assistant turns in the prompt are context, because a
pair's log-probability is log pi(reply | prompt) and nothing else.

Bad pairs are counted by reason and left out, never fatal one by one (a
preference set scraped from the web has some): "empty_reply" (either reply
empty or whitespace, or the template writes nothing trainable for it),
"identical" (chosen == rejected: no preference to learn), "too_long" (the two
sequences together do not fit one row). A malformed line (bad JSON, a missing
key, a wrong type) means the file is broken and is fatal, as for chats.

Packing keeps a pair's two sequences in one row, chosen then rejected, so
one row's forward gives both log-probs of every pair it holds. The k-th pair
of a row has segment ids 2k (chosen) and 2k+1 (rejected); each sequence has
its own positions from 0 and attends only to itself, so a packed sequence's
log-probs equal those of the sequence run alone. `slots` names, per target
position, which reply the token belongs to (the segment id there, -1 where
nothing is trained), so the loss can sum log-probs per reply with one
segment sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shipyard.data.chat_format import (
    ChatBatchLoader,
    ChatFormat,
    check_messages,
    fill_rows,
    place,
    read_jsonl_records,
    seeded_order,
)
from shipyard.errors import DataError

PREFERENCE_BATCH_KEYS = ("tokens", "loss_mask", "segment_ids", "positions", "slots", "pair_mask")
"""The arrays of a preference batch: tokens [B, L+1]; loss mask, segment ids, positions, slots [B, L];
pair_mask [B, P]."""
BAD_REASONS = ("empty_reply", "identical", "too_long")
"""Why a pair is left out (the keys of `PackedPairs.bad`)."""

_WHAT = '{"prompt": "..." or "messages": [...], "chosen": "...", "rejected": "..."}'


def _check_record(record, where: str) -> dict:
    """One line's pair, normalised to {"messages", "chosen", "rejected"}."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected an object {_WHAT}")
    has_prompt, has_messages = "prompt" in record, "messages" in record
    if has_prompt == has_messages:
        which = "both" if has_prompt else "neither"
        raise DataError(f"{where}: has {which} of 'prompt' and 'messages'; expected exactly one ({_WHAT})")
    if has_prompt:
        if not isinstance(record["prompt"], str):
            raise DataError(f"{where}: 'prompt' must be a string")
        messages = [{"role": "user", "content": record["prompt"]}]
    else:
        messages = check_messages(record["messages"], where)
        if messages[-1]["role"] != "user":
            raise DataError(
                f"{where}: 'messages' must end with a user turn (the replies are the assistant's next "
                f"turn), not {messages[-1]['role']!r}"
            )
    for key in ("chosen", "rejected"):
        if key not in record:
            raise DataError(f"{where}: missing {key!r}; expected {_WHAT}")
        if not isinstance(record[key], str):
            raise DataError(f"{where}: {key!r} must be a string (the assistant's reply)")
    return {"messages": messages, "chosen": record["chosen"], "rejected": record["rejected"]}


def read_pairs(path: str | Path) -> list[dict]:
    """Every pair of a JSONL file (one per line, blank lines skipped) as {"messages", "chosen", "rejected"}."""
    return read_jsonl_records(path, "data.preference", _WHAT, _check_record, "pairs")


@dataclass(frozen=True)
class RenderedPair:
    """A pair's two sequences as (token ids, 1 on the final reply's trained tokens)."""

    chosen: tuple[list[int], list[int]]
    rejected: tuple[list[int], list[int]]

    def __len__(self) -> int:
        """Tokens of both sequences (what the pair takes in a row)."""
        return len(self.chosen[0]) + len(self.rejected[0])


def _final_reply_mask(mask: list[int]) -> list[int]:
    """The mask with only its last run of trained tokens kept: the final assistant turn. Earlier
    assistant turns are separated from it by a user turn's untrained tokens."""
    out = [0] * len(mask)
    t = len(mask) - 1
    while t >= 0 and not mask[t]:
        t -= 1
    while t >= 0 and mask[t]:
        out[t] = 1
        t -= 1
    return out


def render_pair(fmt: ChatFormat, pair: dict) -> RenderedPair | str:
    """The pair's chosen and rejected sequences, or the reason it is bad ("empty_reply", "identical")."""
    if not pair["chosen"].strip() or not pair["rejected"].strip():
        return "empty_reply"
    if pair["chosen"] == pair["rejected"]:
        return "identical"
    sequences = []
    for reply in (pair["chosen"], pair["rejected"]):
        ids, mask = fmt.render([*pair["messages"], {"role": "assistant", "content": reply}])
        mask = _final_reply_mask(mask)
        if not any(mask[1:]):  # nothing trainable as a target (a template that drops the reply)
            return "empty_reply"
        sequences.append((list(ids), mask))
    return RenderedPair(*sequences)


def pair_slots(seq_len: int) -> int:
    """P: the most pairs one row of seq_len + 1 tokens can hold (each sequence has >= 2 tokens: at least
    one before its first reply token)."""
    return max(1, (seq_len + 1) // 4)


@dataclass(frozen=True)
class PackedPairs:
    """Training rows of pairs: tokens [N, L+1]; per input position [N, L]: loss mask, segment id, position,
    slot (2k chosen / 2k+1 rejected reply of the row's k-th pair, -1 untrained); pair_mask [N, P]."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    pair_mask: np.ndarray
    pairs: int
    """Pairs placed in the rows."""
    bad: dict[str, int]
    """Pairs left out, by reason (every key of BAD_REASONS, zero included)."""

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def fill(self) -> float:
        """Fraction of the rows' input positions holding real tokens."""
        return float(np.mean(self.segment_ids >= 0))

    def rows(self, idx) -> dict[str, np.ndarray]:
        """The batch arrays (PREFERENCE_BATCH_KEYS) of rows `idx`."""
        return {k: getattr(self, k)[idx] for k in PREFERENCE_BATCH_KEYS}


def pack_pairs(
    rendered: list[RenderedPair | str], seq_len: int, pad_id: int, seed: int | None, pack: bool = True
) -> PackedPairs:
    """Place rendered pairs (bad ones given as their reason) into rows of seq_len + 1 tokens.

    Order: a seeded permutation of the good pairs (None keeps file order). A
    pair whose two sequences exceed a row is "too_long". Padding is pad_id
    with segment -1, no loss and slot -1.
    """
    width, slots_per_row = seq_len + 1, pair_slots(seq_len)
    bad = dict.fromkeys(BAD_REASONS, 0)
    sizes = {}
    for i, r in enumerate(rendered):
        if isinstance(r, str):
            bad[r] += 1
        elif not any(r.chosen[1][1:]) or not any(r.rejected[1][1:]):
            bad["empty_reply"] += 1  # no reply token as a target (what render_pair refuses too)
        elif len(r) > width:
            bad["too_long"] += 1
        else:
            sizes[i] = len(r)
    if not sizes:
        counts = ", ".join(f"{n} {k}" for k, n in bad.items() if n)
        raise DataError(
            f"data.preference: none of the {len(rendered)} pairs is usable ({counts}); a pair needs two "
            f"non-empty, different replies whose two sequences fit data.seq_len + 1 = {width} tokens together"
        )
    keep = list(sizes)
    rows = place(sizes, seeded_order(keep, seed), width, pack)
    # the k-th pair of a row is its sequences 2k (chosen) and 2k + 1 (rejected)
    arrays = fill_rows(
        [[seq for i in members for seq in (rendered[i].chosen, rendered[i].rejected)] for members in rows],
        width,
        pad_id,
    )
    pair_mask = np.zeros((len(rows), slots_per_row), np.float32)
    for r, members in enumerate(rows):
        pair_mask[r, : len(members)] = 1.0  # <= width // 4 pairs: each sequence has >= 2 tokens
    slots = np.where(arrays["loss_mask"] > 0, arrays["segment_ids"], -1).astype(np.int32)
    return PackedPairs(**arrays, slots=slots, pair_mask=pair_mask, pairs=len(keep), bad=bad)


class PairBatchLoader(ChatBatchLoader):
    """Rows of the global preference batch for any step, as ChatBatchLoader gives SFT rows (a pure
    function of seed and step); `row_indices` also indexes the DPO reference cache."""

    keys = PREFERENCE_BATCH_KEYS
