"""What shipyard asks of Ray, checked without a cluster.

`--ray local` starts a Ray instance of its own: it reaches `ray.init` as "local", never as None,
which Ray reads as "join the cluster started last on this machine" (RAY_ADDRESS or
/tmp/ray/ray_current_cluster), so a data stage or pipeline would run on someone else's cluster.
A data task whose node goes away before it has its stage's setup asks Ray to run it again
(tests/test_data_cluster.py kills nodes for real; there CI met the broken pipe this turns into a
retry)."""

from __future__ import annotations

import pytest

from shipyard.data import cluster
from shipyard.experiment import executor

ray = pytest.importorskip("ray")


class _Stop(Exception):
    """Raised by the stand-in `ray.init` once it has seen its arguments (nothing starts)."""


@pytest.fixture
def addresses(monkeypatch) -> list:
    seen = []

    def init(address=None, **_):
        seen.append(address)
        raise _Stop

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    return seen


def test_a_data_stage_with_ray_local_asks_for_a_new_instance(addresses):
    with pytest.raises(_Stop):
        cluster.connect(cluster.RayCluster("local"))
    assert addresses == ["local"]


def test_a_pipeline_with_ray_local_asks_for_a_new_instance(addresses):
    with pytest.raises(_Stop):
        executor._run_on_ray([], "local", log=lambda m: None)
    assert addresses == ["local"]


def test_a_task_that_cannot_fetch_its_setup_asks_ray_to_run_it_elsewhere(monkeypatch):
    class Ref:
        def hex(self) -> str:
            return "a-new-stage"

    def broken(ref):
        raise OSError("Broken pipe")  # what ray.get raised on a node whose raylet had been killed

    monkeypatch.setattr(ray, "get", broken)
    with pytest.raises(cluster.SetupLost, match="Broken pipe"):
        cluster._run_unit(lambda item: item, 1, [Ref()])
