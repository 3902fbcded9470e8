"""Data pages: documents at a stage, what a filter dropped and why (the rule and its numbers), dedup
clusters side by side with their Jaccard estimates, decontamination hits with the matching n-gram
highlighted, classifier score histograms, a token shard set detokenized.

Everything comes from the step's own files: the stage's parts (read with the stages' reader,
`data.documents.read_documents`), its stats.json (the stage keeps the first examples of each kind),
and, for a dropped or removed document, its full text looked up by id in the step's input.
"""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

from shipyard.browse.html import chart, esc, page, pre, table

SAMPLE = 8
"""Documents shown per stage."""
CHARS = 1200
"""Characters of a document shown (the rest is cut, with a note)."""
LOOKUP_LIMIT = 200_000
"""Input documents scanned at most to find the dropped examples' full texts."""


def _stats(node) -> dict:
    path = node.path / "stats.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _docs(paths: list, limit: int) -> list:
    from shipyard.data.documents import ReadStats, read_documents

    try:
        return list(islice(read_documents([str(p) for p in paths], ReadStats()), limit))
    except Exception as e:  # a page shows what it can; the node page says whether the files verify
        return [f"(could not read: {type(e).__name__}: {e})"]


def _input_paths(node, role: str = "documents") -> list[str]:
    got = node.provenance.get("inputs", {}).get(role)
    return [got] if got else []


def _find(paths: list[str], ids: set[str]) -> dict:
    """id -> Document, for the `ids` among the first LOOKUP_LIMIT documents of `paths`."""
    from shipyard.data.documents import ReadStats, read_documents

    found = {}
    if not ids or not paths:
        return found
    try:
        for doc in islice(read_documents(paths, ReadStats()), LOOKUP_LIMIT):
            if doc.id in ids:
                found[doc.id] = doc
                if len(found) == len(ids):
                    break
    except Exception:
        pass
    return found


def _text(text: str, mark: str | None = None) -> str:
    """A document's text, cut at CHARS, with the first occurrence of `mark` highlighted."""
    cut = text[:CHARS]
    more = f"<span class=cut> … {len(text) - CHARS:,} more characters</span>" if len(text) > CHARS else ""
    if mark:
        at = cut.find(mark)
        if at >= 0:
            return f"<pre class=doc>{esc(cut[:at])}<mark>{esc(mark)}</mark>{esc(cut[at + len(mark) :])}{more}</pre>"
    return f"<pre class=doc>{esc(cut)}{more}</pre>"


def _sample(node) -> str:
    files = sorted(node.path.glob("*.jsonl")) if node.kind == "stdlib" else [node.path]
    docs = _docs(files, SAMPLE)
    out = [f"<h2>A sample of the output ({len(docs)} documents)</h2>"]
    for d in docs:
        if isinstance(d, str):
            out.append(f"<p>{esc(d)}</p>")
        else:
            out.append(f"<h3><code>{esc(d.id)}</code> <small>{esc(d.source)}</small></h3>{_text(d.text)}")
    return "".join(out)


def _counts(stats: dict) -> str:
    rows = [[esc(k), esc(v)] for k, v in stats.items() if isinstance(v, (int, float, str)) and k != "plot"]
    dropped = stats.get("dropped") or {}
    drops = (
        table(["rule", "documents dropped"], [[esc(k), esc(v)] for k, v in dropped.items()])
        if dropped
        else ""
    )
    return "<h2>Counts</h2>" + table(["", ""], rows) + drops


def _filter(node, stats: dict) -> str:
    from shipyard.data.configs import FilterConfig
    from shipyard.data.filters import rule_measure

    examples = stats.get("examples", [])
    cfg = FilterConfig.model_validate(
        node.config.get("filter", {k: v for k, v in node.config.items() if k != "read"})
    )
    found = _find(_input_paths(node), {e["id"] for e in examples})
    out = [f"<h2>Dropped documents ({len(examples)} shown: the first of each rule per batch)</h2>"]
    for e in examples:
        doc = found.get(e["id"])
        text = doc.text if doc is not None else e.get("start", "")
        m = rule_measure(e["rule"], text, cfg, doc.source if doc is not None else "")
        numbers = f"measured {m['value']:.4g}, {m['needs']} {m['limit']}" if m else "no measure"
        out.append(
            f"<h3><code>{esc(e['id'])}</code> dropped by <b class=rule>{esc(e['rule'])}</b>: {esc(numbers)}</h3>"
            + _text(text)
            + (
                ""
                if doc is not None
                else "<p>(the first 120 characters stats.json kept: the input was not found)</p>"
            )
        )
    return "".join(out)


def _dedup(node, stats: dict) -> str:
    examples = stats.get("removed_examples", [])
    ids = {e["removed"] for e in examples} | {e["kept"] for e in examples}
    found = _find(_input_paths(node), ids)
    out = [f"<h2>Duplicate clusters ({len(examples)} shown)</h2>"]
    for e in examples:
        a, b = found.get(e["kept"]), found.get(e["removed"])
        out.append(
            f"<div class=pair><h3>Jaccard estimate {esc(e.get('jaccard_estimate'))}</h3><div class=side>"
            f"<div><h4>kept <code>{esc(e['kept'])}</code></h4>{_text(a.text) if a else '<p>(not found)</p>'}</div>"
            f"<div><h4>removed <code>{esc(e['removed'])}</code></h4>{_text(b.text) if b else '<p>(not found)</p>'}</div>"
            "</div></div>"
        )
    return "".join(out)


def _decontaminate(node, stats: dict) -> str:
    examples = stats.get("examples", [])
    found = _find(_input_paths(node), {e["id"] for e in examples})
    out = [f"<h2>Contaminated documents ({len(examples)} shown)</h2>"]
    for e in examples:
        doc = found.get(e["id"])
        out.append(
            f"<h3><code>{esc(e['id'])}</code> shares with <b>{esc(e['eval_set'])}</b> the n-gram "
            f"<q>{esc(e['ngram'])}</q></h3>"
            + (_marked_words(doc.text, e["ngram"]) if doc else "<p>(not found)</p>")
        )
    return "".join(out)


def _marked_words(text: str, ngram: str) -> str:
    """The text with the n-gram's words highlighted where they occur in sequence (whitespace between
    them may differ from the single spaces the stage recorded)."""
    import re

    words = [re.escape(w) for w in ngram.split()]
    hit = re.search(r"\s+".join(words), text)
    if hit is None:
        return _text(text)
    start = max(0, hit.start() - CHARS // 2)
    window = text[start : hit.end() + CHARS // 2]
    a, b = hit.start() - start, hit.end() - start
    return f"<pre class=doc>{esc(window[:a])}<mark>{esc(window[a:b])}</mark>{esc(window[b:])}</pre>"


def _classify(node, stats: dict) -> str:
    hist = stats.get("histogram") or {}
    out = ["<h2>Scores</h2>"]
    edges, counts = hist.get("edges"), hist.get("counts")
    if edges and counts:
        pts = [(float(edges[i]), float(c)) for i, c in enumerate(counts)]
        out.append(chart("documents per score bin", {"documents": pts}))
        out.append(f"<p>cutoff: {esc(stats.get('cutoff'))}</p>")
    for e in stats.get("examples_by_score", []):
        out.append(
            f"<h3><code>{esc(e.get('id'))}</code> score {esc(round(e.get('score', 0), 4))}</h3>{_text(e.get('start', ''))}"
        )
    return "".join(out)


def _tokens(node) -> str:
    manifest_path = node.path / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    shards = manifest.get("shards", [])
    rows = [
        [
            esc(s.get("file", s.get("name", ""))),
            esc(s.get("tokens")),
            esc(s.get("documents")),
            f"<code>{esc(s.get('sha256', ''))}</code>",
        ]
        for s in shards
    ]
    head = {k: v for k, v in manifest.items() if k != "shards"}
    out = "<h2>Shards</h2>" + table(["file", "tokens", "documents", "sha256"], rows) + pre(head)
    sample = _first_document(node, manifest)
    if sample:
        out += "<h2>The first document, detokenized</h2>" + _text(sample)
    return out


def _first_document(node, manifest: dict) -> str | None:
    """The first document of the first shard, decoded with the step's tokenizer (its `tokenizer` input)."""
    try:
        import numpy as np

        from shipyard.data.shards import open_shards
        from shipyard.data.tokenizer import load_tokenizer

        tok_dir = _input_paths(node, "tokenizer")
        if not tok_dir:
            return None
        _, arrays = open_shards(node.path, verify=False)
        eos = manifest.get("eos_id")
        first = np.asarray(arrays[0][:20000])
        end = int(np.argmax(first == eos)) + 1 if eos is not None and (first == eos).any() else len(first)
        return load_tokenizer(Path(tok_dir[0])).decode(first[:end].tolist(), skip_special_tokens=False)
    except Exception:
        return None


def data_page(site, node) -> str:
    stats = _stats(node)
    parts = [f'<p><a href="../node/{esc(node.key)}.html">node</a></p>']
    if node.kind == "tokenize":
        parts.append(_tokens(node))
    else:
        parts.append(_counts(stats))
        special = {"filter": _filter, "dedup": _dedup, "decontaminate": _decontaminate, "classify": _classify}
        if node.kind in special:
            parts.append(special[node.kind](node, stats))
        parts.append(_sample(node))
    return page(
        f"data: {node.name} ({node.kind})", "".join(parts), "../", [(f"data/{node.key}.html", node.key)]
    )
