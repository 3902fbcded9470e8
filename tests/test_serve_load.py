"""The server under load (issue 34 item 4): bench/serve_load.py itself, run for 45 s on a
2-layer model of the bench's vocabulary. 16 streaming clients, 30% of them hanging up at a random
point of their reply, then a SIGKILL mid-stream and a restart. The bench exits non-zero when a
check fails; the test reads its JSON and names what failed: no failed request; afterwards no active
request and every slot free, and the server's cancelled counter equal to the drops; resident memory
grown < 5% from the first fifth of the run to the end; the killed server started again answers
within 10 s (its programs come from the compile cache) and exits 0 on SIGTERM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# solo: its resident-memory check read +6.5% beside the other worker's compiles in CI (+2.9% alone,
# 1,473 requests): it runs after the second tier's workers, alone (Makefile: test-slow).
pytestmark = [pytest.mark.slow, pytest.mark.solo]

ROOT = Path(__file__).resolve().parents[1]
SECONDS = 45  # ~400 requests on a 2-core VM: twice the 200 the leak checks below need


def test_sixteen_clients_dropping_streams_leak_nothing(tmp_path):
    out = tmp_path / "serve_load.json"
    argv = [sys.executable, str(ROOT / "bench/serve_load.py"), "--seconds", str(SECONDS)]
    argv += ["--shape", "tiny", "--out", str(out)]
    env = {**os.environ, "XLA_FLAGS": ""}  # the server as a user starts it: its own allocator
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=SECONDS + 420)
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    counts, after, restart = result["counts"], result["after"], result["restart"]
    print(
        f"{counts['sent']} requests in {SECONDS} s, {counts['dropped']} dropped mid-stream, "
        f"{counts['failed']} failed; cancelled {after['cancelled']:.0f}; "
        f"RSS {result['rss_growth']:+.2%}; restart answered in {restart['restart_to_first_answer_s']:.1f} s"
    )
    assert all(result["checks"].values()), (result["checks"], result)
    assert done.returncode == 0, done.stderr[-3000:]
    # the drops happened, and each one the server saw mid-reply ended its request: a run where the
    # clients never hung up, or the engine never noticed, cannot pass
    assert counts["dropped"] >= 0.2 * counts["sent"] and counts["sent"] >= 200, counts
    assert after["cancelled"] >= 0.9 * counts["dropped"], (after, counts)
