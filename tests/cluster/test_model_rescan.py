"""Models found while a worker runs (issue 33 item 5): a model copied into a worker's --models-dir after
it joined is advertised and placed on without a re-join by hand.

On a real cluster: tests/cluster/test_model_travel.py::
test_a_model_copied_in_after_join_is_placed_on_without_a_rejoin, on that module's cluster (its workers'
models dirs are their own, their rescan timer is off, and its workers re-register with Ray anyway; this
module's own cluster cost ~35 s of the CI tier). Here: the pieces in process.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.timeout(600)


def test_model_changes_counts_models_not_their_aliases(tmp_path):
    from smolforge.cluster.nodes.discovery import model_changes

    old = {"same": "/m/same", "moved": "/m/moved", "gone": "/m/gone", "same-alias": "alias:same"}
    new = {"same": "/m/same", "moved": "/x/moved", "b": "/m/b", "b-alias": "alias:b"}
    assert model_changes(old, new) == (["b", "moved"], ["gone"])  # a moved model's new path is advertised
    assert model_changes(new, dict(new)) == ([], [])


def test_the_timer_waits_for_an_idle_node_before_re_registering(tmp_path, monkeypatch):
    """In process: the timer finds a new model while a task holds the node's CPU (says so, keeps the
    node), and re-registers at the first check after the CPU is free."""
    from types import SimpleNamespace

    from smolforge.cluster.nodes import worker
    from smolforge.cluster.nodes.discovery import Inventory
    from smolforge.cluster.nodes.statedir import StateDir

    monkeypatch.setenv(worker.RESCAN_ENV, "0.05")
    monkeypatch.setattr(worker, "POLL_S", 0.01)
    stopped = []
    monkeypatch.setattr(worker.ray_process, "stop", lambda proc, timeout: stopped.append(proc))
    (tmp_path / "models" / "late").mkdir(parents=True)
    (tmp_path / "models" / "late" / "config.json").write_text("{}")
    lines: list[str] = []
    node = worker.WorkerNode(worker.WorkerOptions("127.0.0.1:1", models_dir=str(tmp_path / "models"),
                                                  scan_hf_cache=False), announce=lines.append)
    node.inv, node.proc = Inventory("w1", 1, 1.0), SimpleNamespace(poll=lambda: None)
    free = iter([0.0, 0.0, 1.0])  # busy at two checks, then idle
    monkeypatch.setattr(node, "_nodes", lambda token: [{"name": "w1", "alive": True, "ray_resources": {"CPU": 1.0},
                                                         "available": {"CPU": next(free)}}])
    assert node._watch(StateDir.at(tmp_path / "state")) is None  # None: stopped to re-register
    assert stopped == [node.proc]
    # busy at two checks, said once (the node checks every BUSY_RETRY_S, 2 s: not a line each time)
    assert lines == ["found model late; this node is busy (1 of 1 CPUs in use): re-registering when it is idle",
                     "found model late; re-registering"], lines
    assert next(free, "spent") == "spent"  # the three checks were made: busy, busy, idle


def test_rescan_without_a_running_worker_says_how_to_start_one(tmp_path):
    """No worker.json, or one left by a worker that is gone: one message, before any request is left."""
    import subprocess

    from smolforge.cluster.nodes import worker
    from smolforge.errors import SmolforgeError

    with pytest.raises(SmolforgeError, match="no worker runs with state dir") as err:
        worker.request_rescan(str(tmp_path))
    assert "smolforge worker join" in err.value.render()
    gone = subprocess.Popen(["true"])
    gone.wait()
    (tmp_path / worker.PID_FILE).write_text(json.dumps({"pid": gone.pid}))
    with pytest.raises(SmolforgeError, match=f"pid {gone.pid}. is gone"):
        worker.request_rescan(str(tmp_path))
    assert not (tmp_path / worker.RESCAN_FILE).exists()
