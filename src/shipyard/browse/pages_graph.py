"""The index (the artifact graph) and each node's page: status, digests, config, provenance, files,
the command that reproduces it."""

from __future__ import annotations

import shlex
import time

from shipyard.browse import graph
from shipyard.browse.html import esc, graph_svg, page, pre, size, table

STATUS_CLASS = {
    "verified": "ok",
    "differs": "bad",
    "upstream": "bad",
    "incomplete": "unknown",
    "unverified": "unknown",
}


def index(site) -> str:
    nodes = site.nodes
    cols = graph.depths(nodes)
    labels = {n.key: (n.name, f"{n.kind} · {graph.STATUS[n.status]}", STATUS_CLASS[n.status]) for n in nodes}
    svg = graph_svg(
        cols, {n.key: n.parents for n in nodes}, labels, {n.key: f"node/{n.key}.html" for n in nodes}
    )
    rows = []
    for n in nodes:
        wall = n.provenance.get("wall_seconds")
        links = [f'<a href="node/{esc(n.key)}.html">{esc(n.key)}</a>']
        rows.append(
            [
                f'<span class="status {STATUS_CLASS[n.status]}">{esc(graph.STATUS[n.status])}</span>',
                esc(n.kind),
                *links,
                esc(f"{wall:.1f} s" if isinstance(wall, (int, float)) else "-"),
                _views(n, ""),
            ]
        )
    bad = [n for n in nodes if n.status in ("differs", "upstream")]
    summary = (
        f"<p class=summary>{len(nodes)} steps under <code>{esc(site.source or site.root)}</code>"
        + (f" (a local copy in <code>{esc(site.root)}</code>)" if site.source else "")
        + f"; artifacts re-hashed in {site.verify_seconds:.1f} s"
        + (
            f" at start-up, re-checked for this page in {site.recheck_seconds:.2f} s"
            if site.recheck_seconds is not None
            else ""
        )
        + f": {sum(n.status == 'verified' for n in nodes)} verified, "
        f"{len(bad)} differ.</p>"
    )
    runs = site.runs()
    compare = ""
    if len(runs) > 1:
        pairs = [
            f'<li><a href="compare/{esc(a.key)}__{esc(b.key)}.html">{esc(a.name)} vs {esc(b.name)}</a></li>'
            for i, a in enumerate(runs)
            for b in runs[i + 1 :]
        ]
        compare = "<h2>Compare runs</h2><ul>" + "".join(pairs) + "</ul>"
    tools = (
        '<p><a href="evals.html">evaluations</a> · <a href="model.html">model playground</a> · '
        '<a href="trace.html">trace text to training data</a></p>'
    )
    body = summary + svg + tools + table(["status", "kind", "step", "wall", "views"], rows, "nodes") + compare
    return page(str(site.source or site.root), body, "")


def _views(n, base: str) -> str:
    out = [f'<a href="{base}node/{esc(n.key)}.html">node</a>']
    if n.kind in graph.DATA_KINDS:
        out.append(f'<a href="{base}data/{esc(n.key)}.html">data</a>')
    if n.kind in graph.RUN_KINDS:
        out.append(f'<a href="{base}run/{esc(n.key)}.html">run</a>')
    return " · ".join(out)


def _files(path, limit: int = 40) -> tuple[list[list[str]], int, int]:
    files = sorted(p for p in path.rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in files)
    rows = [[esc(p.relative_to(path)), esc(size(p.stat().st_size))] for p in files[:limit]]
    return rows, total, len(files)


def node_page(site, n) -> str:
    by_key = site.by_key
    status = f'<p class="status {STATUS_CLASS[n.status]}">{esc(graph.STATUS[n.status])}'
    status += f" — {esc(n.why)}</p>" if n.why else "</p>"
    digests = [
        [
            esc(k),
            f"<code>{esc(n.recorded.get(k, '-'))}</code>",
            f"<code>{esc(n.recomputed.get(k, '-'))}</code>",
        ]
        for k in sorted(set(n.recorded) | set(n.recomputed))
    ]
    kids = graph.children(site.nodes).get(n.key, [])
    links = "<p>inputs: " + (
        ", ".join(f'<a href="{esc(p)}.html">{esc(by_key[p].name)}</a>' for p in n.parents if p in by_key)
        or "none"
    )
    links += " · read by: " + (
        ", ".join(f'<a href="{esc(k)}.html">{esc(by_key[k].name)}</a>' for k in kids) or "none"
    )
    links += " · " + _views(n, "../") + "</p>"
    prov = n.provenance
    facts = []
    for label, value in [
        ("step hash", prov.get("hash")),
        ("shipyard", prov.get("version")),
        ("git commit", prov.get("git_commit")),
        ("host", (prov.get("host") or {}).get("name")),
        ("platform", (prov.get("host") or {}).get("platform")),
        (
            "started",
            time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(prov["started"]))
            if "started" in prov
            else None,
        ),
        ("wall time", f"{prov['wall_seconds']:.1f} s" if "wall_seconds" in prov else None),
    ]:
        if value is not None:
            facts.append([esc(label), esc(value)])
    inputs = [
        [
            esc(role),
            esc(ref),
            esc(prov.get("inputs", {}).get(role, "")),
            f"<code>{esc(prov.get('input_hashes', {}).get(role, ''))}</code>",
        ]
        for role, ref in prov.get("step", {}).get("inputs", {}).items()
    ]
    rows, total, count = _files(n.path)
    body = (
        status
        + links
        + "<h2>Artifacts</h2>"
        + table(["artifact", "recorded", "now"], digests)
        + "<h2>Reproduce</h2>"
        + pre(_reproduce(site, n))
        + "<h2>Config</h2>"
        + pre(n.config)
        + "<h2>Inputs</h2>"
        + table(["role", "reference", "path", "hash"], inputs)
        + "<h2>Provenance</h2>"
        + table(["", ""], facts)
        + "<details><summary>packages</summary>"
        + pre(prov.get("packages", {}))
        + "</details>"
        + f"<h2>Files</h2><p>{count} files, {esc(size(total))}</p>"
        + table(["file", "size"], rows)
    )
    if "run" in prov:
        body += "<h2>Run provenance</h2>" + pre(prov["run"])
    return page(f"{n.name} ({n.kind})", body, "../", [(f"node/{n.key}.html", n.key)])


def _reproduce(site, n) -> str:
    if n.kind == "run":
        return f"shipyard train {shlex.quote(str(n.path / 'config.yaml'))}"
    where = f"{site.source}/{n.key}" if site.source else str(n.path)
    return f"shipyard reproduce {shlex.quote(where)} --root FRESH_ROOT"
