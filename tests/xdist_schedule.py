"""How a tier spreads over worker processes (pytest-xdist, `-n N --dist loadgroup`: `make test-slow` on 3
by default, `make test JOBS=N`).

- A module's tests stay together on one worker: they share module fixtures (a trained run, a running
  server, compiled programs in memory), and split across workers each would build them again.
- Tests marked `xdist_group(name)` run on one worker, one after the other, whatever their module:
  the tests that start a Ray cluster of their own are the `ray` group (two `ray start --head` on one
  machine at once contend for Ray's default ports and its /tmp/ray session directory).
- The costliest modules start first (seconds per module in each tier from the last measured run,
  tests/module_seconds.json, written by `tools/durations_table.py --write-seconds TIER`), so the
  workers finish together instead of one waiting on a long module picked up last. A module missing
  from the table counts as a long one: a new module is better started early than left to the end.
"""

from __future__ import annotations

import json
from pathlib import Path

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


def pytest_collection_modifyitems(config, items):
    """On a worker: the modules in order of their cost, each module's tests in their own order (every
    worker sorts alike, as xdist requires of their collections)."""
    if not hasattr(config, "workerinput"):
        return
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

    class ModuleOrGroup(LoadGroupScheduling):
        """Work units: an `xdist_group` (the nodeid's "@name" suffix), else the test's module."""

        def _split_scope(self, nodeid: str) -> str:
            if "@" in nodeid:
                return nodeid.split("@")[-1]
            return nodeid.split("::")[0]

    config.option.loadscopereorder = False  # keep the costliest-first order of the collection
    return ModuleOrGroup(config, log)
