"""The pages of `shipyard browse`, by path: the one place both the local server and the static site
get them from, so the two cannot differ.

A `Site` is built once per root: the nodes scanned and their artifacts re-hashed (browse/graph.py);
a live one (the server's) re-checks them before each page (`Site.reverify`: a stat per file, a file
re-hashed only when its stat changed, a step digested again only when one of its files did).
Page paths are relative to the site's top (index.html, evals.html, node/<key>.html, data/<key>.html,
run/<key>.html, batch/<key>/<step>.html, compare/<a>__<b>.html, model.html, trace.html);
`Site.render` returns a page's HTML (or None), `static_paths()` lists what a static site holds (the
batch pages of a few steps per run: a server renders any step on request).
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from shipyard.browse import graph
from shipyard.browse.graph import DATA_KINDS, RUN_KINDS, Node

_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass
class Site:
    """A root's pages (see the module doc); `live` when a server answers the model and trace boxes."""

    root: Path
    nodes: list[Node]
    verify_seconds: float = 0.0
    live: bool = False
    source: str | None = None
    """The bucket URL `root` is a local copy of (None: `root` is the root itself)."""
    loaded: dict = field(default_factory=dict)
    """What the pages loaded once and reuse (a run's data loader and tokenizer)."""
    recheck: bool = False
    """Whether `reverify` re-checks the nodes (a live site whose nodes were verified with their files
    tracked)."""
    recheck_seconds: float | None = None
    """How long the last `reverify` took (None before the first)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def reverify(self) -> None:
        """The nodes verified again against their files as they are now (graph.verify with the files
        tracked: only what changed since the last check is read), when `recheck`; the server calls
        this before each page, so a byte changed under a running server shows on the next page."""
        if not self.recheck:
            return
        with self._lock:  # (pages are rendered on a thread pool)
            t0 = time.perf_counter()
            self.nodes = graph.verify(self.nodes, track=True)
            self.recheck_seconds = time.perf_counter() - t0

    @property
    def by_key(self) -> dict[str, Node]:
        return {n.key: n for n in self.nodes}

    def runs(self) -> list[Node]:
        return [n for n in self.nodes if n.kind in RUN_KINDS]

    def render(self, path: str) -> str | None:
        """The page at `path` (relative to the top), or None when there is none."""
        from shipyard.browse import pages_data, pages_graph, pages_model, pages_runs

        parts = path.strip("/").split("/") if path.strip("/") else ["index.html"]
        if any(not _SAFE.match(p) for p in parts):
            return None
        name = parts[-1].removesuffix(".html")
        if parts == ["index.html"]:
            return pages_graph.index(self)
        if parts == ["model.html"]:
            return pages_model.model(self)
        if parts == ["trace.html"]:
            return pages_model.trace(self)
        if parts == ["evals.html"]:
            return pages_runs.evals_page(self)
        if len(parts) == 2 and parts[1].endswith(".html"):
            node = self.by_key.get(name)
            if parts[0] == "node" and node is not None:
                return pages_graph.node_page(self, node)
            if parts[0] == "data" and node is not None and node.kind in DATA_KINDS:
                return pages_data.data_page(self, node)
            if parts[0] == "run" and node is not None and node.kind in RUN_KINDS:
                return pages_runs.run_page(self, node)
            if parts[0] == "compare" and "__" in name:
                a, _, b = name.partition("__")
                runs = {n.key: n for n in self.runs()}
                if a in runs and b in runs and a != b:
                    return pages_runs.compare_page(self, runs[a], runs[b])
        if len(parts) == 3 and parts[0] == "batch" and name.isdigit():
            node = self.by_key.get(parts[1])
            if node is not None and node.kind in RUN_KINDS and not pages_runs.is_rl(node):
                return pages_runs.batch_page(self, node, int(name))
        return None

    def static_paths(self) -> list[str]:
        """Every page of the static site."""
        from shipyard.browse import pages_runs

        out = ["index.html", "model.html", "trace.html", "evals.html"]
        for n in self.nodes:
            out.append(f"node/{n.key}.html")
            if n.kind in DATA_KINDS:
                out.append(f"data/{n.key}.html")
            if n.kind in RUN_KINDS:
                out.append(f"run/{n.key}.html")
                out += [f"batch/{n.key}/{s}.html" for s in pages_runs.shown_steps(n)]
        runs = self.runs()
        for i, a in enumerate(runs):
            for b in runs[i + 1 :]:
                out.append(f"compare/{a.key}__{b.key}.html")
        return out


def open_site(root: str | Path, verify: bool = True, live: bool = False, say=print) -> Site:
    """The site of `root` (a directory, or a bucket URL: browsed from a local copy, browse/mirror.py):
    its nodes scanned and (with `verify`) re-hashed; `live` and `verify`: with their files' hashes
    kept, so that `Site.reverify` re-checks them cheaply (a bucket root's local copy is what it
    re-checks: the bucket is fetched again at the next start)."""
    from shipyard import storage

    source = None
    if storage.is_url(str(root)):
        from shipyard.browse.mirror import mirror

        source, root = str(root).rstrip("/"), mirror(str(root), say)
    nodes = graph.scan(Path(root))
    t0 = time.perf_counter()
    if verify:
        nodes = graph.verify(nodes, track=live)
    return Site(Path(root), nodes, time.perf_counter() - t0, live, source=source, recheck=live and verify)
