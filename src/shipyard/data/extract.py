"""HTML → main-content text with resiliparse (the `extract` stage).

resiliparse's main-content mode drops navigation, headers, footers, script and
style, and keeps the article text with paragraph breaks. Before it runs,
`html_structure` removes what the page itself marks as navigation or hidden,
takes heading-derived ids out of the heuristic's sight, keeps footnotes, code
listings in figures and prose lists that cite names as links, and writes data
tables as one line per row (each step an `ExtractConfig` switch). Documents that are
not HTML (no tag at all) pass through unchanged, so a mixed input works.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from shipyard.data.configs import ExtractConfig, ReadConfig
from shipyard.data.documents import Document
from shipyard.data.stage import Workers, run_document_stage

# Set once per worker process by the pool initializer (a worker serves one stage).
_CFG: ExtractConfig | None = None


def _init(cfg: ExtractConfig) -> None:
    global _CFG
    _CFG = cfg


def html_to_text(html: str, cfg: ExtractConfig) -> str:
    """The page's text: structural clean-up (html_structure, per cfg), then resiliparse."""
    from resiliparse.extract.html2text import extract_plain_text
    from resiliparse.parse.html import HTMLTree

    from shipyard.data import html_structure

    tree = HTMLTree.parse(html)
    if cfg.drop_page_chrome:
        html_structure.drop_page_chrome(tree)
    if cfg.strip_anchor_ids:
        html_structure.strip_anchor_ids(tree)
    if cfg.keep_notes:
        html_structure.keep_notes(tree)
    if cfg.keep_text_figures:
        html_structure.keep_text_figures(tree)
    if cfg.list_link_fraction is not None:
        html_structure.unwrap_list_links(tree, cfg.list_link_fraction, cfg.links)
    if cfg.table_rows:
        html_structure.render_tables(tree, cfg.table_separator, cfg.alt_texts, cfg.links)
    return extract_plain_text(
        tree,
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
    inputs: list[str],
    out: Path,
    cfg: ExtractConfig,
    read: ReadConfig,
    workers: Workers,
    overwrite: bool = False,
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
