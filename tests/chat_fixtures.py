"""Chat fine-tuning fixtures: a byte-level tokenizer with chat tokens, synthetic conversations, runs."""

from __future__ import annotations

import json
import random
from pathlib import Path

from shipyard.cli.main import main

QUIET = ["train.logging.progress=false", "train.logging.tensorboard=false"]


def write_tokenizer(out: Path, special_tokens: tuple[str, ...] | None = None, **names) -> Path:
    """A BPE with no merges (every byte one token) plus special tokens: 256 + len(specials) entries."""
    from shipyard.data.configs import TokenizerTrainConfig
    from shipyard.data.tokenizer import hf_tokenizer_config, new_bpe

    kw = {"special_tokens": special_tokens, **names} if special_tokens else {}
    cfg = TokenizerTrainConfig(vocab_size=256 + len(special_tokens or range(7)), min_frequency=1, **kw)
    tok, trainer = new_bpe(cfg)
    tok.train_from_iterator(["x"], trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(hf_tokenizer_config(cfg)))
    return out


def upper_task(seed: int, n: int, system: bool = True) -> list[dict]:
    """Conversations of one pattern: the user says `upper WORD`, the assistant answers WORD in capitals."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 6)))
        messages = [{"role": "system", "content": "Be brief."}] if system else []
        messages += [
            {"role": "user", "content": f"upper {word}"},
            {"role": "assistant", "content": word.upper()},
        ]
        out.append({"messages": messages})
    return out


def write_chats(path: Path, conversations: list[dict]) -> Path:
    path.write_text("".join(json.dumps(c) + "\n" for c in conversations))
    return path


def sft_args(
    out_dir: Path, name: str, train: Path, tokenizer: Path | None, *extra: str, config: str = "tiny"
) -> list[str]:
    args = [
        "train",
        config,
        f"run.out_dir={out_dir}",
        f"run.name={name}",
        "data.seq_len=128",
        f"data.chat={{train: {train}{f', tokenizer: {tokenizer}' if tokenizer else ''}}}",
        *QUIET,
    ]
    return args + list(extra)


def train_sft(
    out_dir: Path, name: str, train: Path, tokenizer: Path | None, *extra: str, config: str = "tiny"
) -> Path:
    assert main(sft_args(out_dir, name, train, tokenizer, *extra, config=config)) == 0
    return out_dir / name
