"""Small corpora built by the data tests: prose, code, near-duplicates of known similarity."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = [
    f"{a}{b}"
    for a in ("ka", "lo", "mi", "nu", "pe", "ra", "si", "to", "ve", "zu")
    for b in ("bel", "dor", "fin", "gat", "hum", "jek", "lis", "mon", "pat", "rud", "sen", "tov", "wix")
]


def prose(seed: int, words: int = 300) -> str:
    """Sentences of pseudo-words that pass the prose filters (shape, alphabetic, punctuation)."""
    rng = random.Random(seed)
    out, sentence = [], []
    for _ in range(words):
        sentence.append(rng.choice(WORDS))
        if len(sentence) >= rng.randint(8, 14):
            out.append(" ".join(sentence).capitalize() + ".")
            sentence = []
    if sentence:
        out.append(" ".join(sentence).capitalize() + ".")
    return " ".join(out)


def mutate(text: str, fraction: float, seed: int) -> str:
    """Replace `fraction` of the words with fresh ones (lowers shingle Jaccard in a controlled way)."""
    rng = random.Random(seed)
    words = text.split()
    for i in rng.sample(range(len(words)), int(fraction * len(words))):
        words[i] = f"q{rng.randrange(10**9)}x"
    return " ".join(words)


def shingle_jaccard(a: str, b: str, k: int = 5) -> float:
    from shipyard.data.ngrams import normalized_words

    def shingles(t):
        w = normalized_words(t)
        return {tuple(w[i : i + k]) for i in range(len(w) - k + 1)}

    sa, sb = shingles(a), shingles(b)
    return len(sa & sb) / len(sa | sb)


def write_jsonl(path: Path, texts: list[str], ids: list[str] | None = None) -> Path:
    with open(path, "w") as f:
        for i, t in enumerate(texts):
            record = {"text": t}
            if ids:
                record["id"] = ids[i]
            f.write(json.dumps(record) + "\n")
    return path


# Contexts end without a space and choices start with one (the usual lm-eval split); ASCII, so lm-eval's
# acc_norm (divided by characters) and shipyard's (divided by UTF-8 bytes) use the same lengths.
MC_ROWS = [
    {"context": "Kabel lodor mifin", "choices": [" pegat.", " zumon tolis ravix kabel.", " x"], "label": 1},
    {"context": "Simon", "choices": [" rasen", " tovel"], "label": 0},
    {"context": "Mibel kamon kalis", "choices": [" kafin.", " lobel tovhum.", " ra", " sigat"], "label": 3},
    {"context": "Nujek pelis, rabel", "choices": [" tosen mipat.", " zurud"], "label": 1},
    {"context": "Verud sitov kahum lomon nufin", "choices": [" pejek.", " rawix sibel."], "label": 0},
    {"context": "Zugat", "choices": [" kadordor", " ve", " lohum nulis."], "label": 2},
]


def pipeline_docs(path: Path, n: int = 60) -> Path:
    """n small documents plus an exact duplicate of one (for dedup to remove), as a pipeline's input."""
    rows = []
    for i in range(n):
        words = " ".join(f"word{(i * 7 + j) % 97}" for j in range(40 + i % 20))
        rows.append({"id": f"d{i}", "text": f"Document {i}. " + words + ". The end of the text is here."})
    rows.append(dict(rows[3], id="dup"))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
