"""Documents → token shards (the `tokenize` stage), encoded in parallel over processes.

Each worker process loads the tokenizer once and encodes batches of texts
single-threaded (`TOKENIZERS_PARALLELISM=false`: N processes each spawning N
Rust threads would oversubscribe the cores). A unit's tokens go to the stage's
scratch files, and the shards are assembled from them by tasks too
(shard_tasks.py), laid out exactly as one writer in input order would: the
shards are identical for any worker count or cluster, and no token passes
through the driver. The output directory holds the shards, manifest.json, a
copy of the tokenizer (so the shards are self-describing) and stats.json.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from shipyard import __version__, storage
from shipyard.data.configs import ReadConfig, TokenizeConfig
from shipyard.data.documents import ReadStats, check_bad_fraction, read_unit
from shipyard.data.remote_tokenizer import local_tokenizer
from shipyard.data.resume import header
from shipyard.data.shard_tasks import SCRATCH as TOKEN_SCRATCH
from shipyard.data.shard_tasks import TokenScratch, layout, save_unit, write_shard
from shipyard.data.shards import FORMAT_VERSION, MANIFEST, shard_header, token_dtype
from shipyard.data.stage import (
    StageStats,
    Workers,
    batches,
    config_record,
    in_process,
    open_pool,
    plan,
    run_tasks,
    run_units,
    stage_output,
)
from shipyard.data.tokenizer import (
    TOKENIZER_FILE,
    load_tokenizer,
    special_token_ids,
    tokenizer_from_json,
    tokenizer_record,
    tokenizer_sha256,
)
from shipyard.errors import DataError
from shipyard.output import write_json

# Set once per worker process by the pool initializer (a worker serves one stage).
_STATE: dict = {}


def _init(tokenizer_text: str, prefix: list[int], eos_id: int, dtype: str, single_thread: bool) -> None:
    """A worker's setup. The tokenizer comes as its JSON text, not a path: a Ray task on another node
    has no access to the driver's copy (a bucket tokenizer is fetched once, by the driver)."""
    if single_thread:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = tokenizer_from_json(tokenizer_text, "sent by the driver")
    _STATE.update(tok=tok, prefix=prefix, eos=eos_id, dtype=np.dtype(dtype))


def encode_unit(item: tuple) -> dict:
    """Worker: read one unit and encode it (EOS after each document) into the stage's scratch files:
    its tokens and tokens per document."""
    u, unit, text_field, batch_documents, scratch = item
    tok, prefix, eos, dtype = _STATE["tok"], _STATE["prefix"], _STATE["eos"], _STATE["dtype"]
    read = ReadStats()
    pieces, lengths = [], []
    for batch in batches(read_unit(unit, read, text_field), max_docs=batch_documents):
        for enc in tok.encode_batch([d.text for d in batch], add_special_tokens=False):
            ids = [*prefix, *enc.ids, eos]
            pieces.append(np.asarray(ids, dtype=dtype))
            lengths.append(len(ids))
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype)
    files = save_unit(scratch, u, tokens, np.asarray(lengths, np.int64))
    return {
        "token_count": int(tokens.size),
        "read": read,
        "documents_in": read.documents,
        "bytes_in": read.bytes,
        "files": files,
    }


def encode_document(tok, text: str, eos_id: int, bos_id: int | None = None) -> list[int]:
    """What one document becomes in a shard (for tests and tools): [BOS] + encode(text) + [EOS]."""
    return [
        *([bos_id] if bos_id is not None else []),
        *tok.encode(text, add_special_tokens=False).ids,
        eos_id,
    ]


def run_tokenize(
    inputs: list[str],
    out: Path,
    tokenizer_path: str | Path,
    cfg: TokenizeConfig,
    read: ReadConfig,
    workers: Workers,
    overwrite: bool = False,
) -> dict:
    inputs = [str(p) for p in inputs]
    named = tokenizer_path  # as given (a URL is recorded as such, without credentials)
    tokenizer_path = local_tokenizer(tokenizer_path)
    tok = load_tokenizer(tokenizer_path)
    ids = special_token_ids(tokenizer_path, tok)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    dtype = token_dtype(vocab_size)
    prefix = [ids["bos_token"]] if cfg.add_bos and ids["bos_token"] is not None else []
    if cfg.add_bos and not prefix:
        raise DataError(f"data tokenize: add_bos is set but tokenizer {tokenizer_path} has no BOS token")
    config = config_record(read, tokenize=cfg, tokenizer=tokenizer_record(named))
    stats = StageStats("tokenize", inputs, config, workers)
    # units of each input, tagged with it, so the manifest can count per source
    tagged = [(src, u) for src in inputs for u in plan([src])]
    units = [u for _, u in tagged]
    per_source = {storage.redact(src): {"documents": 0, "tokens": 0, "bytes": 0} for src in inputs}
    run = header("tokenize", [storage.redact(i) for i in inputs], config, units)
    # one worker runs in this process and may use tokenizers' own threads
    single = not in_process(workers)
    file = tokenizer_path / TOKENIZER_FILE if tokenizer_path.is_dir() else tokenizer_path
    init = (file.read_text(encoding="utf-8"), prefix, ids["eos_token"], dtype.str, single)
    with (
        stage_output(out, overwrite, "tokenize", workers, run) as dest,
        open_pool(workers, _init, init) as pool,
    ):
        tmp = dest.local
        scratch = TokenScratch(str(dest.parts).rstrip("/"), dtype.str)
        items = ((u, unit, read.text_field, cfg.batch_documents, scratch) for u, unit in enumerate(units))
        encoded = run_units("tokenize", units, encode_unit, items, pool, _init, init, dest.journal("encode"))
        for (src, _), r in zip(tagged, encoded):
            stats.add(r)
            counts = per_source[storage.redact(src)]
            counts["documents"] += r["documents_in"]
            counts["tokens"] += r["token_count"]
            counts["bytes"] += r["bytes_in"]
        check_bad_fraction(stats.read, read.max_bad_fraction, "data tokenize")
        pieces = layout(scratch, len(units), cfg.shard_tokens)
        items = [(k, p, scratch, dest.parts) for k, p in enumerate(pieces)]
        shards = []
        for r in run_tasks("tokenize: shards", write_shard, items, pool, dest.journal("shards")):
            shards.append(r["entry"])
            dest.add(r)
        storage.remove(f"{scratch.stage_dir}/{TOKEN_SCRATCH}")
        _copy_tokenizer(tokenizer_path, tmp)
        total_tokens = sum(s["tokens"] for s in shards)
        manifest = _manifest(named, tokenizer_path, vocab_size, dtype, ids, cfg, shards, per_source)
        write_json(tmp / MANIFEST, manifest)
        stats.documents_out = manifest["documents"]
        stats.bytes_out = sum(
            len(shard_header(dtype, s["tokens"])) + s["tokens"] * dtype.itemsize for s in shards
        )
        result = stats.as_dict(dest.nodes)
        result.update(
            tokens=total_tokens,
            shards=len(shards),
            bytes_per_token=round(stats.bytes_in / max(total_tokens, 1), 4),
        )
        write_json(tmp / "stats.json", result)
    return result


def _manifest(
    named, tokenizer_path: Path, vocab_size: int, dtype, ids: dict, cfg: TokenizeConfig, shards, per_source
) -> dict:
    """The shard directory's manifest.json: format, tokenizer (file, sha256, where it came from as
    given), vocabulary, dtype, special ids, the shards and the counts per source."""
    return {
        "format_version": FORMAT_VERSION,
        "shipyard_version": __version__,
        "tokenizer": {
            "file": TOKENIZER_FILE,
            "sha256": tokenizer_sha256(tokenizer_path),
            "source": storage.redact(named),
        },
        "vocab_size": vocab_size,
        "dtype": dtype.name,
        "eos_id": ids["eos_token"],
        "bos_id": ids["bos_token"],
        "pad_id": ids["pad_token"],
        "add_bos": cfg.add_bos,
        "documents": sum(s["documents"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "shards": shards,
        "sources": per_source,
    }


def _copy_tokenizer(tokenizer_path: Path, out: Path) -> None:
    """tokenizer.json (and its tokenizer_config.json, when there is one) into the shard directory."""
    base = tokenizer_path if tokenizer_path.is_dir() else tokenizer_path.parent
    shutil.copy(
        tokenizer_path / TOKENIZER_FILE if tokenizer_path.is_dir() else tokenizer_path, out / TOKENIZER_FILE
    )
    if (base / "tokenizer_config.json").is_file():
        shutil.copy(base / "tokenizer_config.json", out / "tokenizer_config.json")
