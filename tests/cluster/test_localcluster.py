"""The test harness's own cleanup (`localcluster.orchestrators_on`), without Ray.

Stop 40's CI lost a pytest process this way: test_distill_cluster's fixture connected to its head,
one of its nodes never joined, and the harness stopped the head without disconnecting (the failed
spawn had returned no handle). Ray ends a driver whose head is gone, so the pytest process died two
tests later, in another module, and the run was stopped at 90 minutes. Here the handle is a stand-in
that records its `shutdown` (the edge: a real driver's death takes a minute and the process with it).
"""

from __future__ import annotations

import pytest

from localcluster import orchestrators_on
from smolforge.cluster.nodes import ray_glue


class StandIn:
    def __init__(self):
        self.shut = 0

    def shutdown(self) -> None:
        self.shut += 1
        ray_glue._HANDLE = None


def test_a_spawn_that_fails_after_connecting_is_disconnected_before_its_processes_stop(monkeypatch):
    handle, order = StandIn(), []
    monkeypatch.setattr(ray_glue, "_HANDLE", None)
    monkeypatch.setattr("smolforge.cluster.nodes.ray_process.stop", lambda p: order.append(("stop", handle.shut)))

    def spawn(procs: list):
        procs.append("head")
        ray_glue._HANDLE = handle  # what ray_glue.connect leaves behind
        raise AssertionError("node cpu-box did not join")

    with pytest.raises(AssertionError, match="did not join"):
        with orchestrators_on(spawn, "teacher_student"):
            pass
    assert handle.shut == 1 and ray_glue.connected_handle() is None
    assert order == [("stop", 1)]  # the head stopped only after the driver had disconnected
