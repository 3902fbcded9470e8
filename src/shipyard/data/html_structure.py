"""Structural clean-up of an HTML page before resiliparse turns it into text (the `extract` stage).

resiliparse's main-content mode decides by heuristics: it drops blocks whose id or class looks like
boilerplate, every `<aside>` and lists with some links, and it writes every table cell as its own
paragraph.
On real pages (the Python documentation, measured in bench/real_html.py) that loses whole sections
whose heading-derived id contains a word such as "related" ("New Features Related to Type Hints")
and turns a three-column table into a column of one-word paragraphs. This module fixes the page
itself, in resiliparse's own DOM (no second parser), using what the markup declares:

- `drop_page_chrome`: elements the page marks as navigation, search, site footer or hidden, and
  permalink markers ("¶");
- `strip_anchor_ids`: ids that only name a section for in-page links (sectioning elements, headings,
  and blocks whose id is their heading's slug), so they cannot trigger the id heuristic;
- `keep_notes`: asides the page marks as notes or footnotes become ordinary blocks (resiliparse
  drops every `<aside>`);
- `keep_text_figures`: figures holding a code listing, table or quotation become ordinary blocks
  (without alt texts resiliparse skips every `<figure>`);
- `unwrap_list_links`: links in lists that are mostly prose become plain text (resiliparse drops a
  list with about a fifth of its text in links as a menu);
- `render_tables`: each data table becomes a `<pre>` block, one line per row, cells joined by a
  separator; layout tables (holding other tables) and link indexes are left as they are.
"""

from __future__ import annotations

import re

from resiliparse.extract.html2text import extract_plain_text
from resiliparse.parse.html import HTMLTree

# What the markup itself calls navigation, search, a menu or dialog, site footer or not shown to readers.
CHROME_SELECTOR = ", ".join(
    (
        "nav",
        '[role="navigation"]',
        '[role="search"]',
        '[role="contentinfo"]',
        '[role="menu"]',
        '[role="menubar"]',
        '[role="toolbar"]',
        '[role="dialog"]',
        '[role="alertdialog"]',
        "dialog:not([open])",
        '[aria-hidden="true"]',
        "[hidden]",
        "footer",
    )
)
# A <footer> inside one of these belongs to that content (an article's author line), not the site.
CONTENT_CONTAINERS = frozenset({"article", "section", "main", "aside", "blockquote"})
SECTIONING = frozenset({"section", "article", "h1", "h2", "h3", "h4", "h5", "h6"})
HEADINGS = frozenset({"h1", "h2", "h3", "h4", "h5", "h6"})
# A table whose text is mostly link text is an index (Sphinx's genindex, a site map): left to
# resiliparse, whose link-density rule drops it, instead of being kept as rows.
MAX_TABLE_LINK_FRACTION = 0.5
_SLUG_JUNK = re.compile(r"[^0-9a-z]+")
_SPACE = re.compile(r"\s+")
_TAG = re.compile(r"<[^>]*>")
_LINK = re.compile(r"<a\b[^>]*>(.*?)</a>", re.DOTALL | re.IGNORECASE)
# Every node list below is turned into a Python list with .values() first: resiliparse's NodeList
# finds item i by walking from the start, so iterating one directly is quadratic (a minute for the
# 17,000 links of the Python docs' genindex-all.html).


def _slug(text: str) -> str:
    return _SLUG_JUNK.sub("-", text.lower()).strip("-")


def _outermost(nodes: list) -> list:
    """The nodes not inside another one of them. `nodes` is in document order, so a node's
    descendants follow it directly; removing only these avoids touching freed descendants."""
    tops: list = []
    for node in nodes:
        if tops and tops[-1].contains(node):
            continue
        tops.append(node)
    return tops


def _inside_content(node) -> bool:
    parent = node.parent
    while parent is not None and parent.tag not in (None, "body", "html", "#document"):
        if parent.tag in CONTENT_CONTAINERS or parent.get_attribute("role") == "main":
            return True
        parent = parent.parent
    return False


def drop_page_chrome(tree: HTMLTree) -> int:
    """Remove navigation, search, hidden elements, site-level footers and permalink markers; returns how many."""
    if tree.body is None:
        return 0
    found = [
        n
        for n in tree.body.query_selector_all(CHROME_SELECTOR).values()
        if n.tag != "footer" or not _inside_content(n)
    ]
    tops = _outermost(found)
    for node in tops:
        node.decompose()
    # permalink markers: an in-page link whose whole text is one symbol (Sphinx's "¶", a "#");
    # queried after the removal above, so none of them is a freed node
    marks = [
        a
        for a in tree.body.query_selector_all('a[href^="#"]').values()
        if len(text := (a.text or "").strip()) == 1 and not text.isalnum()
    ]
    for a in marks:
        a.decompose()
    return len(tops) + len(marks)


def strip_anchor_ids(tree: HTMLTree) -> int:
    """Remove ids that name a section for links rather than say what a block is; returns how many.

    Documentation generators and Markdown renderers derive a section's id from its heading text,
    so a section titled "Import-related module attributes" gets an id that resiliparse's boilerplate
    rules read as a "related" box and drop, heading, text and code alike."""
    if tree.body is None:
        return 0
    stripped = 0
    for node in tree.body.query_selector_all("[id]").values():
        anchor = node.tag in SECTIONING
        if not anchor:
            first = node.first_element_child
            anchor = first is not None and first.tag in HEADINGS and _slug(first.text or "") == _slug(node.id)
        if anchor:
            node.remove_attribute("id")
            stripped += 1
    return stripped


def _link_fraction(node) -> float:
    """Share of the node's non-space text characters that are link text, read off its serialised
    HTML with two regular expressions: walking the links as DOM nodes costs a Python wrapper per
    node and per ancestor, ten times slower on the Python docs (entities count as their source
    text here, which is close enough for a threshold)."""
    html = node.html
    text = len(_SPACE.sub("", _TAG.sub("", html)))
    links = sum(len(_SPACE.sub("", _TAG.sub("", m))) for m in _LINK.findall(html))
    return links / text if text else 0.0


def _nearest_list(node):
    parent = node.parent
    while parent is not None and parent.tag not in ("ul", "ol", None):
        parent = parent.parent
    return parent


def unwrap_list_links(tree: HTMLTree, max_fraction: float, links: bool = False) -> int:
    """Turn the links of prose lists into plain text; returns how many lists.

    resiliparse drops a list once about a fifth of its text is link text, taking it for a menu;
    documentation lists cite API names as links ("call PyObject_GetBuffer() with the right
    parameters"). A list at most `max_fraction` link text is prose: its own links (not those of
    lists nested in it, judged alone) become their text, followed by " (target)" when `links` is on,
    as resiliparse would write them. Menus, nearly all link text, are left for resiliparse to drop."""
    if tree.body is None:
        return 0
    lists = tree.body.query_selector_all("ul, ol").values()
    # judge every list before changing any: unwrapping an inner list's links changes the outer's share
    prose = [
        lst for lst in lists if lst.query_selector("a") is not None and _link_fraction(lst) <= max_fraction
    ]
    for lst in prose:
        for a in lst.query_selector_all("a").values():
            if _nearest_list(a) != lst:
                continue
            href = a.get_attribute("href")
            for child in a.child_nodes.values():
                a.parent.insert_before(child, a)
            if links and href:
                a.parent.insert_before(tree.create_text_node(f" ({href})"), a)
            a.decompose()
    return len(prose)


# ARIA / DPUB-ARIA roles of an aside that is part of the text (a note, a footnote), not a sidebar.
NOTE_ROLES = frozenset(
    {"note", "doc-footnote", "doc-endnote", "doc-endnotes", "doc-example", "doc-tip", "doc-notice"}
)


def _is_note(aside) -> bool:
    if aside.get_attribute("role") in NOTE_ROLES:
        return True
    children = aside.children.values()
    # a footnote list: an aside holding only note asides (docutils' <aside class="footnote-list">)
    return bool(children) and all(
        c.tag == "aside" and c.get_attribute("role") in NOTE_ROLES for c in children
    )


def keep_notes(tree: HTMLTree) -> int:
    """Turn `<aside>` notes and footnotes into `<div>`s (same attributes and children); returns how many.

    resiliparse's main-content mode drops every `<aside>`: right for a site's sidebar, wrong for a
    footnote, which the markup marks with a note role."""
    if tree.body is None:
        return 0
    notes = [a for a in tree.body.query_selector_all("aside").values() if _is_note(a)]
    for aside in notes:
        _as_div(tree, aside)
    return len(notes)


def _as_div(tree: HTMLTree, node) -> None:
    """Replace `node` by a `<div>` with its attributes and children."""
    block = tree.create_element("div")
    for name in node.attrs:
        block.setattr(name, node[name])
    for child in node.child_nodes.values():
        block.append_child(child)
    node.parent.replace_child(block, node)
    node.decompose()


# What makes a <figure> text rather than an image: a code listing, a table, a quotation.
TEXT_FIGURE_SELECTOR = "pre, table, blockquote"


def keep_text_figures(tree: HTMLTree) -> int:
    """Turn `<figure>`s that hold a code listing, table or quotation, and their captions, into
    `<div>`s; returns how many figures.

    Without alt texts resiliparse skips every `<figure>` as an image, and with it whatever the figure
    holds: the Rust book (mdBook) wraps its numbered code listings in `<figure class="listing">`."""
    if tree.body is None:
        return 0
    figures = [
        f for f in tree.body.query_selector_all("figure").values() if f.query_selector(TEXT_FIGURE_SELECTOR)
    ]
    captions = [c for f in figures for c in f.query_selector_all("figcaption").values()]
    for node in figures + captions:  # a nested node is still itself after its parent's children move
        _as_div(tree, node)
    return len(figures)


def _cell_text(cell, alt_texts: bool, links: bool) -> str:
    text = extract_plain_text(
        cell.html, main_content=False, list_bullets=False, alt_texts=alt_texts, links=links
    )
    return _SPACE.sub(" ", text).strip()


def table_lines(table, separator: str, alt_texts: bool = False, links: bool = False) -> list[str]:
    """A table as text lines: its caption, then one line per row with the cells joined by
    `separator` (rows with no text are left out)."""
    lines = []
    caption = table.query_selector("caption")
    if caption is not None and (text := _cell_text(caption, alt_texts, links)):
        lines.append(text)
    for row in table.query_selector_all("tr").values():
        cells = [_cell_text(c, alt_texts, links) for c in row.children.values() if c.tag in ("td", "th")]
        if any(cells):
            lines.append(separator.join(cells))
    return lines


def is_data_table(table) -> bool:
    """Whether `render_tables` writes this table as rows: no table inside it, and text that is at most
    MAX_TABLE_LINK_FRACTION link text."""
    if table.query_selector("table") is not None:
        return False  # tables holding tables lay out a page; their inner tables are handled alone
    return bool(_SPACE.sub("", table.text or "")) and _link_fraction(table) <= MAX_TABLE_LINK_FRACTION


def render_tables(tree: HTMLTree, separator: str, alt_texts: bool = False, links: bool = False) -> int:
    """Replace each data table by a `<pre>` of `table_lines`; returns how many were replaced.

    A `<pre>` keeps its line breaks through resiliparse, so a row stays one line."""
    if tree.body is None:
        return 0
    done = 0
    for table in tree.body.query_selector_all("table").values():
        if not is_data_table(table):
            continue
        lines = table_lines(table, separator, alt_texts, links)
        block = tree.create_element("pre")
        block.append_child(tree.create_text_node("\n".join(lines)))
        table.parent.replace_child(block, table)
        done += 1
    return done
