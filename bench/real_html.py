"""extract → filter → dedup on real HTML nobody here wrote: the Python documentation of Debian's python3-doc.

Runs the real CLI (`python -m shipyard.cli data extract|filter|dedup`) on every .html page, twice:
with resiliparse alone (every `html_structure` step switched off) and with the defaults (the filter
also once with max_duplicate_ngram_fraction 0.3), plus extract alone with `main_content` off (all
visible text), with and without the clean-up. Each run's stats.json gives pages
in/out, drops per reason and chars in/out. The extracted text is then checked against each page's
own markup, read with resiliparse's DOM: the page's main region (`<main>` or role=main, which Sphinx
puts around the body) against the rest (its chrome):

- headings: headings of the main region found in the text (a lost heading is a lost section);
- code blocks: `<pre>` blocks of the main region found verbatim (line ends stripped);
- table rows: rows of the main region's data tables (`html_structure.is_data_table`: not a layout
  table, not mostly links) found as one line, cells joined by " | ";
- footnotes: `aside[role=note]` paragraphs found;
- chrome lines: lines of the text that occur only outside the main region (navigation, sidebars,
  footer), not in it.

    .venv/bin/python bench/real_html.py [--html-dir DIR] [--cache DIR] [--workers 2] [--out bench/results/real_html.json]

Without --html-dir the pages come from `apt-get download python3-doc` (and the python3.X-doc
package it depends on), unpacked with dpkg-deb into --cache (default ~/.cache/shipyard/real_html).
Nothing of the Debian HTML is written into the repository except the short examples in the JSON.
Times are wall seconds of each stage on a shared 2-core machine: noisy.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zstandard
from resiliparse.extract.html2text import extract_plain_text
from resiliparse.parse.html import HTMLTree

from shipyard.data.html_structure import is_data_table

SPACE = re.compile(r"\s+")
OFF = [
    "drop_page_chrome=false",
    "strip_anchor_ids=false",
    "keep_notes=false",
    "keep_text_figures=false",
    "list_link_fraction=null",
    "table_rows=false",
]
# (name, page, text the window starts at ("" the page's start), characters, before, after):
# before/after snippets for docs/data.md; before and after name two of main()'s configurations
BASE, MAIN_OFF = ("resiliparse_only", "default"), ("main_content_off_resiliparse_only", "main_content_off")
EXAMPLES = [
    (
        "table",
        "library/stdtypes.html",
        "These are the Boolean operations, ordered by ascending priority:",
        330,
        *BASE,
    ),
    (
        "section_with_related_id",
        "whatsnew/3.11.html",
        "PEP 655: Marking individual TypedDict items",
        420,
        *BASE,
    ),
    ("code_block_in_that_section", "whatsnew/3.11.html", "class Movie(TypedDict):", 260, *BASE),
    (
        "prose_list_with_links",
        "c-api/buffer.html",
        "There are two ways for a consumer of the buffer interface",
        330,
        *BASE,
    ),
    ("footnote", "library/stdtypes.html", "Additional information on these special methods", 200, *BASE),
    ("page_start", "library/textwrap.html", "", 260, *BASE),
    ("page_start_all_text", "library/textwrap.html", "", 420, *MAIN_OFF),
]


def fetch_python_docs(cache: Path) -> Path:
    """The html directory of python3.X-doc, downloaded and unpacked into `cache` unless already there."""
    found = sorted(cache.glob("root/usr/share/doc/python3.*/html"))
    if found:
        return found[-1]
    cache.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(["apt-get", "download", "python3-doc"], cwd=cache, check=True, capture_output=True)
        meta = next(cache.glob("python3-doc_*.deb"))
        depends = subprocess.run(
            ["dpkg-deb", "-f", str(meta), "Depends"], check=True, capture_output=True, text=True
        )
        versioned = re.search(r"python3\.\d+-doc", depends.stdout)
        if versioned is None:
            raise SystemExit(f"python3-doc depends on no python3.X-doc package: {depends.stdout.strip()!r}")
        subprocess.run(
            ["apt-get", "download", versioned.group(0)], cwd=cache, check=True, capture_output=True
        )
        for deb in cache.glob("python3*-doc_*.deb"):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(cache / "root")], check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(
            f"could not fetch python3-doc with apt-get/dpkg-deb ({e}); pass --html-dir DIR instead"
        ) from e
    found = sorted(cache.glob("root/usr/share/doc/python3.*/html"))
    if not found:
        raise SystemExit(
            f"no usr/share/doc/python3.*/html under {cache / 'root'} after unpacking python3-doc"
        )
    return found[-1]


def shipyard(*args: str) -> float:
    """Run one `shipyard data ...` command; its wall seconds."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "shipyard.cli", "data", *args], check=True)
    return time.perf_counter() - t0


def read_texts(out: Path, root: Path) -> dict[str, str]:
    """page path relative to `root` -> extracted text, from a document stage's output."""
    texts = {}
    for part in sorted(out.glob("part-*.jsonl.zst")):
        with open(part, "rb") as f:
            data = zstandard.ZstdDecompressor().stream_reader(f).read().decode()
        for line in data.splitlines():
            rec = json.loads(line)
            texts[str(Path(rec["id"]).relative_to(root))] = rec["text"]
    return texts


def stage_summary(out: Path, seconds: float) -> dict:
    stats = json.loads((out / "stats.json").read_text())
    return {
        "documents_in": stats["documents_in"],
        "documents_out": stats["documents_out"],
        "dropped": stats["dropped"],
        "bytes_in": stats["bytes_in"],
        "bytes_out": stats["bytes_out"],
        "seconds": round(seconds, 1),
        "drop_examples": [
            {"page": Path(e["id"]).name, "rule": e.get("rule")} for e in stats.get("examples", [])
        ][:12],
    }


def run_chain(pages: list[str], work: Path, name: str, sets: list[str], workers: int, full: bool) -> dict:
    """extract (with `sets`) → filter → dedup under work/name; the stages' summaries."""
    flags = [x for s in sets for x in ("--set", s)]
    w = ["--workers", str(workers)]
    ext, fil, ded = work / f"{name}-extract", work / f"{name}-filter", work / f"{name}-dedup"
    result = {"extract": stage_summary(ext, shipyard("extract", *pages, "--out", str(ext), *flags, *w))}
    if full:
        result["filter"] = stage_summary(fil, shipyard("filter", str(ext), "--out", str(fil), *w))
        result["dedup"] = stage_summary(ded, shipyard("dedup", str(fil), "--out", str(ded), *w))
        loose = work / f"{name}-filter-loose"
        relaxed = shipyard(
            "filter", str(ext), "--out", str(loose), "--set", "max_duplicate_ngram_fraction=0.3", *w
        )
        result["filter_max_duplicate_ngram_fraction_0.3"] = stage_summary(loose, relaxed)
    return result


def _norm(text: str) -> str:
    return SPACE.sub(" ", text).strip()


def _line(line: str) -> str:
    """A text line without its indent, list bullet and permalink marks, to compare lines across renderings."""
    return line.replace("¶", "").strip().removeprefix("•").strip()


def _plain(node) -> str:
    return extract_plain_text(node.html, main_content=False, list_bullets=False) if node is not None else ""


def _row_line(row) -> str:
    return " | ".join(_norm(_plain(c)) for c in row.children.values() if c.tag in ("td", "th"))


def page_checks(html: str, text: str) -> dict[str, list[int]]:
    """[found, total] per check for one page (see the module docstring); {} without a main region."""
    tree = HTMLTree.parse(html)
    main = tree.body.query_selector('main, [role="main"]') if tree.body else None
    if main is None:
        return {}
    flat, lines = _norm(text), {_line(line) for line in text.splitlines()}
    heads = [
        _norm((h.text or "").replace("¶", ""))
        for h in main.query_selector_all("h1, h2, h3, h4, h5, h6").values()
    ]
    pres = [
        "\n".join(x.rstrip() for x in (p.text or "").strip("\n").splitlines())
        for p in main.query_selector_all("pre").values()
    ]
    pres = [p for p in pres if p.strip()]
    stripped_text = "\n".join(x.rstrip() for x in text.splitlines())
    tables = [t for t in main.query_selector_all("table").values() if is_data_table(t)]
    rows = [_line(_row_line(r)) for t in tables for r in t.query_selector_all("tr").values()]
    rows = [r for r in rows if r.strip(" |")]
    notes = [_norm(p.text or "") for p in main.query_selector_all('aside[role="note"] p').values()]
    notes = [n for n in notes if len(n) >= 20]
    main_lines = {_line(line) for line in _plain(main).splitlines()}
    main.decompose()
    chrome = {_line(line) for line in _plain(tree.body).splitlines()} - main_lines - {""}
    return {
        "headings": [sum(h in flat for h in heads if h), sum(1 for h in heads if h)],
        "code_blocks": [sum(p in stripped_text for p in pres), len(pres)],
        "table_rows": [sum(r in lines for r in rows), len(rows)],
        "footnotes": [sum(n[:80] in flat for n in notes), len(notes)],
        "chrome_lines": [sum(line in chrome for line in lines), len(chrome)],
    }


def content_checks(root: Path, texts: dict[str, str]) -> dict:
    """page_checks summed over all pages, with up to 5 pages that lost the most of each."""
    total: dict[str, list[int]] = {}
    worst: dict[str, list[tuple[int, str]]] = {}
    for page, text in sorted(texts.items()):
        for key, (found, n) in page_checks((root / page).read_text(errors="replace"), text).items():
            acc = total.setdefault(key, [0, 0])
            acc[0] += found
            acc[1] += n
            missing = found if key == "chrome_lines" else n - found
            if missing:
                worst.setdefault(key, []).append((missing, page))
    out = {}
    for key, (found, n) in total.items():
        label = "kept" if key == "chrome_lines" else "found"
        out[key] = {
            label: found,
            "of": n,
            "pages": [p for _, p in sorted(worst.get(key, []), reverse=True)[:5]],
        }
    return out


def snippet(text: str | None, start: str, n: int) -> str:
    if text is None:
        return "(page dropped)"
    i = text.find(start)
    return text[i : i + n] if i >= 0 else "(not in the text)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--html-dir", type=Path, help="a directory of .html pages (default: python3-doc via apt-get)"
    )
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "shipyard" / "real_html")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/results/real_html.json"))
    args = ap.parse_args()
    root = (args.html_dir or fetch_python_docs(args.cache)).resolve()
    pages = sorted(str(p) for p in root.rglob("*.html"))
    if not pages:
        raise SystemExit(f"no .html files under {root}")
    configs = {
        "resiliparse_only": (OFF, True),
        "default": ([], True),
        "main_content_off_resiliparse_only": (["main_content=false", *OFF], False),
        "main_content_off": (["main_content=false"], False),
    }
    results: dict = {
        "command": " ".join(["bench/real_html.py", *sys.argv[1:]]),
        "source": [p.name for p in sorted(args.cache.glob("python3*-doc_*.deb"))]
        if args.html_dir is None
        else None,
        "html_dir": str(root),
        "pages": len(pages),
        "html_bytes": sum(Path(p).stat().st_size for p in pages),
    }
    with tempfile.TemporaryDirectory() as tmp:
        work, texts = Path(tmp), {}
        for name, (sets, full) in configs.items():
            print(
                f"== {name}: extract{' → filter → dedup' if full else ''} on {len(pages)} pages", flush=True
            )
            results[name] = {"settings": sets, **run_chain(pages, work, name, sets, args.workers, full)}
            texts[name] = read_texts(work / f"{name}-extract", root)
            results[name]["extracted_chars"] = sum(len(t) for t in texts[name].values())
            results[name]["checks"] = content_checks(root, texts[name])
    results["examples"] = {
        name: {"page": page, **{cfg: snippet(texts[cfg].get(page), start, n) for cfg in (before, after)}}
        for name, page, start, n, before, after in EXAMPLES
        if page in texts["default"]
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    for name in configs:
        print(name, json.dumps(results[name]["checks"]))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
