"""HTML → main-content text with resiliparse (the `extract` stage).

resiliparse's main-content mode drops navigation, headers, footers, script and
style, and keeps the article text with paragraph breaks. Documents that are
not HTML (no tag at all) pass through unchanged, so a mixed input works.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from shipyard.data.configs import ExtractConfig, ReadConfig
from shipyard.data.documents import Document
from shipyard.data.stage import run_document_stage

# Set once per worker process by the pool initializer (a worker serves one stage).
_CFG: ExtractConfig | None = None


def _init(cfg: ExtractConfig) -> None:
    global _CFG
    _CFG = cfg


def html_to_text(html: str, cfg: ExtractConfig) -> str:
    from resiliparse.extract.html2text import extract_plain_text

    return extract_plain_text(
        html,
        main_content=cfg.main_content,
        alt_texts=cfg.alt_texts,
        links=cfg.links,
        list_bullets=cfg.list_bullets,
    ).strip()


def looks_like_html(text: str) -> bool:
    head = text[:2048].lstrip().lower()
    return head.startswith(("<!doctype html", "<html", "<?xml")) or (
        "<body" in head or "<div" in head or "<p>" in head
    )


def extract_batch(docs: list[Document]) -> tuple[list[Document], Counter, list[dict]]:
    cfg = _CFG
    kept, drops = [], Counter()
    for doc in docs:
        text = html_to_text(doc.text, cfg) if looks_like_html(doc.text) else doc.text
        if len(text) < cfg.min_chars:
            drops["empty_after_extraction"] += 1
            continue
        kept.append(Document(doc.id, text, doc.source))
    return kept, drops, []


def run_extract(
    inputs: list[str], out: Path, cfg: ExtractConfig, read: ReadConfig, workers: int, overwrite: bool = False
) -> dict:
    return run_document_stage(
        "extract",
        inputs,
        out,
        cfg,
        read,
        extract_batch,
        workers=workers,
        overwrite=overwrite,
        initializer=_init,
        initargs=(cfg,),
    )
