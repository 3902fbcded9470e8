"""Byte-level BPE tokenizers: train one with `tokenizers`, or load a tokenizer.json.

Byte-level (GPT-2 style) with no normaliser and no prefix space, so
`decode(encode(text)) == text` for any string: code, whitespace runs, any
Unicode. Special tokens (BOS, EOS, PAD, chat role markers) take ids 0..k-1.
Text that merely *looks like* a special token (a document containing the
characters "<|eos|>") is encoded as ordinary bytes: `encode_special_tokens`
is switched on whenever shipyard loads a tokenizer, so training data can
never inject a document boundary or a chat role.

Every function that takes a tokenizer path also takes its URL
(`remote_tokenizer.local_tokenizer`: fetched once into the local cache).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from shipyard import storage
from shipyard.data.configs import ReadConfig, TokenizerTrainConfig
from shipyard.data.documents import Document, check_bad_fraction, read_unit
from shipyard.data.remote_tokenizer import local_tokenizer
from shipyard.data.stage import StageStats, config_record, plan, progress_bytes, stage_output
from shipyard.errors import DataError
from shipyard.output import write_json

TOKENIZER_FILE = "tokenizer.json"


def load_tokenizer(path: str | Path):
    """A `tokenizers.Tokenizer` from a tokenizer.json file or a directory holding one (or their URL)."""
    path = local_tokenizer(path)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        raise DataError(
            f"tokenizer {path}: no such file (expected a tokenizer.json or a directory holding one)"
        )
    return tokenizer_from_json(file.read_text(encoding="utf-8"), str(file))


def tokenizer_from_json(text: str, where: str):
    """A `tokenizers.Tokenizer` from tokenizer.json's text (`where`: its file, for the error), as stages
    encode with it: special-token strings in a document's text are encoded as the tokens."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception for malformed JSON
        raise DataError(f"tokenizer {where}: not a valid tokenizer.json ({str(e).splitlines()[0]})") from e
    tok.encode_special_tokens = True
    return tok


def tokenizer_sha256(path: str | Path) -> str:
    path = local_tokenizer(path)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    return hashlib.sha256(file.read_bytes()).hexdigest()


def tokenizer_record(path: str | Path) -> str:
    """How stages name the tokenizer they used: path (a URL without credentials) and content hash."""
    return f"{storage.redact(path)}@sha256:{tokenizer_sha256(path)}"


_EOS_GUESSES = ("<|eos|>", "<|endoftext|>", "<|end_of_text|>", "</s>")
_BOS_GUESSES = ("<|bos|>", "<|begin_of_text|>", "<s>")


def special_token_ids(path: str | Path, tok) -> dict[str, int | None]:
    """ids of bos/eos/pad: named by tokenizer_config.json next to the tokenizer, else guessed from the vocabulary."""
    shown = storage.redact(path)
    path = local_tokenizer(path)
    sidecar = (path if path.is_dir() else path.parent) / "tokenizer_config.json"
    names: dict = {}
    if sidecar.is_file():
        try:
            cfg = json.loads(sidecar.read_text())
        except json.JSONDecodeError as e:
            raise DataError(f"tokenizer config {sidecar}: not valid JSON ({e.msg}, line {e.lineno})") from e
        # transformers may store a token as {"content": ...}
        for key in ("bos_token", "eos_token", "pad_token"):
            value = cfg.get(key)
            names[key] = value.get("content") if isinstance(value, dict) else value
    vocab = tok.get_vocab(with_added_tokens=True)
    names.setdefault("eos_token", next((t for t in _EOS_GUESSES if t in vocab), None))
    names.setdefault("bos_token", next((t for t in _BOS_GUESSES if t in vocab), None))
    names.setdefault("pad_token", "<|pad|>" if "<|pad|>" in vocab else None)
    ids = {k: (tok.token_to_id(v) if isinstance(v, str) else None) for k, v in names.items()}
    if ids["eos_token"] is None:
        raise DataError(
            f"tokenizer {shown}: no end-of-document token (name it eos_token in tokenizer_config.json, "
            f"or have one of {', '.join(_EOS_GUESSES)} in the vocabulary)"
        )
    return ids


def new_bpe(cfg: TokenizerTrainConfig):
    """An untrained byte-level BPE tokenizer and its trainer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # use_regex splits on the GPT-2 pattern (letters, digits, punctuation,
    # whitespace runs) before BPE, so merges never straddle those classes.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=list(cfg.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    return tok, trainer


def _in_sample(doc: Document, fraction: float) -> bool:
    if fraction >= 1:
        return True
    h = int.from_bytes(hashlib.blake2b(doc.id.encode(), digest_size=8).digest(), "little")
    return h / 2**64 < fraction


def sample_texts(
    docs: Iterable[Document], cfg: TokenizerTrainConfig, stats: StageStats, bar
) -> Iterator[str]:
    """Texts of the documents in the sample, stopping at sample_bytes."""
    for doc in docs:
        stats.documents_in += 1
        size = len(doc.text.encode("utf-8"))
        stats.bytes_in += size
        bar.update(1)
        if not _in_sample(doc, cfg.sample_fraction):
            continue
        if cfg.sample_bytes is not None and stats.bytes_out + size > cfg.sample_bytes and stats.documents_out:
            return
        stats.documents_out += 1
        stats.bytes_out += size
        yield doc.text


def hf_tokenizer_config(cfg: TokenizerTrainConfig) -> dict:
    """tokenizer_config.json as transformers reads it (PreTrainedTokenizerFast over tokenizer.json)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": cfg.bos_token,
        "eos_token": cfg.eos_token,
        "pad_token": cfg.pad_token,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000_000,
        "additional_special_tokens": [
            t for t in cfg.special_tokens if t not in (cfg.bos_token, cfg.eos_token, cfg.pad_token)
        ],
    }


def run_tokenizer_train(
    inputs: list[str], out: Path, cfg: TokenizerTrainConfig, read: ReadConfig, overwrite: bool = False
) -> dict:
    """Train on (a sample of) the inputs; write tokenizer.json, tokenizer_config.json, stats.json.

    The BPE trainer is multi-threaded inside `tokenizers` (Rust, every core),
    so this stage needs no process pool of its own.
    """
    inputs = [str(p) for p in inputs]
    units = plan(inputs)
    stats = StageStats(
        "tokenizer-train",
        inputs,
        config_record(read, tokenizer=cfg),
        workers=0,
    )
    with stage_output(out, overwrite, "tokenizer-train") as dest:
        tmp = dest.local
        tok, trainer = new_bpe(cfg)
        docs = (d for u in units for d in read_unit(u, stats.read, read.text_field))
        # the bar counts text bytes read, against the input's size on disk (about equal for plain jsonl)
        with progress_bytes("tokenizer-train", sum(u.size for u in units)) as bar:
            tok.train_from_iterator(sample_texts(docs, cfg, stats, bar), trainer)
        check_bad_fraction(stats.read, read.max_bad_fraction, "data tokenizer-train")
        if stats.documents_out == 0:
            raise DataError(f"data tokenizer-train: inputs {', '.join(inputs)} hold no documents to train on")
        tok.save(str(tmp / TOKENIZER_FILE))
        write_json(tmp / "tokenizer_config.json", hf_tokenizer_config(cfg))
        result = stats.as_dict()
        result["vocab_size"] = tok.get_vocab_size()
        result["tokenizer_sha256"] = tokenizer_sha256(tmp / TOKENIZER_FILE)
        write_json(tmp / "stats.json", result)
    return result
