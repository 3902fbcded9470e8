"""Documents → token shards (the `tokenize` stage), encoded in parallel over processes.

Each worker process loads the tokenizer once and encodes batches of texts
single-threaded (`TOKENIZERS_PARALLELISM=false`: N processes each spawning N
Rust threads would oversubscribe the cores). Batches come back in input order,
so the shards are identical for any worker count. The output directory holds
the shards, manifest.json, a copy of the tokenizer (so the shards are
self-describing) and stats.json.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from shipyard import __version__
from shipyard.data.configs import ReadConfig, TokenizeConfig
from shipyard.data.documents import ReadStats, check_bad_fraction
from shipyard.data.shards import FORMAT_VERSION, MANIFEST, ShardWriter, token_dtype
from shipyard.data.stage import (
    StageStats,
    batches,
    config_record,
    pool_map,
    progress,
    read_inputs,
    stage_output,
    write_json,
)
from shipyard.data.tokenizer import (
    TOKENIZER_FILE,
    load_tokenizer,
    special_token_ids,
    tokenizer_record,
    tokenizer_sha256,
)
from shipyard.errors import DataError

# Set once per worker process by the pool initializer (a worker serves one stage).
_STATE: dict = {}


def _init(tokenizer_path: str, prefix: list[int], eos_id: int, dtype: str, single_thread: bool) -> None:
    if single_thread:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _STATE.update(tok=load_tokenizer(tokenizer_path), prefix=prefix, eos=eos_id, dtype=np.dtype(dtype))


def encode_batch(item: tuple[int, list[str]]) -> tuple[int, np.ndarray, np.ndarray]:
    """(source index, texts) → (source index, all tokens with EOS after each document, tokens per document)."""
    source, texts = item
    tok, prefix, eos, dtype = _STATE["tok"], _STATE["prefix"], _STATE["eos"], _STATE["dtype"]
    encodings = tok.encode_batch(texts, add_special_tokens=False)
    pieces, lengths = [], np.empty(len(texts), np.int64)
    for i, enc in enumerate(encodings):
        ids = [*prefix, *enc.ids, eos]
        pieces.append(np.asarray(ids, dtype=dtype))
        lengths[i] = len(ids)
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype)
    return source, tokens, lengths


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
    workers: int,
    overwrite: bool = False,
) -> dict:
    inputs = [str(p) for p in inputs]
    tokenizer_path = Path(tokenizer_path)
    tok = load_tokenizer(tokenizer_path)
    ids = special_token_ids(tokenizer_path, tok)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    dtype = token_dtype(vocab_size)
    prefix = [ids["bos_token"]] if cfg.add_bos and ids["bos_token"] is not None else []
    if cfg.add_bos and not prefix:
        raise DataError(f"data tokenize: add_bos is set but tokenizer {tokenizer_path} has no BOS token")
    config = config_record(read, tokenize=cfg, tokenizer=tokenizer_record(tokenizer_path))
    stats = StageStats("tokenize", inputs, config, workers)
    per_source = {src: {"documents": 0, "tokens": 0, "bytes": 0} for src in inputs}
    read_all = []

    def work():
        # Inputs one after another, each tagged, so the manifest can count per source.
        for index, src in enumerate(inputs):
            read_stats, docs = read_inputs([src], read.text_field)
            read_all.append(read_stats)
            for batch in batches(docs, max_docs=cfg.batch_documents):
                texts = [d.text for d in batch]
                nbytes = sum(len(t.encode("utf-8")) for t in texts)
                stats.bytes_in += nbytes
                per_source[src]["bytes"] += nbytes
                yield index, texts

    with stage_output(out, overwrite, "tokenize") as tmp:
        writer = ShardWriter(tmp, dtype, cfg.shard_tokens)
        single = workers > 1  # one worker runs in this process and may use tokenizers' own threads
        with progress("tokenize", inputs) as bar:
            for index, tokens, lengths in pool_map(
                encode_batch,
                work(),
                workers,
                _init,
                (str(tokenizer_path), prefix, ids["eos_token"], dtype.str, single),
            ):
                # whole documents go to a shard; split the batch where a shard fills up
                ends = np.cumsum(lengths)
                start = 0
                for count in _split_at_shard_boundaries(lengths, writer.room, cfg.shard_tokens):
                    lo = int(ends[start - 1]) if start else 0
                    writer.write(tokens[lo : int(ends[start + count - 1])], count)
                    start += count
                src = inputs[index]
                per_source[src]["documents"] += len(lengths)
                per_source[src]["tokens"] += int(lengths.sum())
                stats.documents_in += len(lengths)
                bar.update(len(lengths))
        shards = writer.close()
        merged = _merge(read_all)
        check_bad_fraction(merged, read.max_bad_fraction, "data tokenize")
        shutil.copy(
            tokenizer_path / TOKENIZER_FILE if tokenizer_path.is_dir() else tokenizer_path,
            tmp / TOKENIZER_FILE,
        )
        sidecar = (
            tokenizer_path if tokenizer_path.is_dir() else tokenizer_path.parent
        ) / "tokenizer_config.json"
        if sidecar.is_file():
            shutil.copy(sidecar, tmp / "tokenizer_config.json")
        total_tokens = sum(s["tokens"] for s in shards)
        manifest = {
            "format_version": FORMAT_VERSION,
            "shipyard_version": __version__,
            "tokenizer": {
                "file": TOKENIZER_FILE,
                "sha256": tokenizer_sha256(tokenizer_path),
                "source": str(tokenizer_path),
            },
            "vocab_size": vocab_size,
            "dtype": dtype.name,
            "eos_id": ids["eos_token"],
            "bos_id": ids["bos_token"],
            "pad_id": ids["pad_token"],
            "add_bos": cfg.add_bos,
            "documents": sum(s["documents"] for s in shards),
            "tokens": total_tokens,
            "shards": shards,
            "sources": per_source,
        }
        write_json(tmp / MANIFEST, manifest)
        stats.documents_out = manifest["documents"]
        stats.bytes_out = sum((tmp / s["file"]).stat().st_size for s in shards)
        result = stats.as_dict(merged)
        result.update(
            tokens=total_tokens,
            shards=len(shards),
            bytes_per_token=round(stats.bytes_in / max(total_tokens, 1), 4),
        )
        write_json(tmp / "stats.json", result)
    return result


def _merge(all_stats: list[ReadStats]) -> ReadStats:
    merged = ReadStats()
    for s in all_stats:
        merged.documents += s.documents
        merged.bytes += s.bytes
        for k, v in s.bad.items():
            merged.bad[k] = merged.bad.get(k, 0) + v
        merged.examples.extend(s.examples[: 20 - len(merged.examples)])
    return merged


def _split_at_shard_boundaries(lengths: np.ndarray, room: int, shard_tokens: int):
    """Document counts of consecutive writes, so that a shard closes right after it reaches its size."""
    count, filled = 0, 0
    for n in lengths:
        count += 1
        filled += int(n)
        if filled >= room:
            yield count
            count, filled, room = 0, 0, shard_tokens
    if count:
        yield count
