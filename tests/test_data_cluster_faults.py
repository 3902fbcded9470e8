"""What a cluster that cannot do a stage's work says: one line naming the node's problem, a non-zero
exit, no output. The nodes are real Ray worker nodes started in a private mount namespace
(`unshare --mount`) with a directory hidden under an empty tmpfs, so the node cannot see what the
driver can: the stage's inputs, or shipyard itself."""

import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from data_fixtures import prose, write_jsonl

import shipyard

# (xdist_group: one Ray cluster on the machine at a time, tests/xdist_schedule.py)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
SHIPYARD = os.path.join(os.path.dirname(sys.executable), "shipyard")
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled"}


def _raylets() -> set[str]:
    return set(subprocess.run(["pgrep", "-x", "raylet"], capture_output=True, text=True).stdout.split())


@pytest.fixture(scope="module")
def head():
    """A head without CPUs: every task runs on the node a test starts."""
    pytest.importorskip("ray")
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--mount", "true"]).returncode:
        pytest.skip("needs unshare --mount (root)")
    from shipyard.parallel.launch import free_port

    port = free_port()
    cmd = [RAY, "start", "--head", f"--port={port}", "--num-cpus=0", "--include-dashboard=false"]
    subprocess.run([*cmd, "--disable-usage-stats"], check=True, capture_output=True, timeout=180, env=ENV)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120, env=ENV)


@contextlib.contextmanager
def _node_without(address: str, hidden: Path):
    """A one-CPU worker node that sees an empty directory at `hidden`; stopped (cleanly) after."""
    before = _raylets()
    script = f"mount -t tmpfs none '{hidden}' && exec '{RAY}' start --address={address} --num-cpus=1 --block"
    node = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while not _raylets() - before:
        assert node.poll() is None and time.time() < deadline, "the worker node did not start"
        time.sleep(0.2)
    try:
        yield
    finally:
        node.terminate()
        node.wait(timeout=120)


def _run(*args, cwd):
    return subprocess.run(
        [SHIPYARD, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=600, env=ENV
    )


def _one_line(r) -> str:
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 3 and len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    return lines[0]


def test_a_node_that_cannot_see_the_inputs_says_so(head, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_jsonl(corpus / "a.jsonl", [prose(s) for s in range(20)])
    with _node_without(head, corpus):
        r = _run("data", "filter", corpus / "a.jsonl", "--out", tmp_path / "f", "--ray", head, cwd=tmp_path)
    line = _one_line(r)
    assert "a.jsonl cannot be read on" in line and "every node mounts or in a bucket" in line, line
    assert not (tmp_path / "f").exists() and not list(tmp_path.glob(".f.*"))


def test_a_node_without_shipyard_says_so(head, tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [prose(s) for s in range(20)])
    source = Path(shipyard.__file__).resolve().parents[1]  # the checkout's src/ (an editable install)
    with _node_without(head, source):
        r = _run("data", "filter", "a.jsonl", "--out", "f", "--ray", head, cwd=tmp_path)
    line = _one_line(r)
    assert "cannot import 'shipyard'" in line and "install shipyard" in line, line
    assert not (tmp_path / "f").exists()


def test_a_bucket_without_credentials_says_so(head, tmp_path, s3_server):
    from s3_fixtures import make_bucket

    write_jsonl(tmp_path / "a.jsonl", [prose(s) for s in range(20)])
    env = {k: v for k, v in ENV.items() if not k.startswith("AWS_")}
    env.update(AWS_ENDPOINT_URL=s3_server.endpoint, HOME=str(tmp_path))  # no keys, no ~/.aws
    url = f"s3://{make_bucket(s3_server.endpoint)}/filtered"
    r = subprocess.run(
        [SHIPYARD, "data", "filter", "a.jsonl", "--out", url, "--ray", head],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    line = _one_line(r)
    assert "no credentials for the bucket" in line and "AWS_ACCESS_KEY_ID" in line, line
