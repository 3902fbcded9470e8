"""Chat data for a fine-tuning run: resolve the tokenizer, render and pack the conversations once.

Conversations are small next to pretraining corpora, so they are rendered
and packed in memory at the start of the run, deterministically from the
files, tokenizer, template, seq_len and seed: a resumed run rebuilds exactly
the same rows (and the run header records the files' and tokenizer's hashes).
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from shipyard.config import Config
from shipyard.data.chat_format import (
    ChatBatchLoader,
    ChatFormat,
    pack,
    pad_id_of,
    read_conversations,
)
from shipyard.data.hf_template import TEMPLATE_FILE, HFTemplate
from shipyard.data.shards import file_sha256
from shipyard.data.tokenizer import tokenizer_sha256
from shipyard.errors import DataError
from shipyard.output import progress
from shipyard.run.model_dir import chat_format_of
from shipyard.train.startup import chat_tokenizer_path


def checked_format(cfg: Config, section: str, tok_path: Path, template: str) -> tuple[ChatFormat, int]:
    """(chat format, pad id) of the tokenizer a run's `section` (data.chat, data.preference) renders
    with; a tokenizer with more tokens than the model has ids is refused."""
    fmt = chat_format_of(tok_path, template)
    vocab = fmt.tok.get_vocab_size(with_added_tokens=True)
    if vocab > cfg.model.vocab_size:
        raise DataError(
            f"{section}: the tokenizer {tok_path} has {vocab} tokens, more than model.vocab_size="
            f"{cfg.model.vocab_size}; use the base model's tokenizer, or set model.vocab_size to at least "
            f"{vocab} (with train.resize_vocab: true to resize a train.init_from model to it)"
        )
    return fmt, pad_id_of(tok_path, fmt.tok)


def input_hashes(prefix: str, files: dict[str, str | None], tok_path: Path, fmt: ChatFormat) -> dict:
    """The run header's inputs for rendered data: each of `files` ({"train": path, "validation": path
    or None}) as `<prefix>_<name>` with its sha256, the tokenizer's, and an HF chat template's."""
    inputs = {
        f"{prefix}_{name}": {"path": str(path), "sha256": file_sha256(path)}
        for name, path in files.items()
        if path is not None
    }
    inputs["tokenizer"] = {"path": str(tok_path), "sha256": tokenizer_sha256(tok_path)}
    if isinstance(fmt.template, HFTemplate):
        source = fmt.template.source.encode()
        inputs["chat_template"] = {"path": fmt.template.where, "sha256": hashlib.sha256(source).hexdigest()}
    return inputs


def load_chat_data(cfg: Config) -> dict:
    """{"loader", "validation" (PackedChats or None), "tokenizer", "inputs" (for the run header), "summary"}."""
    chat, seq_len = cfg.data.chat, cfg.data.seq_len
    tok_path = chat_tokenizer_path(chat.tokenizer, cfg.train.init_from)
    fmt, pad = checked_format(cfg, "data.chat", tok_path, chat.template)

    def packed(path: str, seed: int | None):
        conversations = read_conversations(path)
        bar = progress(conversations, desc=f"render {Path(path).name}", unit="conv")
        rendered = []
        for n, messages in enumerate(bar, 1):
            try:
                rendered.append(fmt.render(messages))
            except DataError as e:  # the template refused this conversation (e.g. raise_exception)
                raise DataError(f"data.chat: {path} conversation {n}: {e}") from e
        return pack(rendered, seq_len, pad, seed, chat.pack)

    train = packed(chat.train, cfg.data_seed())
    validation = packed(chat.validation, None) if chat.validation is not None else None
    inputs = input_hashes("chat", {"train": chat.train, "validation": chat.validation}, tok_path, fmt)
    summary = (
        f"shipyard: chat data: {train.conversations} conversations ({fmt.template.name} template) in "
        f"{len(train)} rows of {seq_len + 1} tokens, {train.fill():.0%} filled, "
        f"{int(train.loss_mask.sum()):,} assistant tokens trained"
        + (f"; {train.dropped} left out (longer than the row or no reply)" if train.dropped else "")
    )
    return {
        "loader": ChatBatchLoader(train, cfg.train.global_batch_size, cfg.data_seed()),
        "validation": validation,
        "tokenizer": tok_path,
        "inputs": inputs,
        "summary": summary,
    }


def copy_tokenizer(tok_path: Path, dest: Path) -> None:
    """tokenizer.json (and tokenizer_config.json and chat_template.jinja when present) into dest/."""
    src = tok_path if tok_path.is_dir() else tok_path.parent
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(tok_path / "tokenizer.json" if tok_path.is_dir() else tok_path, dest / "tokenizer.json")
    for name in ("tokenizer_config.json", TEMPLATE_FILE):
        if (src / name).is_file():
            shutil.copy(src / name, dest / name)
