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


# ------------------------------------------------------------------ real-world page structure
# Modelled on the Sphinx pages of the Python documentation (Debian python3-doc), cut down: the
# mobile menu and the related / sidebar bars, a section whose heading-derived id reads like
# boilerplate, a highlighted code block, a docutils table, a prose list citing API names as links,
# a footnote and the page footer. bench/real_html.py runs the same chain on the real pages.
SPHINX_PAGE = """<!DOCTYPE html><html lang="en"><head><title>What's New</title>
<script src="../_static/doctools.js"></script></head><body>
<div class="mobile-nav"><nav class="nav-content" role="navigation">
<form role="search" class="search" action="../search.html"><input type="text" name="q" aria-label="Quick search"/></form></nav>
<div class="menu-wrapper"><nav class="menu" role="navigation" aria-label="main navigation">
<div><h3><a href="../contents.html">Table of Contents</a></h3><ul><li><a href="#">ZZTOC entry</a></li></ul></div>
<div role="note" aria-label="source link"><h3>This Page</h3><ul class="this-page-menu">
<li><a href="../bugs.html">Report a Bug</a></li><li><a href="https://example.org/x.rst">Show Source</a></li></ul></div>
</nav></div></div>
<div class="related" role="navigation" aria-label="related navigation"><h3>Navigation</h3><ul>
<li class="right"><a href="../genindex.html">index</a></li><li class="right"><a href="../py-modindex.html">modules</a> |</li>
<li class="right"><a href="next.html">next</a> |</li><li class="right"><a href="prev.html">previous</a> |</li></ul></div>
<div class="document"><div class="documentwrapper"><div class="bodywrapper"><div class="body" role="main">
<section id="what-s-new"><h1>What's New In Widgets<a class="headerlink" href="#what-s-new" title="Permalink">¶</a></h1>
<p>This article explains the new features in widgets 3.11, compared to 3.10, for people who build
widgets every day and want to know what changed in the release and why it changed.</p>
<section id="new-features-related-to-type-hints"><h2>New Features Related to Type Hints<a class="headerlink" href="#new-features-related-to-type-hints">¶</a></h2>
<p>This section covers major changes affecting type hints and the typing module, which now lets a
class describe its own fields with a TypedDict and mark some of them as not required.</p>
<div class="highlight-python3 notranslate"><div class="highlight"><pre><span></span><span class="k">class</span> <span class="nc">Movie</span><span class="p">(</span><span class="n">TypedDict</span><span class="p">):</span>
   <span class="n">title</span><span class="p">:</span> <span class="nb">str</span>
   <span class="k">if</span> <span class="n">year</span><span class="p">:</span>
       <span class="k">return</span> <span class="kc">None</span>
</pre></div></div>
</section>
<section id="boolean-operations"><h2>Boolean Operations</h2>
<p>These are the Boolean operations, ordered by ascending priority, as every reader of this page knows:</p>
<table class="docutils align-default"><thead><tr class="row-odd"><th class="head"><p>Operation</p></th>
<th class="head"><p>Result</p></th><th class="head"><p>Notes</p></th></tr></thead><tbody>
<tr class="row-even"><td><p><code class="docutils literal notranslate"><span class="pre">x</span> <span class="pre">or</span> <span class="pre">y</span></code></p></td>
<td><p>if <em>x</em> is false, then <em>y</em>, else
<em>x</em></p></td><td><p>(1)</p></td></tr>
<tr class="row-odd"><td><p><code class="docutils literal notranslate"><span class="pre">not</span> <span class="pre">x</span></code></p></td>
<td><p>if <em>x</em> is false, then <code class="docutils literal notranslate"><span class="pre">True</span></code></p></td><td><p>(2)</p></td></tr>
</tbody></table>
<p>There are two ways for a consumer of the buffer interface to acquire a buffer over a target object:</p>
<ul class="simple">
<li><p>call <a class="reference internal" href="#c.PyObject_GetBuffer"><code class="xref c c-func docutils literal notranslate"><span class="pre">PyObject_GetBuffer()</span></code></a> with the right parameters;</p></li>
<li><p>call <a class="reference internal" href="#c.PyArg_ParseTuple"><code class="xref c c-func docutils literal notranslate"><span class="pre">PyArg_ParseTuple()</span></code></a> (or one of its siblings) with one of the formats.</p></li>
</ul>
<p>The operators compare their operands by identity when nothing else is defined.<a class="footnote-reference brackets" href="#f1" id="r1">1</a></p>
<aside class="footnote-list brackets"><aside class="footnote brackets" id="f1" role="note">
<span class="label"><a role="doc-backlink" href="#r1">1</a></span><p>ZZFOOTNOTE: identity is the address of the object in memory.</p></aside></aside>
</section></section>
</div></div></div>
<div class="sphinxsidebar" role="navigation" aria-label="main navigation"><div class="sphinxsidebarwrapper">
<h4>Previous topic</h4><p class="topless"><a href="prev.html">ZZPREVIOUS topic</a></p>
<div role="search"><h3>Quick search</h3><form class="search" action="../search.html"><input type="text" name="q"/></form></div>
</div></div></div>
<div class="footer">&copy; <a href="../copyright.html">Copyright</a> 2001-2026, Widget Foundation.<br/>
Last updated on October 07, 2026. <a href="/bugs.html">Found a bug</a>?</div>
</body></html>"""

CODE_BLOCK = "class Movie(TypedDict):\n   title: str\n   if year:\n       return None"
NAVIGATION = (
    "Navigation",
    "ZZTOC",
    "Table of Contents",
    "This Page",
    "Show Source",
    "Quick search",
    "ZZPREVIOUS",
    "previous",
    "modules",
)


def _text(html: str, **settings) -> str:
    from shipyard.data.extract import html_to_text

    return html_to_text(html, ExtractConfig(**settings))


def test_sphinx_page_keeps_content_and_drops_navigation_and_footer():
    text = _text(SPHINX_PAGE)
    assert text.startswith("What's New In Widgets\n\nThis article explains"), text[:200]
    for chrome in (*NAVIGATION, "¶", "Copyright", "Last updated", "Found a bug"):
        assert chrome not in text, chrome


def test_navigation_the_page_declares_is_dropped_without_main_content_too():
    # main_content off keeps every visible text; the navigation the markup declares still goes
    text = _text(SPHINX_PAGE, main_content=False)
    assert "This article explains" in text and "Copyright" in text  # div.footer has no footer markup
    for chrome in (*NAVIGATION, "¶"):
        assert chrome not in text, chrome


def test_section_whose_id_reads_like_boilerplate_is_kept_with_its_code_block():
    text = _text(SPHINX_PAGE)
    assert "New Features Related to Type Hints\n\nThis section covers major changes" in text
    # the <pre> keeps its line breaks and indentation exactly
    assert CODE_BLOCK in text


def test_table_is_one_line_per_row_with_separated_cells():
    text = _text(SPHINX_PAGE)
    rows = "Operation | Result | Notes\nx or y | if x is false, then y, else x | (1)\nnot x | if x is false, then True | (2)"
    assert rows in text, text
    assert "Operation\tResult\tNotes" in _text(SPHINX_PAGE, table_separator="\t")


def test_prose_list_citing_names_as_links_is_kept_with_inline_code():
    text = _text(SPHINX_PAGE)
    assert "  • call PyObject_GetBuffer() with the right parameters;" in text, text
    assert "PyArg_ParseTuple() (or one of its siblings)" in text
    # with links on, the targets of the unwrapped links are still written, as resiliparse writes them
    assert "PyObject_GetBuffer() (#c.PyObject_GetBuffer) with" in _text(SPHINX_PAGE, links=True)


def test_footnote_aside_is_kept():
    text = _text(SPHINX_PAGE)
    assert "ZZFOOTNOTE: identity is the address" in text


def test_menus_link_indexes_and_layout_tables_are_left_to_resiliparse():
    filler = "<p>" + "A long paragraph of ordinary prose about the subject of this page. " * 4 + "</p>"
    menu = '<ul><li><a href="/a">Home page</a></li><li><a href="/b">About us</a></li><li><a href="/c">Shop</a></li></ul>'
    index = '<table class="indextable"><tr><td><ul><li><a href="x.html">abs() (built-in function)</a></li></ul></td><td><ul><li><a href="y.html">ZZINDEX</a></li></ul></td></tr></table>'
    layout = "<table><tr><td><table><tr><td>Name</td><td>Value</td></tr></table></td><td>ZZLAYOUT side cell</td></tr></table>"
    # a prose list holding a menu: the prose list's own links are unwrapped, not the menu's
    nested = (
        "<ul><li>Call the function with the right parameters and then check the result carefully, as"
        " the section above explains in some detail"
        '<ul><li><a href="/x">ZZNESTED one</a></li><li><a href="/y">ZZNESTED two</a></li></ul></li></ul>'
    )
    page = f"<html><body><div><div><div><div>{filler}{menu}{index}{nested}{filler}{layout}</div></div></div></div></body></html>"
    text = _text(page)
    assert "About us" not in text  # a menu: resiliparse drops it
    assert "ZZINDEX" not in text and "abs() (built-in" not in text  # a link index: not turned into rows
    # the inner data table is rows; the outer layout table is not flattened into one row with it
    assert "Name | Value" in text
    assert "| ZZLAYOUT" not in text
    assert "Call the function with the right parameters" in text
    assert "ZZNESTED" not in text


def test_footer_of_an_article_is_kept_and_hidden_elements_dropped():
    page = (
        "<html><body><article><p>Body of the article, long enough to be the main content here.</p>"
        "<footer>ZZBYLINE written by Ada</footer></article><div hidden>ZZHIDDEN</div>"
        '<span aria-hidden="true">ZZARIA</span><div role="dialog"><p>ZZDIALOG</p></div>'
        "<dialog><p>ZZCLOSEDDIALOG</p></dialog><dialog open><p>ZZOPENDIALOG</p></dialog>"
        "<footer>ZZSITEFOOTER</footer></body></html>"
    )
    text = _text(page, main_content=False)
    assert "ZZBYLINE" in text and "ZZOPENDIALOG" in text
    for gone in ("ZZHIDDEN", "ZZARIA", "ZZDIALOG", "ZZCLOSEDDIALOG", "ZZSITEFOOTER"):
        assert gone not in text, gone


def test_code_listing_in_a_figure_is_kept_without_alt_texts():
    # the Rust book (mdBook): numbered listings are <figure class="listing">, which resiliparse
    # skips as an image when alt texts are off (shipyard's default); an image figure still goes
    page = (
        "<html><body><main><p>Listing 19-11 shows a match expression on an Option value.</p>"
        '<figure class="listing" id="listing-19-11"><span class="file-name">Filename: src/main.rs</span>'
        '<pre class="playground"><code class="language-rust"><span class="boring">fn main() {\n</span>'
        '    let x = Some(5);\n    match x {\n        Some(50) =&gt; println!("Got 50"),\n    }\n'
        '<span class="boring">}</span></code></pre><figcaption>Listing 19-11: a match</figcaption></figure>'
        '<figure><img src="a.png" alt="ZZALT"><figcaption>ZZIMAGECAPTION</figcaption></figure></main></body></html>'
    )
    text = _text(page)
    assert (
        'fn main() {\n    let x = Some(5);\n    match x {\n        Some(50) => println!("Got 50"),\n    }\n}'
        in text
    ), text
    assert "Listing 19-11: a match" in text
    assert "ZZALT" not in text and "ZZIMAGECAPTION" not in text
