"""A real Chromium (Debian's chromium + chromium-driver through Selenium) and `shipyard browse`
servers for tests/test_browse.py. Without the browser the tests skip, and the session's summary
says so in one line with how to install it; SHIPYARD_REQUIRE_BROWSER=1 (.ci/run) makes a missing
browser a failure instead."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")
INSTALL = "apt-get install chromium chromium-driver"


def browser_paths() -> tuple[str, str] | None:
    binary = next((shutil.which(b) for b in CHROMIUM if shutil.which(b)), None)
    driver = shutil.which("chromedriver")
    return (binary, driver) if binary and driver else None


def need_browser() -> tuple[str, str]:
    found = browser_paths()
    if found is None:
        if os.environ.get("SHIPYARD_REQUIRE_BROWSER") == "1":
            pytest.fail(f"browser tests: no chromium / chromedriver on PATH ({INSTALL}); CI requires them")
        pytest.skip(f"no chromium / chromedriver: the browser tests need `{INSTALL}`")
    try:
        import selenium  # noqa: F401
    except ImportError:
        pytest.skip("selenium is not installed (make install adds it)")
    return found


@contextlib.contextmanager
def chromium(offline: bool = False, width: int = 1280, height: int = 1000):
    """A headless Chromium under Selenium; `offline`: every network request fails (file:// still
    loads), as on a machine without a network."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver = need_browser()
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 f"--window-size={width},{height}", "--allow-file-access-from-files"):  # fmt: skip
        opts.add_argument(flag)
    if offline:  # no name resolves and no proxy answers: nothing outside file:// can load
        opts.add_argument("--host-resolver-rules=MAP * ~NOTFOUND")
        opts.add_argument("--proxy-server=127.0.0.1:9")
    browser = webdriver.Chrome(options=opts, service=Service(driver))
    try:
        if offline:
            browser.execute_cdp_cmd("Network.enable", {})
            browser.execute_cdp_cmd(
                "Network.emulateNetworkConditions",
                {"offline": True, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1},
            )
        yield browser
    finally:
        browser.quit()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def browse_server(root: Path, *extra: str):
    """`shipyard browse ROOT` as a user starts it; yields its base URL once it answers."""
    port = free_port()
    env = {**os.environ, "SHIPYARD_NO_REEXEC": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "shipyard.cli", "browse", str(root), "--port", str(port), *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.time() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"shipyard browse exited: {proc.stdout.read()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "assets/browse.css", timeout=2).status_code in (200, 403):
                    break
            if time.time() > deadline:
                raise RuntimeError("shipyard browse did not answer in 120 s")
            time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
