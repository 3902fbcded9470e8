"""HTML pieces of `shipyard browse`'s pages: the page frame, escaped text, tables, line charts and
the artifact graph as inline SVG.

Every text that comes from a file (documents, configs, metric names) goes through `esc`: a document
holding `<script>` is shown as those characters. Links are relative (`base` climbs from a page's
folder to the site's top), so the same pages work served over HTTP and opened from `file://`; the
one script and style sheet come from the package (browse/assets), never from a network.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Iterable, Sequence

ASSETS = ("browse.css", "browse.js")
"""The files under browse/assets every page links (copied into a static site's assets/)."""


def esc(value) -> str:
    """`value` as HTML text (quotes too: safe inside attributes)."""
    return html.escape(str(value), quote=True)


def page(title: str, body: str, base: str, crumbs: Sequence[tuple[str, str]] = ()) -> str:
    """A whole page: `title`, the navigation (`crumbs`: (href relative to the top, label)) and `body`
    (already HTML). `base` leads from the page's folder to the top ("" or "../" ...)."""
    nav = " / ".join(
        [f'<a href="{esc(base)}index.html">graph</a>']
        + [f'<a href="{esc(base + href)}">{esc(label)}</a>' for href, label in crumbs]
    )
    return (
        "<!doctype html>\n<html lang=en><head><meta charset=utf-8>"
        f"<title>{esc(title)} · shipyard browse</title>"
        f'<link rel=stylesheet href="{esc(base)}assets/browse.css">'
        f'<script defer src="{esc(base)}assets/browse.js"></script></head>\n'
        f"<body><nav>{nav}</nav><h1>{esc(title)}</h1>\n{body}\n</body></html>\n"
    )


def table(header: Sequence[str], rows: Iterable[Sequence[str]], cls: str = "") -> str:
    """A table; `rows` cells are HTML already (escape text with `esc` first)."""
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{esc(cls)}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def pre(value) -> str:
    """A JSON-able value as an indented block."""
    text = value if isinstance(value, str) else json.dumps(value, indent=2, sort_keys=True, default=str)
    return f"<pre>{esc(text)}</pre>"


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def chart(
    title: str, series: dict[str, list[tuple[float, float]]], width: int = 640, height: int = 220
) -> str:
    """A line chart of `series` (label -> (x, y) points) as SVG; browse.js shows each series' value
    at the pointer (the points ride in a data attribute)."""
    points = [p for s in series.values() for p in s if math.isfinite(p[1])]
    if not points:
        return f"<figure class=chart><figcaption>{esc(title)}: no values</figcaption></figure>"
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)
    pad = 40

    def sx(x):
        return pad + (x - x0) / (x1 - x0) * (width - 2 * pad)

    def sy(y):
        return height - pad + (y0 - y) / (y1 - y0) * (height - 2 * pad)

    lines = []
    for i, (label, pts) in enumerate(series.items()):
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts if math.isfinite(y))
        lines.append(f'<polyline class="s{i % 6}" points="{path}"><title>{esc(label)}</title></polyline>')
    axes = (
        f'<text x="{pad}" y="{height - 8}">{esc(_num(x0))}</text>'
        f'<text x="{width - pad}" y="{height - 8}" text-anchor=end>{esc(_num(x1))}</text>'
        f'<text x="4" y="{pad - 6}">{esc(_num(y1))}</text>'
        f'<text x="4" y="{height - pad}">{esc(_num(y0))}</text>'
    )
    data = json.dumps({"x": [x0, x1], "y": [y0, y1], "pad": pad, "series": series})
    legend = " ".join(f'<span class="key s{i % 6}">{esc(k)}</span>' for i, k in enumerate(series))
    return (
        f"<figure class=chart><figcaption>{esc(title)} {legend}</figcaption>"
        f'<svg viewBox="0 0 {width} {height}" width="{width}" height="{height}" data-chart="{esc(data)}">'
        f'<rect class=frame x="{pad}" y="{pad}" width="{width - 2 * pad}" height="{height - 2 * pad}"/>'
        f"{axes}{''.join(lines)}</svg><output class=readout></output></figure>"
    )


def _num(v: float) -> str:
    return f"{v:.4g}"


def graph_svg(columns: dict[str, int], parents: dict[str, Sequence[str]], labels: dict[str, tuple[str, str, str]],
              href: dict[str, str]) -> str:  # fmt: skip
    """The artifact graph: a box per node in its column (`columns`: key -> depth), an edge from each
    parent; `labels`: key -> (title, subtitle, status class); `href`: key -> its page."""
    w, h, gx, gy = 168, 54, 44, 20
    rows: dict[int, int] = {}
    at = {}
    for key, col in columns.items():
        at[key] = (col, rows.get(col, 0))
        rows[col] = rows.get(col, 0) + 1
    width = (max(columns.values(), default=0) + 1) * (w + gx) + gx
    height = max(rows.values(), default=1) * (h + gy) + gy

    def box(key):
        col, row = at[key]
        return gx / 2 + col * (w + gx), gy + row * (h + gy)

    edges = []
    for key, ps in parents.items():
        for p in ps:
            if p not in at or key not in at:
                continue
            (ax, ay), (bx, by) = box(p), box(key)
            x0, y0, x1, y1 = ax + w, ay + h / 2, bx, by + h / 2
            mid = (x0 + x1) / 2
            edges.append(
                f'<path class=edge d="M{x0:.0f},{y0:.0f} C{mid:.0f},{y0:.0f} {mid:.0f},{y1:.0f} {x1:.0f},{y1:.0f}"/>'
            )
    boxes = []
    for key in columns:
        x, y = box(key)
        title, sub, cls = labels[key]
        boxes.append(
            f'<a href="{esc(href[key])}" class="node {esc(cls)}" data-key="{esc(key)}">'
            f'<rect x="{x:.0f}" y="{y:.0f}" width="{w}" height="{h}" rx="6"/>'
            f'<text x="{x + 8:.0f}" y="{y + 21:.0f}" class=title>{esc(title)}</text>'
            f'<text x="{x + 8:.0f}" y="{y + 40:.0f}" class=sub>{esc(sub)}</text></a>'
        )
    return (
        f'<div class=graphbox><svg class=graph viewBox="0 0 {width:.0f} {height:.0f}" width="{width:.0f}" '
        f'height="{height:.0f}">{"".join(edges)}{"".join(boxes)}</svg></div>'
    )
