"""Data-stage throughput on the stdlib corpus, and fuzzy dedup side by side with datasketch.

Every stage runs through its real entry point (reading, process pool, writing,
stats) on the interpreter's standard library (~12 MB of code), so MB/s
includes I/O. Extraction runs on HTML pages built from the same text with
navigation, script and style around it.

Fuzzy dedup: the corpus, `--scale - 1` variants of it with 30% of words
replaced (distinct documents: Jaccard ≈ 0.1), and planted near-duplicates (1%
of words replaced, shingle Jaccard ≈ 0.9) of the first `--planted` documents. shipyard's dedup
stage (exact off, so only MinHash + LSH counts) against datasketch's MinHash
+ MinHashLSH with the same shingles (5 normalised words), permutations (128),
bands x rows (16 x 8) and threshold (0.8), in the same run. datasketch is timed
on signatures and LSH only (no reading or writing), so the comparison favours
it. Recall is the fraction of planted duplicates each one removes.

Tokenization: all cores (one process per core) against one process with
tokenizers' own threading off.

    .venv/bin/python bench/data_throughput.py [--planted 200] [--out bench/results/data_throughput.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from data_fixtures import mutate  # noqa: E402

from shipyard.data.configs import (  # noqa: E402
    DedupConfig,
    ExtractConfig,
    FilterConfig,
    ReadConfig,
    TokenizeConfig,
    TokenizerTrainConfig,
)
from shipyard.data.dedup import run_dedup  # noqa: E402
from shipyard.data.documents import ReadStats, read_documents  # noqa: E402
from shipyard.data.extract import run_extract  # noqa: E402
from shipyard.data.filters import run_filter  # noqa: E402
from shipyard.data.stage import default_workers  # noqa: E402
from shipyard.data.stdlib import write_stdlib_documents  # noqa: E402
from shipyard.data.tokenize import run_tokenize  # noqa: E402
from shipyard.data.tokenizer import run_tokenizer_train  # noqa: E402

PAGE = (
    "<!DOCTYPE html><html><head><title>{title}</title><style>body{{margin:0}} .nav{{color:#333}}</style>"
    "<script>window.analytics=[];function track(e){{analytics.push(e)}}</script></head><body>"
    "<nav class='nav'><a href='/'>Home</a> <a href='/docs'>Docs</a> <a href='/blog'>Blog</a></nav>"
    "<main><article><h1>{title}</h1>{paragraphs}</article></main>"
    "<footer>Copyright 2026. <a href='/privacy'>Privacy</a> <a href='/terms'>Terms</a></footer></body></html>"
)


def _html_pages(docs, out_dir: Path) -> None:
    import html

    out_dir.mkdir()
    for i, doc in enumerate(docs):
        paras = "".join(f"<p>{html.escape(p)}</p>" for p in doc.text.split("\n\n") if p.strip())
        (out_dir / f"{i:05d}.html").write_text(PAGE.format(title=html.escape(doc.id), paragraphs=paras))


def _stage_result(stats: dict) -> dict:
    return {
        "mb_per_s": round(stats["bytes_in"] / 1e6 / stats["seconds"], 2),
        "docs_per_s": round(stats["documents_in"] / stats["seconds"], 1),
        "seconds": stats["seconds"],
        "documents_in": stats["documents_in"],
        "documents_out": stats["documents_out"],
        "mb_in": round(stats["bytes_in"] / 1e6, 2),
    }


def datasketch_dedup(docs, cfg: DedupConfig) -> tuple[set[str], float]:
    """Removed ids and seconds for datasketch MinHash + MinHashLSH (query before insert; first kept)."""
    from datasketch import MinHash, MinHashLSH

    start = time.perf_counter()
    lsh = MinHashLSH(threshold=cfg.threshold, num_perm=cfg.num_perm, params=(cfg.bands, cfg.rows))
    removed = set()
    k = cfg.shingle_size
    for doc in docs:
        # the same words shipyard hashes (ngrams.word_spans), found by a regex over the bytes
        words = _WORD.findall(doc.text.encode("utf-8").lower())
        shingles = {b" ".join(words[i : i + k]) for i in range(max(len(words) - k + 1, 1))}
        m = MinHash(num_perm=cfg.num_perm, seed=cfg.seed)
        m.update_batch(list(shingles))
        # LSH candidates, then the same Jaccard check shipyard does
        if any(m.jaccard(other) >= cfg.threshold for other in (sigs[key] for key in lsh.query(m))):
            removed.add(doc.id)
            continue
        lsh.insert(doc.id, m)
        sigs[doc.id] = m
    return removed, time.perf_counter() - start


sigs: dict = {}
_WORD = re.compile(rb"[0-9A-Za-z_\x80-\xff]+")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--planted", type=int, default=200, help="near-duplicates planted for the dedup comparison"
    )
    ap.add_argument("--scale", type=int, default=3, help="dedup corpus: this many variants of the stdlib")
    ap.add_argument("--out", type=Path, default=Path("bench/results/data_throughput.json"))
    args = ap.parse_args()
    workers = default_workers()
    read = ReadConfig()
    results: dict = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": workers,
            "python": sys.version.split()[0],
        },
        "stages": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_stdlib_documents(tmp / "stdlib")
        train = [str(tmp / "stdlib" / "train.jsonl")]
        docs = list(read_documents(train, ReadStats()))
        print(
            f"corpus: {len(docs)} documents, {sum(len(d.text.encode()) for d in docs) / 1e6:.1f} MB",
            flush=True,
        )

        _html_pages(docs, tmp / "html")
        s = run_extract([str(tmp / "html")], tmp / "extract", ExtractConfig(), read, workers)
        results["stages"]["extract"] = _stage_result(s)
        s = run_filter(train, tmp / "filter", FilterConfig(), read, workers)
        results["stages"]["filter"] = _stage_result(s)
        s = run_dedup(train, tmp / "dedup", DedupConfig(), read, workers)
        results["stages"]["dedup"] = _stage_result(s)
        s = run_tokenizer_train(train, tmp / "tok", TokenizerTrainConfig(vocab_size=8192), read)
        results["stages"]["tokenizer-train"] = _stage_result(s)
        s = run_tokenize(train, tmp / "shards", tmp / "tok", TokenizeConfig(), read, workers)
        results["stages"]["tokenize"] = {
            **_stage_result(s),
            "tokens_per_s": round(s["tokens"] / s["seconds"]),
        }
        for name, r in results["stages"].items():
            print(f"{name:16s} {r['mb_per_s']:7.2f} MB/s  {r['docs_per_s']:8.1f} docs/s", flush=True)

        # tokenization: all cores vs one process (tokenizers' threads off, so one core)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        one = run_tokenize(train, tmp / "shards1", tmp / "tok", TokenizeConfig(), read, workers=1)
        results["tokenize_scaling"] = {
            "all_cores": {"workers": workers, **results["stages"]["tokenize"]},
            "one_process": {
                "workers": 1,
                **_stage_result(one),
                "tokens_per_s": round(one["tokens"] / one["seconds"]),
            },
        }
        results["tokenize_scaling"]["speedup"] = round(one["seconds"] / s["seconds"], 2)
        print(
            f"tokenize: {workers} processes {results['tokenize_scaling']['speedup']}x one process", flush=True
        )

        # fuzzy dedup vs datasketch: the corpus, `--scale - 1` copies with 30% of
        # words replaced (shingle Jaccard to the original ≈ 0.1: distinct
        # documents, so the corpus is bigger without new duplicates), and
        # planted near-duplicates (1% replaced, Jaccard ≈ 0.9) of the first ones.
        copies = [
            type(d)(id=f"copy{c}/{d.id}", text=mutate(d.text, 0.3, seed=1000 * c + i), source=d.source)
            for c in range(1, args.scale)
            for i, d in enumerate(docs)
        ]
        planted = [
            type(d)(id=f"planted/{d.id}", text=mutate(d.text, 0.01, seed=i), source=d.source)
            for i, d in enumerate(docs[: args.planted])
            if len(d.text.split()) >= 200
        ]
        from data_fixtures import write_jsonl

        mixed = docs + copies + planted
        path = write_jsonl(tmp / "mixed.jsonl", [d.text for d in mixed], [d.id for d in mixed])
        cfg = DedupConfig(exact=False)
        ours = {}
        for w in sorted({1, workers}):
            st = run_dedup([str(path)], tmp / f"dd{w}", cfg, read, w)
            kept = {d.id for d in read_documents([tmp / f"dd{w}"], ReadStats())}
            removed = {d.id for d in mixed} - kept
            ours[w] = {
                "seconds": st["seconds"],
                "docs_per_s": round(len(mixed) / st["seconds"], 1),
                "removed": len(removed),
                "planted_recall": round(sum(p.id in removed for p in planted) / len(planted), 4),
            }
        theirs_removed, theirs_s = datasketch_dedup(mixed, cfg)
        theirs = {
            "seconds": round(theirs_s, 3),
            "docs_per_s": round(len(mixed) / theirs_s, 1),
            "removed": len(theirs_removed),
            "planted_recall": round(sum(p.id in theirs_removed for p in planted) / len(planted), 4),
        }
        results["fuzzy_dedup"] = {
            "documents": len(mixed),
            "planted": len(planted),
            "config": cfg.model_dump(mode="json"),
            "shipyard_all_cores": {"workers": workers, **ours[workers]},
            "shipyard_one_process": ours[1],
            "datasketch": theirs,
            "speedup_all_cores": round(theirs_s / ours[workers]["seconds"], 2),
            "speedup_one_process": round(theirs_s / ours[1]["seconds"], 2),
            "target": ">= 3x datasketch at the same recall",
        }
        f = results["fuzzy_dedup"]
        print(
            f"fuzzy dedup on {len(mixed)} docs: shipyard {ours[workers]['docs_per_s']} docs/s "
            f"(recall {ours[workers]['planted_recall']}), one process {ours[1]['docs_per_s']} docs/s; "
            f"datasketch {theirs['docs_per_s']} docs/s (recall {theirs['planted_recall']}); "
            f"speedup {f['speedup_all_cores']}x ({f['speedup_one_process']}x on one process)",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
