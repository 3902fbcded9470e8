from shipyard.data.configs import ExtractConfig, ReadConfig
from shipyard.data.documents import ReadStats, read_documents
from shipyard.data.extract import run_extract

PAGE = """<!DOCTYPE html><html><head><title>Page</title>
<style>.menu {{ color: red; }}</style><script>var tracking = "ZZSCRIPT";</script></head>
<body><nav><a href="/">Home</a> | <a href="/about">About us</a> | <a href="/shop">Shop</a></nav>
<header><div class="banner">Sign up for our newsletter</div></header>
<main><article><h1>{title}</h1>
<p>{body} The committee met on Tuesday to discuss the new bridge, and several members raised
questions about its cost, its design and the time it would take to build.</p>
<p>After a long debate they agreed to commission a second study before any decision is made.</p>
</article></main>
<footer>Copyright 2026 Example Corp. All rights reserved. <a href="/privacy">Privacy</a></footer>
</body></html>"""


def test_html_boilerplate_is_removed_and_article_kept(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "a.html").write_text(PAGE.format(title="Bridge plans delayed", body="First report."))
    (site / "b.html").write_text(PAGE.format(title="Second article", body="Another report."))
    (tmp_path / "plain.txt").write_text("Not HTML at all, passes through unchanged.")
    stats = run_extract(
        [str(site), str(tmp_path / "plain.txt")], tmp_path / "out", ExtractConfig(), ReadConfig(), 1
    )
    docs = {d.id.rsplit("/", 1)[-1]: d.text for d in read_documents([tmp_path / "out"], ReadStats())}
    a = docs["a.html"]
    assert "Bridge plans delayed" in a and "commission a second study" in a and "First report." in a
    for boilerplate in ("ZZSCRIPT", "color: red", "About us", "Copyright 2026", "Privacy"):
        assert boilerplate not in a, boilerplate
    assert docs["plain.txt"] == "Not HTML at all, passes through unchanged."
    assert stats["documents_out"] == 3


def test_empty_extraction_is_dropped_and_counted(tmp_path):
    (tmp_path / "empty.html").write_text(
        "<html><head><script>x()</script></head><body><nav>Home</nav></body></html>"
    )
    stats = run_extract(
        [str(tmp_path / "empty.html")], tmp_path / "out", ExtractConfig(min_chars=20), ReadConfig(), 1
    )
    assert stats["documents_out"] == 0 and stats["dropped"] == {"empty_after_extraction": 1}
