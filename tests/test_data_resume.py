"""A data stage whose driver was SIGKILLed goes on from the units (and shuffle tasks) it finished:
they are verified by their files' sha256 and skipped, the rest run, and the output is the bytes an uninterrupted run
writes. A partial run with other settings is refused in one line and kept."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shipyard.data.stdlib import write_stdlib_documents

pytestmark = pytest.mark.slow

SHIPYARD = os.path.join(os.path.dirname(sys.executable), "shipyard")
TIMING = ("seconds", "mb_per_s")


def _corpus(tmp_path: Path) -> list[str]:
    """The stdlib corpus three times over (about 36 work units of a megabyte)."""
    write_stdlib_documents(tmp_path / "stdlib")
    text = (tmp_path / "stdlib" / "train.jsonl").read_bytes()
    paths = []
    for k in range(3):
        path = tmp_path / f"in{k}.jsonl"
        path.write_bytes(text)
        paths.append(str(path))
    return paths


def _dedup(inputs, out, *extra):
    cmd = [SHIPYARD, "data", "dedup", *inputs, "--out", str(out), "--workers", "1", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def _output(out: Path) -> dict:
    files = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
    stats = json.loads(files.pop("stats.json"))
    for k in TIMING:
        stats.pop(k)
    return {"stats": stats, "files": files}


def test_a_killed_dedup_resumes_from_its_finished_units(tmp_path):
    inputs = _corpus(tmp_path)
    clean = _dedup(inputs, tmp_path / "clean")
    assert clean.returncode == 0, clean.stderr
    out = tmp_path / "out"
    partial = tmp_path / ".out.partial" / "_resume"
    proc = subprocess.Popen(
        [SHIPYARD, "data", "dedup", *inputs, "--out", str(out), "--workers", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    while not (partial / "write-00002.json").exists():  # every shuffle step and three units written
        assert proc.poll() is None and time.time() < deadline, "the stage ended before it could be killed"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists()  # nothing half-published
    written = len(list(partial.glob("write-*.json")))
    units = json.loads((partial / "header.json").read_text())["units"]["count"]
    assert len(list(partial.glob("sketch-*.json"))) == units and 3 <= written < units
    # a finished unit whose file is damaged is not taken: it runs again
    sig = tmp_path / ".out.partial" / "_dedup" / "sig" / "00001.npy"
    sig.write_bytes(sig.read_bytes()[:-8])
    again = _dedup(inputs, out)
    assert again.returncode == 0, again.stderr
    resumed = dict(re.findall(r"data dedup: ([a-z ,()0-9-]+): resuming: (\d+ of \d+) units", again.stderr))
    assert resumed.pop("sketch") == f"{units - 1} of {units}", again.stderr
    assert resumed.pop("write") == f"{written} of {units}", again.stderr
    # the shuffle steps in between (one task each on this small corpus) are not run again either
    steps = {"exact keys", "exact duplicates", "bands", "buckets", "pairs", "similarity", "drop lists"}
    assert steps <= set(resumed) and set(resumed.values()) == {"1 of 1"}, again.stderr
    assert any(k.startswith("components, round") for k in resumed), again.stderr
    assert not (tmp_path / ".out.partial").exists()
    assert _output(out) == _output(tmp_path / "clean")


def test_a_partial_run_with_other_settings_is_refused_and_kept(tmp_path):
    inputs = _corpus(tmp_path)[:1]
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [SHIPYARD, "data", "dedup", *inputs, "--out", str(out), "--workers", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    partial = tmp_path / ".out.partial" / "_resume"
    deadline = time.time() + 300
    while not (partial / "sketch-00000.json").exists():
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = sorted(p.name for p in partial.iterdir())
    other = _dedup(inputs, out, "--set", "threshold=0.7")
    assert other.returncode != 0
    lines = other.stderr.strip().splitlines()
    assert len(lines) == 1 and "partial run with other settings" in lines[0], other.stderr
    assert "config.dedup.threshold: 0.8 -> 0.7" in lines[0] and "--overwrite" in lines[0]
    assert sorted(p.name for p in partial.iterdir()) == before  # nothing of it lost
    fresh = _dedup(inputs, out, "--set", "threshold=0.7", "--overwrite")
    assert fresh.returncode == 0 and "resuming" not in fresh.stderr, fresh.stderr
    assert json.loads((out / "stats.json").read_text())["config"]["dedup"]["threshold"] == 0.7
