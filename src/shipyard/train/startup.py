"""Training start-up: what a new run starts from, checked before it writes anything.

The model directory a run reads (`train.init_from`: a run, an import, an HF directory) is
`run/model_dir.py`'s business; this module decides what training does with it: whether its
shapes and vocabulary fit this run's model (`check_init_from`, `vocab_plan`), the params the run
starts from with the embedding and head resized when train.resize_vocab asks (`base_params`),
which tokenizer the new run speaks (`run_tokenizer`), and whether its .npy token ids fit that
tokenizer (`check_ids_fit`).
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from shipyard import storage
from shipyard.config import Config
from shipyard.data.remote_array import RemoteArray
from shipyard.data.remote_tokenizer import local_tokenizer
from shipyard.data.tokenizer import load_tokenizer
from shipyard.errors import ConfigError, DataError
from shipyard.model.params import init_params, is_spec
from shipyard.model.transformer import param_specs
from shipyard.run.model_dir import (
    check_same_shapes,
    init_from_config,
    load_init_params,
    local_model_path,
    open_model_dir,
    shape_table,
    tokenizer_of,
)
from shipyard.train.resize_vocab import (
    fitted,
    plan_resize,
    record_plan,
    resize_params,
    token_vocab,
    vocab_mismatch,
)


def run_tokenizer(cfg: Config) -> Path | None:
    """The tokenizer a run's model speaks, which the run records in <run>/tokenizer: its chat (or
    preference) data's, its token shards', else the one of the model it starts from (a run, an
    import, an HF directory). None for a model trained on id .npy files from scratch."""
    if cfg.data.chat is not None:
        return chat_tokenizer_path(cfg.data.chat.tokenizer, cfg.train.init_from)
    if cfg.data.preference is not None and cfg.data.preference.tokenizer is not None:
        return chat_tokenizer_path(cfg.data.preference.tokenizer, cfg.train.init_from)
    paths, _ = cfg.data.sources()
    for p in paths:
        if storage.is_url(p) and storage.exists(str(storage.join(p, "tokenizer.json"))):
            return local_tokenizer(p)  # a shard set in a bucket: its published tokenizer, fetched
        if not storage.is_url(p) and (Path(p) / "tokenizer.json").is_file():
            return Path(p)
    return (
        None
        if cfg.train.init_from is None
        else tokenizer_of(local_model_path(cfg.train.init_from, "train.init_from"))
    )


def check_ids_fit(cfg: Config, tokenizer_dir: Path) -> None:
    """Token ids in the run's .npy sources must be ids of the tokenizer the model speaks (a .npy made
    with another tokenizer would train on the wrong tokens without any other error)."""

    size = load_tokenizer(tokenizer_dir).get_vocab_size(with_added_tokens=True)
    for path in cfg.data.sources()[0]:
        if not str(path).endswith(".npy"):
            continue
        if storage.is_url(path):  # read by ranges, a chunk at a time (never the whole file on disk)
            ids, step = RemoteArray(str(path)), 1 << 22
            top = max((int(ids[i : i + step].max(initial=0)) for i in range(0, len(ids), step)), default=0)
        else:
            top = int(np.load(path, mmap_mode="r", allow_pickle=False).max(initial=0))
        if top >= size:
            raise DataError(
                f"data.train_tokens: {path} holds token id {top}, but the model's tokenizer "
                f"({tokenizer_dir}) has {size} tokens; tokenize the data with that tokenizer"
            )


def chat_tokenizer_path(chat_tokenizer: str | None, init_from: str | None) -> Path:
    """The tokenizer for chat data: data.chat.tokenizer, else the one that came with train.init_from
    (an `import hf` directory or its params/, an SFT run's tokenizer/, a run's token-shard directory)."""
    if chat_tokenizer is not None:
        return local_tokenizer(chat_tokenizer)  # a URL's published tokenizer, fetched to the cache
    if init_from is None:
        raise DataError(
            "data.chat.tokenizer: not set and there is no train.init_from to take the tokenizer from"
        )
    found = tokenizer_of(local_model_path(init_from, "train.init_from"))
    if found is not None:
        return found
    raise DataError(
        f"data.chat.tokenizer: not set and no tokenizer.json found with train.init_from={init_from}; "
        "set data.chat.tokenizer to the base model's tokenizer.json"
    )


def base_params(cfg: Config, specs, shardings):
    """The params a run starts from: train.init_from (its embedding and head resized to the run's
    vocabulary when train.resize_vocab asks for it: `vocab_plan`), else the seeded random init."""

    from shipyard.model.transformer import param_specs

    if cfg.train.init_from is None:
        return init_params(specs, jax.random.key(cfg.train.seed), shardings)
    plan = vocab_plan(cfg) if cfg.train.resize_vocab else None
    if plan is None:
        return load_init_params(cfg.train.init_from, specs, shardings)
    # Read the base at its own shapes (only the vocabulary differs: check_init_from), then resize.
    old_specs = param_specs(cfg.model.model_copy(update={"vocab_size": plan.old_size}))
    old_shardings = None
    if shardings is not None:
        old_shardings = jax.tree.map(
            lambda sh, sp: fitted(sh, sp.shape), shardings, old_specs, is_leaf=is_spec
        )
    return resize_params(load_init_params(cfg.train.init_from, old_specs, old_shardings), plan, shardings)


def vocab_plan(cfg: Config):
    """How train.init_from's vocabulary maps to this run's (a `train.resize_vocab.VocabPlan`), or None
    when there is nothing to resize: no init_from, or the same size and (where both tokenizers are
    known) a vocabulary whose every token has the base's id. A mismatch without train.resize_vocab
    is one ConfigError line naming both sides; so is a resize under train.finetune, or one where a
    tokenizer to match the rows by is missing."""

    base = init_from_config(cfg.train.init_from)
    if base is None:  # a bare params tree: load_init_params checks its shapes against this model
        return None
    old_tok, new_tok = (
        tokenizer_of(local_model_path(cfg.train.init_from, "train.init_from")),
        run_tokenizer(cfg),
    )
    old_size, new_size = base.model.vocab_size, cfg.model.vocab_size
    where = f"train.init_from: {Path(cfg.train.init_from).absolute()}"
    if old_size != new_size:
        named = [f"tokenizer {t}" if t is not None else "no tokenizer.json" for t in (old_tok, new_tok)]
        problem = (
            f"{where} has a vocabulary of {old_size} ({named[0]}), this run's model.vocab_size is "
            f"{new_size} ({named[1]})"
        )
    elif old_tok is None or new_tok is None or old_tok.absolute() == new_tok.absolute():
        return None  # nothing to compare ids with, or the very same tokenizer
    else:
        detail = vocab_mismatch(token_vocab(old_tok), token_vocab(new_tok))
        if detail is None:
            return None
        problem = (
            f"{where} speaks the tokenizer {old_tok}, this run's tokenizer {new_tok} is another vocabulary "
            f"({detail}), so token ids would mean other strings"
        )
    if not cfg.train.resize_vocab:
        raise ConfigError(
            f"{problem}; set train.resize_vocab: true to resize the embedding and head to the run's vocabulary "
            "(rows of tokens both share copied), or use the base model's tokenizer and vocab_size"
        )
    if cfg.train.finetune is not None:
        raise ConfigError(
            "train.resize_vocab: needs full fine-tuning (train.finetune: null): LoRA and train_last_layers "
            "freeze the embedding, so the new tokens' rows would never train"
        )
    if old_tok is None or new_tok is None:
        missing = f"train.init_from ({cfg.train.init_from})" if old_tok is None else "this run's data"
        raise ConfigError(
            f"train.resize_vocab: rows are matched by token string, but {missing} has no tokenizer.json "
            "(give the run data tokenized with its tokenizer, or data.chat.tokenizer)"
        )
    return plan_resize(old_tok, new_tok, old_size, new_size)


def announce_vocab_resize(cfg: Config, run_dir: Path | None, say) -> None:
    """A resized run's start-up line ("resized the vocabulary 512 -> 600: ..."), and the resize in
    its provenance.json (`run_dir`; None on processes other than the main one)."""

    plan = vocab_plan(cfg) if cfg.train.resize_vocab else None
    if plan is None:
        return
    say(f"shipyard: {plan.summary()}")
    if run_dir is not None:
        record_plan(run_dir, plan)


def check_init_from(cfg: Config) -> None:
    """What train.init_from names, checked before a run writes anything (its params are read
    later): it exists, a model directory there holds a model of this shape (the vocabulary may
    differ only with train.resize_vocab: `vocab_plan`), and the checkpoints it will be read from
    verify (the run it names, that run's own base, and so on; imports and HF directories carry no
    checksums)."""
    if cfg.train.init_from is None:
        return
    path = local_model_path(cfg.train.init_from, "train.init_from").absolute()
    if not path.is_dir():
        raise ConfigError(
            f"train.init_from: {path} does not exist (expected a run directory or the output of `shipyard import hf`)"
        )
    base = init_from_config(cfg.train.init_from)
    if base is not None:
        _same_model(base, cfg, path)
    vocab_plan(cfg)  # a vocabulary mismatch is refused here, unless train.resize_vocab
    seen: set[Path] = set()
    while (path / "config.yaml").is_file() and (path / "checkpoints").is_dir() and path not in seen:
        seen.add(path)
        model_dir = open_model_dir(path, "train.init_from")
        model_dir.verify(model_dir.steps[0], "train.init_from")
        if model_dir.config.train.init_from is None:
            return
        path = local_model_path(model_dir.config.train.init_from, "train.init_from").absolute()


def _same_model(theirs: Config, ours: Config, path: Path) -> None:
    """The same model but for the vocabulary size (which `vocab_plan` decides about)."""

    shapes = shape_table(param_specs(ours.model))
    same_vocab = theirs.model.model_copy(update={"vocab_size": ours.model.vocab_size})
    if shape_table(param_specs(same_vocab)) != shapes:  # named with the base's own shapes
        check_same_shapes(param_specs(theirs.model), shapes, str(path))
