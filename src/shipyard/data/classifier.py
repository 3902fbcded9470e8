"""A fastText quality classifier (DCLM / Marin style): train it, then score and keep documents.

`run_classifier_train` learns positive vs. negative documents (e.g. curated
text vs. a crawl) and writes `model.bin` and `report.json` (held-out accuracy,
precision, recall). `run_classify` scores every document with the probability
of the positive class, writes it into the record and keeps documents by a
threshold or the top fraction of all scores. Scoring runs in the data stages'
work units and ordered pool (data/stage.py), so its output is byte-identical
for any number of workers.

fastText sees one line per document: lowercased word and punctuation tokens
separated by spaces (its own tokenizer only splits on whitespace, so "end." and
"end" would be different words).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np

from shipyard import storage
from shipyard.data import shuffle
from shipyard.data.configs import ClassifierTrainConfig, ClassifyConfig, ReadConfig
from shipyard.data.documents import Document, ReadStats, check_bad_fraction, read_documents, read_unit
from shipyard.data.hashcache import file_sha256
from shipyard.data.published import local_dir
from shipyard.data.resume import header
from shipyard.data.stage import (
    StageStats,
    Workers,
    batches,
    config_record,
    open_pool,
    part_path,
    plan,
    publish_part,
    run_units,
    stage_output,
)
from shipyard.errors import DataError
from shipyard.output import write_json

POSITIVE, NEGATIVE = "__label__hq", "__label__lq"
TOKEN = re.compile(r"\w+|[^\w\s]")
MODEL_FILE, REPORT_FILE = "model.bin", "report.json"
SCORES = "_scores"  # the --top-fraction scoring pass's per-unit scores, inside the output being built


def _fasttext():
    try:
        import fasttext
    except ImportError as e:  # an optional extra: say how to get it
        raise DataError(
            "the quality classifier needs fastText: pip install 'shipyard[quality]' (fasttext-numpy2-wheel)"
        ) from e
    return fasttext


def fasttext_line(text: str, max_tokens: int | None) -> str:
    """A document as fastText wants it: one line of lowercased tokens, at most max_tokens of them."""
    if max_tokens is None:
        return " ".join(TOKEN.findall(text.lower()))
    tokens = []
    for m in TOKEN.finditer(text.lower()):
        tokens.append(m.group())
        if len(tokens) >= max_tokens:
            break
    return " ".join(tokens)


# ----------------------------------------------------------------------------- training


def _read_class(inputs: list[str], read: ReadConfig, what: str) -> list[str]:
    if not inputs:
        raise DataError(
            f"data classifier-train: no {what} inputs given (expected document files or directories)"
        )
    plan(inputs)  # a missing input fails the way every stage's does
    stats = ReadStats()
    texts = [doc.text for doc in read_documents(inputs, stats, read.text_field)]
    check_bad_fraction(stats, read.max_bad_fraction, f"data classifier-train ({what})")
    if not texts:
        raise DataError(f"data classifier-train: the {what} inputs {', '.join(inputs)} hold no documents")
    return texts


def _split(n: int, fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) indices of n documents: a seeded permutation, held-out first."""
    order = rng.permutation(n)
    k = min(int(round(n * fraction)), n - 1)  # at least one document of each class trains
    return np.sort(order[k:]), np.sort(order[:k])


def _held_out_report(model, lines: list[str], labels: list[str]) -> dict:
    """Accuracy, and precision / recall of the positive class, on the held-out lines."""
    if not lines:
        return {"documents": 0, "accuracy": None, "precision": None, "recall": None}
    predicted = [p[0] for p in model.predict(lines, k=1)[0]]
    tp = sum(p == POSITIVE and t == POSITIVE for p, t in zip(predicted, labels))
    fp = sum(p == POSITIVE and t == NEGATIVE for p, t in zip(predicted, labels))
    fn = sum(p == NEGATIVE and t == POSITIVE for p, t in zip(predicted, labels))
    correct = sum(p == t for p, t in zip(predicted, labels))
    return {
        "documents": len(lines),
        "accuracy": correct / len(lines),
        "precision": tp / (tp + fp) if tp + fp else None,
        "recall": tp / (tp + fn) if tp + fn else None,
    }


def _train_child(train_file: str, model_file: str, cfg_json: dict) -> str | None:
    """In a fresh process: train and save the model; the error message if fastText fails."""
    cfg = ClassifierTrainConfig.model_validate(cfg_json)
    try:
        model = _fasttext().train_supervised(
            train_file,
            lr=cfg.lr,
            epoch=cfg.epoch,
            wordNgrams=cfg.word_ngrams,
            dim=cfg.dim,
            minCount=cfg.min_count,
            bucket=cfg.bucket,
            seed=cfg.seed,
            thread=cfg.threads,
            loss="softmax",
            verbose=0,
        )
    except RuntimeError as e:
        return str(e)
    model.save_model(model_file)
    return None


def _train_model(train_file: Path, model_file: Path, cfg: ClassifierTrainConfig):
    """fastText's supervised training, in a fresh (spawned) process, then the model loaded here.

    Why a fresh process: with fasttext-numpy2-wheel 0.9.2, a model trained
    after other models in the same process sometimes differs from the same
    training in a fresh process, or stops with "Encountered NaN."; in a fresh
    process the same file and seed always gave the same bytes.
    """
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        error = pool.apply(_train_child, (str(train_file), str(model_file), cfg.model_dump(mode="json")))
    if error is not None:
        raise DataError(
            f"data classifier-train: fastText training failed ({error}); "
            f"lower lr (now {cfg.lr}) or epoch (now {cfg.epoch})"
        )
    return _fasttext().load_model(str(model_file))


def run_classifier_train(
    positive: list[str],
    negative: list[str],
    out: Path,
    cfg: ClassifierTrainConfig,
    read: ReadConfig,
    overwrite: bool = False,
) -> dict:
    """Train on positive vs. negative documents; write out/model.bin and out/report.json atomically."""
    positive, negative = [str(p) for p in positive], [str(p) for p in negative]
    classes = {
        POSITIVE: _read_class(positive, read, "positive"),
        NEGATIVE: _read_class(negative, read, "negative"),
    }
    rng = np.random.default_rng(cfg.seed)
    train, held, held_labels, counts = [], [], [], {}
    for label, texts in classes.items():
        tr, ho = _split(len(texts), cfg.held_out_fraction, rng)
        train += [f"{label} {fasttext_line(texts[i], cfg.max_tokens)}" for i in tr]
        held += [fasttext_line(texts[i], cfg.max_tokens) for i in ho]
        held_labels += [label] * len(ho)
        counts[label.removeprefix("__label__")] = {"train": len(tr), "held_out": len(ho)}
    # fastText trains in file order: interleave the classes so SGD does not see one class, then the other.
    train = [train[i] for i in rng.permutation(len(train))]
    _fasttext()  # a missing package fails before any work
    with stage_output(out, overwrite, "classifier-train") as dest:
        tmp = dest.local
        train_file = tmp / "train.txt"
        train_file.write_text("\n".join(train) + "\n", encoding="utf-8")
        model = _train_model(train_file, tmp / MODEL_FILE, cfg)
        train_file.unlink()  # a copy of the inputs; the report says what went in
        report = {
            "stage": "classifier-train",
            "positive": positive,
            "negative": negative,
            "config": config_record(read, **{"classifier-train": cfg}),
            "counts": counts,
            "held_out": _held_out_report(model, held, held_labels),
        }
        write_json(tmp / REPORT_FILE, report)
    return report


# ----------------------------------------------------------------------------- scoring


def load_classifier(model_dir: Path, what: str = "data classify"):
    """(fastText model, its training config) from a classifier-train output directory."""
    model_dir = Path(model_dir)
    model_file, report_file = model_dir / MODEL_FILE, model_dir / REPORT_FILE
    if not model_file.is_file() or not report_file.is_file():
        raise DataError(
            f"{what}: {model_dir} is not a classifier directory (expected {MODEL_FILE} and {REPORT_FILE} "
            "from `shipyard data classifier-train`)"
        )
    cfg = ClassifierTrainConfig.model_validate(
        json.loads(report_file.read_text())["config"]["classifier-train"]
    )
    try:
        model = _fasttext().load_model(str(model_file))
    except ValueError as e:
        raise DataError(f"{what}: {model_file} is not a fastText model ({e})") from e
    return model, cfg


def score_texts(model, texts: list[str], max_tokens: int | None) -> np.ndarray:
    """Probability of the positive class for each text."""
    if not texts:
        return np.zeros(0)
    labels, probs = model.predict([fasttext_line(t, max_tokens) for t in texts], k=2)
    # fastText's probabilities are exp(log(p + 1e-5)), so they can pass 1: normalise the pair.
    out = np.empty(len(texts))
    for i, (lab, p) in enumerate(zip(labels, probs)):
        pos = float(p[0]) if lab[0] == POSITIVE else float(p[1]) if len(p) > 1 else 0.0
        out[i] = pos / float(sum(p))
    return out


# Set once per worker process by the pool initializer: (model, its config, ClassifyConfig), or the
# error that loading the model raised.
_STATE: tuple | Exception | None = None


def _init(model_dir: str, cfg: ClassifyConfig) -> None:
    global _STATE
    try:
        model, train_cfg = load_classifier(Path(model_dir))
    except DataError as e:
        # Kept for the first unit to raise: an error raised by a pool initializer
        # kills the worker, the pool starts another, and the stage would hang.
        _STATE = e
        return
    _STATE = (model, train_cfg, cfg)


def _state() -> tuple:
    if isinstance(_STATE, Exception):
        raise _STATE
    return _STATE


def _unit_scores(unit, text_field: str, read: ReadStats, known: np.ndarray | None = None):
    """(batch of documents, their scores) over one unit; `known`: this unit's scores from a first pass."""
    model, train_cfg, _ = _state()
    done = 0
    for batch in batches(read_unit(unit, read, text_field)):
        if known is not None:
            yield batch, known[done : done + len(batch)]
        else:
            yield batch, score_texts(model, [d.text for d in batch], train_cfg.max_tokens)
        done += len(batch)


def _scores_file(stage_dir: str, u: int) -> str:
    return f"{stage_dir.rstrip('/')}/{SCORES}/{u:05d}.npy"


def _score_only(item: tuple) -> dict:
    """Worker, first pass of --top-fraction: every score of unit `u`, in order, into its scratch
    file (`_scores/`, inside the output being built: journaled, and read back by the second pass)."""
    u, unit, stage_dir, text_field = item
    parts = [s for _, s in _unit_scores(unit, text_field, ReadStats())]
    path = _scores_file(stage_dir, u)
    digest = shuffle.put_array(path, np.concatenate(parts) if parts else np.zeros(0))
    return {"files": {path: digest}}


def _record(doc: Document, field: str, score: float) -> bytes:
    rec = {"id": doc.id, "source": doc.source, "text": doc.text, field: score}
    return (json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8")


def _level(score: float, n: int) -> int:
    return min(int(score * n), n - 1)


class _PartWriter:
    """zstd jsonl like every stage's parts (data/stage.py DocWriter) with the score field added;
    the file is opened on the first record, so a unit that keeps nothing writes no part."""

    def __init__(self, path: Path):
        self.path, self._file, self._writer = path, None, None

    def write(self, line: bytes) -> None:
        if self._writer is None:
            import zstandard

            self._file = open(self.path, "wb")  # noqa: SIM115
            self._writer = zstandard.ZstdCompressor(level=3).stream_writer(self._file, closefd=False)
        self._writer.write(line)

    def close(self) -> str | None:
        if self._writer is None:
            return None
        self._writer.close()
        self._file.close()
        return self.path.name


def _classify_unit(item: tuple) -> dict:
    """Worker: score one unit, keep by the cutoff (and this unit's share of tied scores), write part `index`."""
    index, unit, out_dir, text_field, cutoff, ties, ranked = item
    _, _, cfg = _state()
    known = shuffle.get_array(_scores_file(out_dir, index)) if ranked else None
    read = ReadStats()
    r = {"documents_in": 0, "bytes_out": 0, "documents_out": 0, "dropped": Counter()}
    hist = np.zeros(cfg.histogram_bins, np.int64)
    examples: dict[int, dict] = {}
    writer = _PartWriter(part_path(out_dir, index))
    try:
        for batch, scores in _unit_scores(unit, text_field, read, known):
            r["documents_in"] += len(batch)
            hist += np.histogram(scores, bins=cfg.histogram_bins, range=(0.0, 1.0))[0]
            for doc, score in zip(batch, scores.tolist()):
                level = _level(score, cfg.example_levels)
                examples.setdefault(level, {"id": doc.id, "score": score, "start": doc.text[:200]})
                keep = score > cutoff or (score == cutoff and ties != 0)
                if score == cutoff and ties > 0:
                    ties -= 1  # ties < 0: keep every tie (threshold mode)
                if keep:
                    writer.write(_record(doc, cfg.score_field, score))
                    r["bytes_out"] += len(doc.text.encode("utf-8"))
                    r["documents_out"] += 1
                else:
                    r["dropped"]["below_cutoff"] += 1
    finally:
        written = writer.close() is not None
    r.update(publish_part(writer.path, written, out_dir))
    # plain lists: a unit's result is journaled as JSON (resume.py)
    r.update(bytes_in=read.bytes, read=read, histogram=hist.tolist(), levels=sorted(examples.items()))
    return r


def top_fraction_cutoffs(scores: list[np.ndarray], fraction: float) -> tuple[float, list[int]]:
    """(cutoff, per-unit count of documents scoring exactly the cutoff to keep) so that exactly
    round(fraction * N) documents are kept: every one above the cutoff, ties in input order."""
    everything = np.concatenate(scores) if scores else np.zeros(0)
    k = int(round(fraction * len(everything)))
    if k == 0:
        return float("inf"), [0] * len(scores)
    cutoff = float(np.sort(everything)[::-1][k - 1])
    need = k - int((everything > cutoff).sum())
    ties = []
    for s in scores:
        take = min(need, int((s == cutoff).sum()))
        ties.append(take)
        need -= take
    return cutoff, ties


def run_classify(
    inputs: list[str],
    out: Path,
    model_dir: Path,
    cfg: ClassifyConfig,
    read: ReadConfig,
    workers: Workers,
    overwrite: bool = False,
) -> dict:
    """Score every document, keep by cfg.threshold (default 0.5) or cfg.top_fraction; write parts,
    stats.json (histogram, examples by score level) and score_histogram.png into `out` atomically."""
    inputs = [str(p) for p in inputs]
    named = storage.redact(model_dir)  # what stats.json records (a URL, not its cache directory)
    model_dir = local_dir(  # a model URL: fetched once into the cache
        model_dir,
        (MODEL_FILE, REPORT_FILE),
        "classifiers",
        "data classify --model",
        "data classifier-train --out URL",
    )
    load_classifier(Path(model_dir))  # a bad model directory fails here, before any work
    units = plan(inputs)
    stats = StageStats("classify", inputs, config_record(read, classify=cfg), workers)  # times both passes
    init = (str(Path(model_dir).resolve()), cfg)  # absolute: a Ray task on another node reads it too
    model = {"source": named, "sha256": file_sha256(Path(model_dir) / MODEL_FILE)}
    run = header("classify", [storage.redact(i) for i in inputs], {**stats.config, "model": model}, units)
    ranked = cfg.top_fraction is not None
    hist = np.zeros(cfg.histogram_bins, np.int64)
    levels: dict[int, dict] = {}
    with (
        stage_output(out, overwrite, "classify", workers, run) as dest,
        open_pool(workers, _init, init) as pool,
    ):
        tmp = dest.local
        if ranked:
            items = ((u, unit, dest.parts, read.text_field) for u, unit in enumerate(units))
            scoring = run_units(
                "classify (scoring)", units, _score_only, items, pool, _init, init, dest.journal("scores")
            )
            for _ in scoring:
                pass
            scores = [shuffle.get_array(_scores_file(dest.parts, u)) for u in range(len(units))]
            cutoff, ties = top_fraction_cutoffs(scores, cfg.top_fraction)
            del scores
        else:
            cutoff = cfg.threshold if cfg.threshold is not None else 0.5
            ties = [-1] * len(units)
        items = ((i, u, dest.parts, read.text_field, cutoff, ties[i], ranked) for i, u in enumerate(units))
        parts = []
        for r in run_units("classify", units, _classify_unit, items, pool, _init, init, dest.journal()):
            stats.add(r)
            dest.add(r)
            hist += np.asarray(r["histogram"], np.int64)
            for level, ex in r["levels"]:
                levels.setdefault(level, ex)
            if r["part"]:
                parts.append(r["part"])
        if ranked:
            storage.remove(f"{str(dest.parts).rstrip('/')}/{SCORES}")
        check_bad_fraction(stats.read, read.max_bad_fraction, "data classify")
        stats.extra = {
            "model": named,
            "cutoff": cutoff if np.isfinite(cutoff) else None,
            "histogram": {
                "edges": np.linspace(0, 1, cfg.histogram_bins + 1).tolist(),
                "counts": hist.tolist(),
            },
            "examples_by_score": [levels[k] for k in sorted(levels)],
            "plot": "score_histogram.png",
        }
        result = stats.as_dict(dest.nodes)
        result["parts"] = parts
        _plot_histogram(hist, cutoff, tmp / "score_histogram.png")
        write_json(tmp / "stats.json", result)
    return result


def _plot_histogram(counts: np.ndarray, cutoff: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    edges = np.linspace(0, 1, len(counts) + 1)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(edges[:-1], counts, width=np.diff(edges), align="edge", color="#4c72b0", edgecolor="white")
    if np.isfinite(cutoff):
        ax.axvline(cutoff, color="#c44e52", linestyle="--", label=f"cutoff {cutoff:.3f}")
        ax.legend()
    ax.set_xlabel("quality score (probability of the positive class)")
    ax.set_ylabel("documents")
    ax.set_xlim(0, 1)
    fig.tight_layout()
    # no Software/date metadata: the same scores give the same bytes
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
