"""Per-test CPU seconds, opt-in: with SHIPYARD_TEST_CPU_LOG=PATH every test appends one JSON line
to PATH (nodeid, wall seconds, CPU seconds of the test process and of the children it reaped).

Under pytest-xdist on two cores a test's wall time says little about what it costs the others (it
waits on a subprocess, or on a worker beside it); the CPU seconds add up to the tier's CPU time.
Not counted: processes a test does not reap itself (daemonised Ray nodes, the fork server's
children), so Ray's and forked runs' tests show low here. tools/cpu_table.py summarises the file.
"""

from __future__ import annotations

import json
import os
import resource
import time

import pytest

_PATH = os.environ.get("SHIPYARD_TEST_CPU_LOG")


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _PATH:
        yield
        return
    wall, own, kids = time.perf_counter(), _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
    yield
    row = {
        "nodeid": item.nodeid,
        "wall": round(time.perf_counter() - wall, 2),
        "cpu": round(_cpu(resource.RUSAGE_SELF) - own, 2),
        "children": round(_cpu(resource.RUSAGE_CHILDREN) - kids, 2),
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
    }
    with open(_PATH, "a", encoding="utf-8") as f:  # one short line per write: appends do not interleave
        f.write(json.dumps(row) + "\n")
