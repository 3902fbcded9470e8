"""Preference pairs for a DPO / SimPO run: resolve the tokenizer, render and pack the pairs once.

As chat data (train/sft_data.py): pairs are rendered and packed in memory at
the start of the run, deterministically from the files, tokenizer, template,
seq_len and seed, so a resumed run rebuilds exactly the same rows; the run
header records the files' and tokenizer's hashes. Bad pairs (empty or
identical replies, too long for a row) are counted by reason and left out.
"""

from __future__ import annotations

from pathlib import Path

from shipyard.config import Config
from shipyard.data.preference import PackedPairs, PairBatchLoader, pack_pairs, read_pairs, render_pair
from shipyard.errors import DataError
from shipyard.output import progress
from shipyard.train.sft_data import checked_format, input_hashes
from shipyard.train.startup import chat_tokenizer_path


def _tokenizer_path(cfg: Config) -> Path:
    """data.preference.tokenizer, else train.init_from's (the errors name data.preference.tokenizer)."""
    try:
        return chat_tokenizer_path(cfg.data.preference.tokenizer, cfg.train.init_from)
    except DataError as e:
        raise DataError(str(e).replace("data.chat.tokenizer", "data.preference.tokenizer")) from e


def _packed(fmt, path: str, seq_len: int, pad: int, seed: int | None, pack: bool) -> PackedPairs:
    pairs = read_pairs(path)
    rendered = []
    for n, pair in enumerate(progress(pairs, desc=f"render {Path(path).name}", unit="pair"), 1):
        try:
            rendered.append(render_pair(fmt, pair))
        except DataError as e:  # the template refused this pair (e.g. raise_exception)
            raise DataError(f"data.preference: {path} pair {n}: {e}") from e
    return pack_pairs(rendered, seq_len, pad, seed, pack)


def bad_pairs(packed: PackedPairs) -> str:
    """'2 empty_reply, 1 too_long' (or 'none'): the pairs left out, by reason."""
    return ", ".join(f"{n} {why}" for why, n in packed.bad.items() if n) or "none"


def load_preference_data(cfg: Config) -> dict:
    """{"loader" (PairBatchLoader), "train" and "validation" (PackedPairs; validation None without
    data.preference.validation), "tokenizer", "inputs" (for the run header), "summary"}."""
    data, seq_len = cfg.data.preference, cfg.data.seq_len
    tok_path = _tokenizer_path(cfg)
    fmt, pad = checked_format(cfg, "data.preference", tok_path, data.template)
    train = _packed(fmt, data.train, seq_len, pad, cfg.data_seed(), data.pack)
    validation = None
    if data.validation is not None:
        validation = _packed(fmt, data.validation, seq_len, pad, None, data.pack)
    inputs = input_hashes("preference", {"train": data.train, "validation": data.validation}, tok_path, fmt)
    summary = (
        f"shipyard: preference data: {train.pairs} pairs ({fmt.template.name} template) in {len(train)} rows "
        f"of {seq_len + 1} tokens, {train.fill():.0%} filled; bad pairs left out: {bad_pairs(train)}"
        + (
            f"; {validation.pairs} held-out pairs (left out: {bad_pairs(validation)})"
            if validation is not None
            else ""
        )
    )
    return {
        "loader": PairBatchLoader(train, cfg.train.global_batch_size, cfg.data_seed()),
        "train": train,
        "validation": validation,
        "tokenizer": tok_path,
        "inputs": inputs,
        "summary": summary,
    }
