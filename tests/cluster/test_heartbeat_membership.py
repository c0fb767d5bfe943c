"""Heartbeats are kept only for nodes that joined (issue 43): the review posted 300 heartbeats from
invented node ids, 1,024 GPU entries each, and the coordinator grew by 88 MB. The route answers an
unknown id 404 in the API's error shape and keeps nothing; a node Ray no longer lists is forgotten;
a heartbeat holds at most `MAX_GPUS` GPU entries. The coordinator's app in this process (its real
gate and routes), a node monitor whose Ray node table is a fake: no Ray, no sockets."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

TOKEN = "heartbeat-token-of-issue-43"


def _node(node_id: str, alive: bool = True):
    from smolforge.cluster.nodes.ray_glue import NodeInfo

    return NodeInfo(node_id=node_id, name=node_id, address="127.0.0.1", alive=alive, role="worker", cpus=1, gpus=0,
                    ram_gb=1.0, gpu_type=None, models=[], resources={"CPU": 1.0}, available={"CPU": 1.0})


@pytest.fixture
def cluster(monkeypatch):
    """(test client, monitor, the fake node table): the monitor's tick reads the table and starts no agent."""
    from starlette.testclient import TestClient

    from smolforge.cluster.api import create_app
    from smolforge.cluster.nodes import node_agent, ray_glue

    table = [_node("n1")]
    monkeypatch.setattr(ray_glue, "nodes", lambda include_dead=False: list(table))
    agent = SimpleNamespace(retarget=SimpleNamespace(remote=lambda *a: None))
    monkeypatch.setattr(node_agent, "ensure_agent", lambda *a, **k: agent)
    monitor = node_agent.NodeMonitor("http://127.0.0.1:9", TOKEN, store=None)  # never started: ticked by hand
    with TestClient(create_app(SimpleNamespace(token=TOKEN, monitor=monitor))) as client:
        client.headers["Authorization"] = f"Bearer {TOKEN}"
        yield client, monitor, table


def _sample(gpus: int) -> dict:
    return {"ts": time.time(), "cpu_percent": 5.0,
            "gpus": [{"index": i, "util_percent": 1.0, "mem_used_gb": 1.0, "mem_total_gb": 80.0} for i in range(gpus)]}


def test_heartbeats_from_ids_that_never_joined_are_refused_and_kept_nowhere(cluster):
    from smolforge.cluster.nodes.heartbeat import MAX_GPUS

    client, monitor, table = cluster
    assert client.post("/api/v1/nodes/n1/heartbeat", json=_sample(1)).status_code == 404  # before any tick
    monitor.tick()
    assert client.post("/api/v1/nodes/n1/heartbeat", json=_sample(MAX_GPUS)).status_code == 200
    for i in range(30):  # the review's attack, smaller: invented ids, as many GPUs as a heartbeat may hold
        r = client.post(f"/api/v1/nodes/invented-{i}/heartbeat", json=_sample(MAX_GPUS))
        assert r.status_code == 404 and set(r.json()) == {"error", "where", "fix"}, r.text
        assert "has joined" in r.json()["error"] and "worker join" in r.json()["fix"]
    assert set(monitor.heartbeats) == {"n1"} and monitor.refused == 31
    assert set(monitor.first_seen) == {"n1"}
    r = client.post("/api/v1/nodes/n1/heartbeat", json=_sample(MAX_GPUS + 1))
    assert r.status_code == 400, r.text  # more GPUs than a node has: the schema refuses it before anything is kept
    table[:] = [_node("n2")]  # n1 left and Ray no longer lists it; n2 joined
    monitor.tick()
    assert client.post("/api/v1/nodes/n1/heartbeat", json=_sample(1)).status_code == 404
    assert client.post("/api/v1/nodes/n2/heartbeat", json=_sample(1)).status_code == 200
    assert set(monitor.heartbeats) == {"n2"} and set(monitor.first_seen) == {"n2"}
