"""Auth before bytes: a real coordinator refuses a request without the token before reading its body,
and bounds the bodies of those with it. Raw sockets, so the test controls exactly what is sent."""

from __future__ import annotations

import time

import pytest

from helpers import MB, post_raw, rss_mb
from localcluster import LocalCluster

pytestmark = [pytest.mark.timeout(600)]

POST_ROUTES = ["/api/v1/jobs", "/api/v1/uploads", "/api/v1/nodes/n1/heartbeat", "/api/v1/jobs/j/pause",
               "/api/v1/jobs/j/resume", "/api/v1/jobs/j/cancel", "/api/v1/jobs/j/join"]


def _post(port: int, path: str, body_bytes: int, token: str | None = None, chunked: bool = False,
          payload: bytes | None = None) -> int:
    return post_raw(port, path, body_bytes, token=token, chunked=chunked, payload=payload)[0]


def test_no_token_no_body_read_and_bodies_are_bounded(tmp_path):
    import hashlib
    import os

    with LocalCluster(tmp_path) as cluster:
        # what a killed coordinator leaves: a half-written upload, and an old one no job names
        uploads = cluster.state / "artifacts" / "uploads"
        uploads.mkdir(parents=True)
        (uploads / ".upload.half").write_bytes(b"x" * 1000)
        stale = uploads / hashlib.sha256(b"stale").hexdigest()
        stale.write_bytes(b"y" * (8 * MB))
        os.utime(stale, (time.time() - 7200, time.time() - 7200))
        cluster.env["SMOLFORGE_UPLOAD_QUOTA_BYTES"] = str(12 * MB)
        cluster.start_coordinator()
        assert not (uploads / ".upload.half").exists() and not stale.exists()  # cleaned at start
        pid, port, token = cluster.coordinator.p.pid, cluster.port, cluster.token
        assert cluster.api("GET", "/health", token=None).status_code == 200
        time.sleep(2)
        before = rss_mb(pid)
        for path in POST_ROUTES:  # 50 MB to every POST route, no token: 401, nothing buffered
            assert _post(port, path, 50 * MB) == 401, path
            assert _post(port, path, 50 * MB, token="wrong") == 401, path
        assert _post(port, "/api/v1/jobs", 50 * MB, chunked=True) == 401
        grown = rss_mb(pid) - before
        assert grown < 20, f"RSS grew by {grown:.0f} MB"
        # invalid JSON without the token is a 401 too (FastAPI alone parsed first and said 422)
        assert _post(port, "/api/v1/jobs", 9, payload=b"{not json") == 401
        r = cluster.api("POST", "/api/v1/jobs", token=None, content=b"{not json")
        assert r.status_code == 401 and r.json()["fix"].startswith("pass the cluster token")
        # with the token, JSON routes take at most 4 MiB: 413, declared or streamed
        assert _post(port, "/api/v1/jobs", 5 * MB, token=token) == 413
        assert _post(port, "/api/v1/jobs", 5 * MB, token=token, chunked=True) == 413
        assert cluster.api("POST", "/api/v1/jobs", content=b"{not json").status_code == 400  # read: it is small
        # the upload route streams to disk and keeps its own, larger bound
        r = cluster.api("POST", "/api/v1/uploads", content=b"x" * (5 * MB))
        assert r.status_code == 200 and r.json()["bytes"] == 5 * MB
        # ... and all uploads together a quota (12 MiB here): young uploads may belong to a job on its way
        assert cluster.api("POST", "/api/v1/uploads", content=b"z" * (5 * MB)).status_code == 200
        r = cluster.api("POST", "/api/v1/uploads", content=b"w" * (5 * MB))
        assert r.status_code == 507 and "SMOLFORGE_UPLOAD_QUOTA_BYTES" in r.json()["fix"], r.text
        assert not list(uploads.glob(".upload.*"))  # the refused one left nothing behind
        # heartbeats are checked against their schema: a string where a number belongs is refused,
        # and /metrics (which renders them) keeps answering
        node = cluster.api("GET", "/api/v1/nodes").json()[0]
        node_id = node.get("node_id") or node.get("id")
        hb = f"/api/v1/nodes/{node_id}/heartbeat"
        assert cluster.api("POST", hb, json={"ts": time.time(), "cpu_percent": "lots"}).status_code == 400
        assert cluster.api("POST", hb, json={"ts": time.time(), "gpus": [{"index": -1}]}).status_code == 400
        assert cluster.api("POST", "/api/v1/nodes/a%20b/heartbeat", json={"ts": time.time()}).status_code == 400
        assert cluster.api("POST", hb, json={"ts": time.time(), "cpu_percent": 12.5, "ram_percent": 40}).status_code == 200
        metrics = cluster.api("GET", "/metrics")
        assert metrics.status_code == 200 and "smolforge_node_cpu_percent" in metrics.text
