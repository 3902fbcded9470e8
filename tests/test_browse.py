"""`shipyard browse` in a real Chromium: every link resolves, every hash shown is the file's, a flipped
byte in a token shard marks its node and every descendant, the batch at a step is the loader's token
for token, the static site works from file:// with the network off, document text is escaped,
nothing outside ROOT is served, the model playground answers through the engine.

Screenshots of each page go to $SHIPYARD_BROWSE_SCREENSHOTS when set (`make browse-screenshots`
writes docs/browse/*.png that way), else to the test's temporary directory."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from importlib import resources
from pathlib import Path
from urllib.parse import urldefrag, urlparse

import httpx
import numpy as np
import pytest
from browse_fixtures import INSTALL, browse_server, browser_paths, chromium, need_browser

from shipyard.cli.main import main
from shipyard.experiment.executor import run_pipeline

# Heavy compiles and end-to-end runs: the `make test-slow` tier (docs/testing.md: tiers).
pytestmark = pytest.mark.slow

if (
    browser_paths() is None and os.environ.get("SHIPYARD_REQUIRE_BROWSER") != "1"
):  # one line, not one per test
    pytest.skip(
        f"browser tests: no chromium / chromedriver here (install: {INSTALL})", allow_module_level=True
    )

VOLATILE = {"provenance.json", "_SUCCESS", "stats.json", "report.md", "prepare.json"}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The packaged quickstart with 30 train steps (what `make quickstart` runs, shorter: ~20 s)."""
    need_browser()
    d = tmp_path_factory.mktemp("browse")
    text = resources.files("shipyard").joinpath("pipelines", "quickstart.yaml").read_text()
    for old, new in [
        ("train.steps=600", "train.steps=30"),
        ("train.eval_every=100", "train.eval_every=null"),
        ("max_sequences: 256", "max_sequences: 16"),
    ]:
        text = text.replace(old, new)
    (d / "quickstart.yaml").write_text(text)
    run_pipeline(str(d / "quickstart.yaml"), root=d / "root", log=lambda m: None)
    return d / "root"


@pytest.fixture(scope="module")
def server(root):
    with browse_server(root) as base:
        yield base


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b


def _shots() -> Path | None:
    where = os.environ.get("SHIPYARD_BROWSE_SCREENSHOTS")
    return Path(where) if where else None


def _shot(browser, name: str, tmp: Path) -> None:
    folder = _shots() or tmp
    folder.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(folder / f"{name}.png"))


def _links(browser) -> list[str]:
    from selenium.webdriver.common.by import By

    return [
        a.get_attribute("href") for a in browser.find_elements(By.TAG_NAME, "a") if a.get_attribute("href")
    ]


def _crawl(browser, start: str, inside: str) -> dict[str, int]:
    """Every page reachable from `start` by links under `inside`: url -> clicks from start. Each page
    must load (a title, no error page)."""
    depth, queue = {start: 0}, [start]
    while queue:
        url = queue.pop(0)
        browser.get(url)
        assert "shipyard browse" in browser.title, (url, browser.title)
        for href in _links(browser):
            href = urldefrag(href)[0]
            if href.startswith(inside) and href not in depth:
                depth[href] = depth[url] + 1
                queue.append(href)
    return depth


def _sha(data) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def _digests_shown(browser, url: str) -> dict[str, str]:
    """A step page's artifact table: name -> the digest it shows as computed now (the table also
    shows the recorded one, which must be the same)."""
    from selenium.webdriver.common.by import By

    browser.get(url)
    out = {}
    for row in browser.find_elements(By.CSS_SELECTOR, "table tr")[1:]:
        cells = row.find_elements(By.TAG_NAME, "td")
        if len(cells) == 3 and cells[1].find_elements(By.TAG_NAME, "code"):
            assert cells[1].text == cells[2].text, row.text
            out[cells[0].text] = cells[2].text
    return out


def _restored_params(run: Path) -> tuple[int, list]:
    """The newest checkpoint's params read with Orbax directly, leaves in the model's order."""
    import jax
    import orbax.checkpoint as ocp

    from shipyard.config import load_config
    from shipyard.model.params import abstract_params
    from shipyard.model.transformer import param_specs

    step = max(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    cfg = load_config(str(run / "config.yaml"))
    with ocp.StandardCheckpointer() as ckpt:
        params = ckpt.restore((run / "checkpoints" / str(step) / "default").absolute())["params"]
    leaves = []  # by name, in the model's field order (what the digest hashes in)
    for path, _ in jax.tree_util.tree_flatten_with_path(abstract_params(param_specs(cfg.model)))[0]:
        node = params
        for key in path:
            node = node[key.name]
        leaves.append(node)
    return step, leaves


def _files_digest(path: Path, skip: set[str] = frozenset()) -> str:
    """experiment/steps.py's "files" digest, written out again: sha256 over each file's relative path
    and bytes, sorted, the records of time and place (and `skip`) left out."""
    h = hashlib.sha256()
    for p in sorted(p for p in path.rglob("*") if p.is_file() and p.name not in VOLATILE | skip):
        h.update(str(p.relative_to(path)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def test_every_link_resolves_and_every_hash_shown_is_the_file_s(root, server, browser, tmp_path):
    from selenium.webdriver.common.by import By

    depth = _crawl(browser, server, server)
    pages = {urlparse(u).path for u in depth}
    steps = sorted(p.name for p in root.iterdir() if p.is_dir())
    for key in steps:  # every artifact within 3 clicks of the index
        assert f"/node/{key}.html" in pages and depth[server + f"node/{key}.html"] <= 3
    assert any(p.startswith("/batch/") for p in pages) and any(p.startswith("/data/") for p in pages)
    data_steps = [
        k for k in steps if k.split("-")[0] in ("documents", "filter", "dedup", "tokenizer", "export")
    ]
    for key in data_steps:
        browser.get(server + f"node/{key}.html")
        row = [r for r in browser.find_elements(By.CSS_SELECTOR, "table tr") if r.text.startswith("files ")]
        shown = row[0].find_elements(By.TAG_NAME, "code")
        assert shown[0].text == shown[1].text == _files_digest(root / key), key
    for key in [k for k in steps if k.startswith("tokens-")]:  # the shard table and the shards' bytes
        shown = _digests_shown(browser, server + f"node/{key}.html")
        table = json.loads((root / key / "manifest.json").read_text())["shards"]
        assert shown["shards"] == _sha(json.dumps(table, sort_keys=True))
        assert shown["files"] == _files_digest(root / key, skip={"manifest.json"})
    train = root / _key(root, "train")  # the trained params' bytes and the loss curve
    shown = _digests_shown(browser, server + f"node/{train.name}.html")
    losses = [json.loads(line)["loss"] for line in (train / "metrics.jsonl").read_text().splitlines()]
    assert shown["loss_curve"] == _sha(json.dumps(losses))
    step, params = _restored_params(train)
    assert shown[f"params@{step}"] == _sha(b"".join(np.ascontiguousarray(p).tobytes() for p in params))
    report = json.loads((root / _key(root, "eval") / "eval.json").read_text())  # the eval's numbers
    report.pop("run")
    assert _digests_shown(browser, server + f"node/{_key(root, 'eval')}.html")["eval.json"] == _sha(
        json.dumps(report, sort_keys=True)
    )
    browser.get(server + "evals.html")  # the root's evaluations on one page
    cells = [c.text for c in browser.find_elements(By.CSS_SELECTOR, "td")]
    bpb = report["domains"]["heldout"]["bits_per_byte"]
    assert f"{bpb:.4g}" in cells and f"{report['unigram_baseline']['bits_per_byte']:.4g}" in cells
    browser.get(server)
    assert browser.find_element(By.CSS_SELECTOR, "p.summary").text.endswith("0 differ.")
    _shot(browser, "index", tmp_path)
    for name, path in [("node", f"node/{steps[0]}.html"), ("filter", f"data/{_key(root, 'filter')}.html"),
                       ("dedup", f"data/{_key(root, 'dedup')}.html"), ("run", f"run/{_key(root, 'train')}.html")]:  # fmt: skip
        browser.get(server + path)
        _shot(browser, name, tmp_path)


def test_two_runs_compared_show_their_config_difference_curves_and_shared_steps(root, tmp_path):
    """A second run in the same root (20 steps instead of 30; the data steps are skipped, shared by
    hash): the compare page lists train.steps 30 vs 20, draws both loss curves, and names the steps
    both runs were made from."""
    from shipyard.browse.site import open_site

    copy = tmp_path / "root"
    shutil.copytree(root, copy, symlinks=True)
    text = (root.parent / "quickstart.yaml").read_text().replace("train.steps=30", "train.steps=20")
    (tmp_path / "q.yaml").write_text(text)
    run_pipeline(str(tmp_path / "q.yaml"), root=copy, log=lambda m: None)
    site = open_site(copy)
    a, b = site.runs()
    page = site.render(f"compare/{a.key}__{b.key}.html")
    assert "<td>train.steps</td>" in page and {"<td>30</td>", "<td>20</td>"} <= set(_cells(page))
    assert f"{a.name} loss" in page and page.count("<polyline") >= 2
    both = [k for k in (_key(root, n) for n in ("documents", "filter", "dedup", "tokenizer", "tokens-train"))]
    for key in both:
        assert (
            f'{key}.html">{key}</a></td><td>' in page and page.split(f"{key}.html", 2)[-1].count("both") >= 1
        )


def _cells(page: str) -> list[str]:
    import re

    return re.findall(r"<td>[^<]*</td>", page)


def _key(root: Path, name: str) -> str:
    return next(p.name for p in root.iterdir() if p.name.rsplit("-", 1)[0] == name)


def test_a_flipped_byte_in_a_token_shard_marks_its_node_and_every_descendant(root, browser, tmp_path):
    from selenium.webdriver.common.by import By

    copy = tmp_path / "root"
    shutil.copytree(root, copy, symlinks=True)
    shard = sorted((copy / _key(root, "tokens-train")).glob("*.npy"))[0]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))
    out = tmp_path / "site"
    assert main(["browse", str(copy), "--static", str(out)]) == 0
    browser.get((out / "index.html").as_uri())
    status = {a.get_attribute("data-key").rsplit("-", 1)[0]: a.get_attribute("class")
              for a in browser.find_elements(By.CSS_SELECTOR, "svg.graph a.node")}  # fmt: skip
    bad = {name for name, cls in status.items() if "bad" in cls}
    assert bad == {"tokens-train", "train", "eval", "export", "sample", "report"}, status
    assert all("ok" in status[n] for n in ("documents", "filter", "dedup", "tokenizer", "tokens-validation"))
    browser.get((out / "node" / f"{_key(root, 'tokens-train')}.html").as_uri())
    assert "differs" in browser.find_element(By.CSS_SELECTOR, "p.status").text
    browser.get((out / "node" / f"{_key(root, 'train')}.html").as_uri())
    assert "upstream differs" in browser.find_element(By.CSS_SELECTOR, "p.status").text
    browser.get((out / "index.html").as_uri())
    _shot(browser, "flipped", tmp_path)


def test_the_batch_at_a_step_is_the_loader_s_batch_token_for_token(root, server, browser, tmp_path):
    from selenium.webdriver.common.by import By

    from shipyard.config import load_config
    from shipyard.data.loader import build_loader

    train = root / _key(root, "train")
    cfg = load_config(str(train / "config.yaml"))
    paths, weights = cfg.data.sources()
    loader = build_loader(paths, weights, cfg.data_seed(), cfg.train.global_batch_size, cfg.data.seq_len,
                          cfg.model.vocab_size)  # fmt: skip
    step = 7  # not one of the steps a static site holds: the server computes it on request
    want = loader.rows(step)
    browser.get(server + f"batch/{train.name}/{step}.html")
    rows = browser.find_elements(By.CSS_SELECTOR, "div.row")
    assert len(rows) == 8
    for r, row in enumerate(rows):
        ids = [int(s.get_attribute("data-id")) for s in row.find_elements(By.CSS_SELECTOR, "span[data-id]")]
        assert np.array_equal(ids, want[r]), r
    _shot(browser, "batch", tmp_path)


def test_the_static_site_works_from_file_with_the_network_off(root, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    out = tmp_path / "site"
    assert main(["browse", str(root), "--static", str(out)]) == 0
    with chromium(offline=True) as browser:
        start = (out / "index.html").as_uri()
        depth = _crawl(browser, start, out.as_uri())
        assert len(depth) == len(list(out.rglob("*.html")))  # every page reachable, each loads
        browser.get((out / "run" / f"{_key(root, 'train')}.html").as_uri())
        svg = browser.find_element(By.CSS_SELECTOR, "svg[data-chart]")
        ActionChains(browser).move_to_element(svg).perform()  # the package's script runs from file://
        assert "loss at" in browser.find_element(By.CSS_SELECTOR, "output.readout").text
        color = browser.execute_script(
            "return getComputedStyle(document.querySelector('h2')).borderBottomStyle"
        )
        assert color == "solid"  # and its style sheet applies
        assert browser.execute_script("return navigator.onLine") is False


def test_document_text_is_escaped_and_nothing_outside_root_is_served(tmp_path, browser):
    from selenium.webdriver.common.by import By

    docs = tmp_path / "docs.jsonl"
    evil = "<script>window.pwned = 1</script> <img src=x onerror='window.pwned = 2'>"
    rows = [
        {"id": f"d{i}", "text": f"{evil} " + " ".join(f"w{(i + j) % 50}" for j in range(60))}
        for i in range(6)
    ]
    docs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "p.yaml").write_text(
        "root: out\nsteps:\n  - {name: filter, kind: filter, inputs: {documents: docs.jsonl}, "
        "config: {profile: prose, min_words: 5}}\n"
    )
    run_pipeline(str(tmp_path / "p.yaml"), log=lambda m: None)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "provenance.json").write_text("{}")
    (tmp_path / "out" / "evil-0000").symlink_to(outside)
    before = sorted(str(p) for p in (tmp_path / "out").rglob("*"))
    with browse_server(tmp_path / "out") as base:
        browser.get(base + f"data/{_key(tmp_path / 'out', 'filter')}.html")
        assert evil in browser.find_element(By.CSS_SELECTOR, "pre.doc").text
        assert browser.execute_script("return window.pwned") is None
        for path in ["node/evil-0000.html", "..%2f..%2fetc%2fpasswd", "node/..%2f..%2fprovenance.json",
                     "%2fetc%2fpasswd", "assets/..%2f..%2f__init__.py", "node/../../../etc/passwd"]:  # fmt: skip
            got = httpx.get(base + path)
            assert got.status_code == 404 and "root:" not in got.text, path
    assert sorted(str(p) for p in (tmp_path / "out").rglob("*")) == before  # nothing written to ROOT


def test_a_token_is_required_when_given(root):
    with browse_server(root, "--token", "s3cret") as base:
        assert httpx.get(base).status_code == 403
        assert httpx.get(base + "?token=wrong").status_code == 403
        with httpx.Client() as client:
            assert client.get(base + "?token=s3cret").status_code == 200
            assert client.get(base + "model.html").status_code == 200  # the cookie carries it


def test_the_model_playground_answers_through_the_engine(root, server, browser, tmp_path):
    """Greedy from "def " as the pipeline's sample step: the same text, each token with its log-prob
    and alternatives, and the answer names the checkpoint and the shards it trained on."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import Select, WebDriverWait

    sample = json.loads((root / _key(root, "sample") / "sample.json").read_text())
    browser.get(server + "model.html")
    Select(browser.find_element(By.NAME, "model")).select_by_value(_key(root, "train"))
    box = browser.find_element(By.NAME, "max_tokens")
    box.clear()
    box.send_keys("48")
    browser.find_element(By.CSS_SELECTOR, "form#complete button").click()
    WebDriverWait(browser, 120).until(ec.presence_of_element_located((By.CSS_SELECTOR, "#answer .tok")))
    tokens = browser.find_elements(By.CSS_SELECTOR, "#answer .tok")
    text = "".join(t.get_attribute("textContent") for t in tokens)
    assert text.startswith(sample["completion"][:40]) or sample["completion"].startswith(text[:40])
    assert all(t.get_attribute("title") for t in tokens)  # top alternatives on every token
    answer = browser.find_element(By.ID, "answer").text
    assert "checkpoint 30" in answer and _key(root, "tokens-train") in answer
    _shot(browser, "model", tmp_path)


def test_trace_finds_a_generated_span_in_the_training_shards(root, server, browser, tmp_path):
    """A phrase of a training document with words the corpus never saw around it: the page lists the
    phrase's span with the document it comes from, the match highlighted; the made-up words not."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import Select, WebDriverWait

    from shipyard.data.documents import ReadStats, read_documents

    doc = next(read_documents([str(root / _key(root, "dedup"))], ReadStats()))
    phrase = doc.text[200:360]
    browser.get(server + "trace.html")
    Select(browser.find_element(By.NAME, "model")).select_by_value(_key(root, "train"))
    browser.find_element(By.NAME, "text").send_keys(f"zqxv wplk {phrase} jjqqzz")
    browser.find_element(By.CSS_SELECTOR, "form#trace button").click()
    WebDriverWait(browser, 120).until(ec.presence_of_element_located((By.CSS_SELECTOR, "#spans mark")))
    marks = [m.text for m in browser.find_elements(By.CSS_SELECTOR, "#spans mark")]
    assert any(phrase[30:-30] in m for m in marks), (phrase, marks[:3])
    assert not any("zqxv" in m or "jjqqzz" in m for m in marks)
    _shot(browser, "trace", tmp_path)


def test_a_chat_run_shows_its_packed_rows_with_their_loss_mask(tmp_path, browser):
    """A run directory as ROOT (a model SFT'd on chats): the batch page shows the
    packed rows token for token, the trained (shaded) tokens exactly the loss mask's, each packed
    conversation's start marked."""
    from chat_fixtures import train_sft, upper_task, write_chats, write_tokenizer
    from selenium.webdriver.common.by import By

    from shipyard.config import load_config
    from shipyard.train.trainer import load_data

    chats = write_chats(tmp_path / "chats.jsonl", upper_task(0, 64))
    run = train_sft(tmp_path / "runs", "chat", chats, write_tokenizer(tmp_path / "tok"),
                    "train.steps=2", "train.global_batch_size=8")  # fmt: skip
    rows = load_data(load_config(str(run / "config.yaml")), say=lambda m: None).loader.rows(1)
    with browse_server(run) as base:
        browser.get(base)
        assert "run" in browser.find_element(By.CSS_SELECTOR, "svg.graph").text
        browser.get(base + f"batch/{run.name}/1.html")
        shown = browser.find_elements(By.CSS_SELECTOR, "div.row")
        assert len(shown) == 8
        for r, row in enumerate(shown):
            spans = row.find_elements(By.CSS_SELECTOR, "span[data-id]")
            assert [int(s.get_attribute("data-id")) for s in spans] == rows["tokens"][r].tolist()
            trained = [t for t, s in enumerate(spans) if "t" in s.get_attribute("class").split()]
            assert trained == [t + 1 for t in np.flatnonzero(rows["loss_mask"][r])], r
            starts = np.count_nonzero(np.diff(rows["segment_ids"][r]))
            assert len(row.find_elements(By.CSS_SELECTOR, "b.seg")) == starts > 0
        _shot(browser, "chat-batch", tmp_path)
        # the playground chats with it: the prompt rendered with its template, the reply a turn
        body = {"model": run.name, "prompt": "upper abc", "mode": "chat", "max_tokens": 12}
        reply = httpx.post(base + "api/complete", json=body, timeout=120).json()
        assert reply["tokens"] and all(t["top"] for t in reply["tokens"]), reply
        assert httpx.post(base + "api/complete", json={**body, "mode": "sing"}).status_code == 400


def test_a_preference_run_shows_chosen_and_rejected_replies(tmp_path, browser):
    """A SimPO run on prompt / chosen / rejected pairs as ROOT: its batch page shows the packed pair
    rows token for token, each trained token marked chosen or rejected as the loader's slots say."""
    from chat_fixtures import QUIET, write_tokenizer
    from selenium.webdriver.common.by import By

    from shipyard.config import load_config
    from shipyard.train.trainer import load_data

    pairs = tmp_path / "pairs.jsonl"
    words = ["apple", "stone", "river", "cloud", "green", "light", "house", "table"] * 3
    pairs.write_text(
        "".join(
            json.dumps({"prompt": f"write: {w}", "chosen": w.upper(), "rejected": w}) + "\n" for w in words
        )
    )
    tok = write_tokenizer(tmp_path / "tok")
    run = tmp_path / "runs" / "pref"
    args = ["train", "tiny", f"run.out_dir={tmp_path / 'runs'}", "run.name=pref", "data.seq_len=64",
            f"data.preference={{train: {pairs}, tokenizer: {tok}}}", "train.steps=2", "train.global_batch_size=8",
            "train.preference={loss: simpo, beta: 2.0, gamma: 0.5}", *QUIET]  # fmt: skip
    assert main(args) == 0
    rows = load_data(load_config(str(run / "config.yaml")), say=lambda m: None).loader.rows(1)
    with browse_server(run) as base:
        browser.get(base + f"batch/{run.name}/1.html")
        for r, row in enumerate(browser.find_elements(By.CSS_SELECTOR, "div.row")):
            spans = row.find_elements(By.CSS_SELECTOR, "span[data-id]")
            assert [int(s.get_attribute("data-id")) for s in spans] == rows["tokens"][r].tolist()
            classes = [s.get_attribute("class").split() for s in spans]
            slots = rows["slots"][r]
            assert [t for t, c in enumerate(classes) if "ch" in c] == [
                t + 1 for t in np.flatnonzero((slots >= 0) & (slots % 2 == 0))
            ]
            assert [t for t, c in enumerate(classes) if "rj" in c] == [
                t + 1 for t in np.flatnonzero((slots >= 0) & (slots % 2 == 1))
            ]
            assert any("ch" in c for c in classes) and any("rj" in c for c in classes)
        _shot(browser, "preference-batch", tmp_path)
