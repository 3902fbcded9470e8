"""How a tier spreads over worker processes (pytest-xdist, `-n N --dist loadgroup`: `make test-slow` on 3
by default, `make test JOBS=N`).

- A module's tests stay together on one worker: they share module fixtures (a trained run, a running
  server, compiled programs in memory), and split across workers each would build them again.
- Tests marked `xdist_group(name)` run on one worker, one after the other, whatever their module:
  the tests that start a Ray cluster of their own are the `ray` group (two `ray start --head` on one
  machine at once contend for Ray's default ports and its /tmp/ray session directory, and a test's
  `ray stop --force` stops every Ray process on the machine, another test's cluster too).
  pytest-xdist marks a group by appending "@name" to the test's nodeid on the worker, which pytest
  >= 9.2 ignores (its nodeid comes from `Node._id`): the groups then went unseen and two Ray tests
  ran side by side (CI met one's cluster killed by the other's `ray stop`). So the workers write
  each grouped test's group to a file the controller reads when it splits the work.
- The costliest modules start first (seconds per module in each tier from the last measured run,
  tests/module_seconds.json, written by `tools/durations_table.py --write-seconds TIER`), so the
  workers finish together instead of one waiting on a long module picked up last. A module missing
  from the table counts as a long one: a new module is better started early than left to the end.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

SECONDS = Path(__file__).with_name("module_seconds.json")
UNKNOWN_SECONDS = 60.0


def module_seconds(tier: str) -> dict[str, float]:
    """Seconds per module measured in `tier` (the `-m` expression: "not slow", "slow"; any other
    selection takes the larger of the two)."""
    try:
        tiers = json.loads(SECONDS.read_text())
    except (OSError, ValueError):
        return {}
    if tier in tiers:
        return tiers[tier]
    merged: dict[str, float] = {}
    for table in tiers.values():
        for module, s in table.items():
            merged[module] = max(s, merged.get(module, 0.0))
    return merged


_GROUPS = pytest.StashKey[Path]()
"""On the controller: the file the workers write {nodeid: group} to."""


def pytest_configure(config):
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", None):
        config.stash[_GROUPS] = Path(tempfile.mkdtemp(prefix="shipyard-xdist-")) / "groups.json"


def pytest_unconfigure(config):
    path = config.stash.get(_GROUPS, None)
    if path is not None:
        shutil.rmtree(path.parent, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """On the controller, per worker (an xdist hook): where to write the groups."""
    node.workerinput["shipyard_groups"] = str(node.config.stash[_GROUPS])


def _write_groups(path: str, items) -> None:
    """{nodeid: group} of the tests marked xdist_group (every worker collects alike: same content);
    written whole, then renamed, so the controller never reads half a file."""
    groups = {}
    for item in items:
        names = sorted(
            {
                str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                for m in item.iter_markers("xdist_group")
            }
        )
        if names:
            groups[item.nodeid.split("@")[0]] = "_".join(names)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(groups, f)
    os.replace(tmp, path)


def pytest_collection_modifyitems(config, items):
    """On a worker: the modules in order of their cost, each module's tests in their own order (every
    worker sorts alike, as xdist requires of their collections); the groups written for the controller."""
    if not hasattr(config, "workerinput"):
        return
    if "shipyard_groups" in config.workerinput:
        _write_groups(config.workerinput["shipyard_groups"], items)
    cost = module_seconds(config.option.markexpr or "")
    first_seen = {}
    for i, item in enumerate(items):
        first_seen.setdefault(item.nodeid.split("::")[0], i)

    def key(item):
        module = item.nodeid.split("::")[0]
        return (-cost.get(module, UNKNOWN_SECONDS), first_seen[module])

    items.sort(key=key)  # (stable: within a module the collected order stands)


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadGroupScheduling

    path = config.stash[_GROUPS]

    class ModuleOrGroup(LoadGroupScheduling):
        """Work units: an `xdist_group` (from the workers' file; the nodeid's "@name" suffix where
        pytest keeps it), else the test's module."""

        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if "@" in nodeid:
                return "@" + nodeid.split("@")[-1]
            if self.groups is None:  # read once the workers have collected (they write it first)
                self.groups = json.loads(path.read_text()) if path.exists() else {}
            group = self.groups.get(nodeid)
            return "@" + group if group else nodeid.split("::")[0]

    config.option.loadscopereorder = False  # keep the costliest-first order of the collection
    return ModuleOrGroup(config, log)
