"""tests/xdist_schedule.py keeps an `xdist_group` on one worker: four modules' tests of one group,
run on three workers, all run in one worker process (xdist's own "@group" nodeid suffix, which the
scheduler once relied on, is ignored by pytest >= 9.2, and the `ray` group's tests ran side by side)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def test_a_group_spread_over_modules_runs_on_one_worker(tmp_path):
    (tmp_path / "conftest.py").write_text('pytest_plugins = ("xdist_schedule",)\n')
    for m in range(4):
        (tmp_path / f"test_m{m}.py").write_text(
            "import os, pytest\n"
            "@pytest.mark.xdist_group('g')\n"
            "def test_grouped(tmp_path_factory):\n"
            f"    open({str(tmp_path / 'ran')!r}, 'a').write(os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n"
            "def test_free():\n"
            "    pass\n"
        )
    # only xdist and the scheduler: the installed plugins' imports would cost each worker seconds
    env = {**os.environ, "PYTHONPATH": str(TESTS), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    argv = ["-q", "-p", "xdist", "-p", "no:cacheprovider", "-n", "3", "--dist", "loadgroup", "."]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    workers = (tmp_path / "ran").read_text().split()
    assert len(workers) == 4 and len(set(workers)) == 1, workers
