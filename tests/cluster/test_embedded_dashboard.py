"""`smolforge dashboard`: the coordinator's API and page for the embedded cluster, on loopback.

One `smolforge dashboard --port 0` process for the module (one embedded Ray start): it prints the URL
and where the token is (the state dir's token file; the token itself never printed nor in argv), serves the page shell and its
allow-listed assets open and everything else only with the token, shows this machine live (its
node agent's heartbeat), runs a job submitted through its API, and stops on SIGINT. The page itself
is driven in a browser by tests/e2e/test_dashboard.py (same app, served by a coordinator).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from localcluster import cli_module

pytestmark = [pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    base = tmp_path_factory.mktemp("embdash")
    home = base / "home"
    ray_tmp = tempfile.mkdtemp(prefix="sfd", dir="/tmp")  # Ray's socket paths must stay short
    env = {**os.environ, "SMOLFORGE_HOME": str(home), "RAY_TMPDIR": ray_tmp, "RAY_USAGE_STATS_ENABLED": "0"}
    for k in ("SMOLFORGE_COORDINATOR", "SMOLFORGE_TOKEN", "SMOLFORGE_RAY_ADDRESS", "RAY_ADDRESS",
              "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(k, None)
    log = base / "dashboard.log"
    proc = subprocess.Popen([sys.executable, "-m", cli_module(), "dashboard", "--port", "0", "--cpus", "1"],
                            cwd=base, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 180
        found = None
        while time.time() < deadline and proc.poll() is None and not found:
            found = re.search(r"open: (http://127\.0\.0\.1:\d+)/dashboard ", log.read_text())
            time.sleep(0.3)
        assert found, log.read_text()[-3000:]
        token = (home / "embedded" / "token").read_text().strip()
        assert token not in log.read_text()  # the token is never printed: the URL names the file instead
        yield {"proc": proc, "base": found.group(1), "token": token, "home": home, "log": log}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # only when the SIGINT test did not end it
            proc.wait(timeout=30)
        import shutil

        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_url_token_and_open_routes(served):
    base, token = served["base"], served["token"]
    assert token.encode() not in Path(f"/proc/{served['proc'].pid}/cmdline").read_bytes()
    assert httpx.get(f"{base}/dashboard", timeout=10).status_code == 200
    js = httpx.get(f"{base}/dashboard/assets/uPlot.iife.min.js", timeout=10)
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript") and b"uPlot" in js.content
    assert httpx.get(f"{base}/dashboard/assets/..%2F__init__.py", timeout=10).status_code == 401  # not open
    auth = {"Authorization": f"Bearer {token}"}
    assert httpx.get(f"{base}/dashboard/assets/..%2F__init__.py", headers=auth, timeout=10).status_code == 404
    assert httpx.get(f"{base}/api/v1/status", timeout=10).status_code == 401


def test_this_machine_is_live_and_a_job_runs_through_the_api(served):
    base, auth = served["base"], {"Authorization": f"Bearer {served['token']}"}
    st = httpx.get(f"{base}/api/v1/status", headers=auth, timeout=10).json()
    assert st["coordinator"]["name"] == "embedded" and [n["role"] for n in st["nodes"]] == ["embedded"]
    deadline = time.time() + 60
    node = st["nodes"][0]
    while not (node.get("usage") or {}).get("ram_total_gb") and time.time() < deadline:
        time.sleep(0.5)  # the node agent reports every 3 s once the monitor has started it
        node = httpx.get(f"{base}/api/v1/nodes", headers=auth, timeout=10).json()[0]
    assert node["state"] == "online" and node["usage"]["ram_total_gb"] > 0 and node["usage"]["gpus"] == [], node
    r = httpx.post(f"{base}/api/v1/jobs", headers=auth, timeout=30, json={
        "kind": "data_parallel", "num_workers": 1, "name": "embedded-dash",
        "train": {"model": "tiny-llama", "data": {"path": "bundled", "max_samples": 16, "max_eval_samples": 4},
                  "max_steps": 2, "batch_size": 2, "eval_accuracy": False, "log_every": 1}})
    assert r.status_code == 200, r.text
    job_id = r.json()["job_id"]
    deadline = time.time() + 240
    job = {}
    while time.time() < deadline:
        job = httpx.get(f"{base}/api/v1/jobs/{job_id}", headers=auth, timeout=10).json()
        if job["state"] in ("completed", "failed", "cancelled"):
            break
        time.sleep(0.5)
    assert job["state"] == "completed", (job, served["log"].read_text()[-3000:])
    names = {m["name"] for m in httpx.get(f"{base}/api/v1/jobs/{job_id}/metrics", headers=auth, timeout=10).json()}
    assert "loss" in names


def test_refuses_when_a_coordinator_runs_and_stops_on_sigint(served, monkeypatch):
    from smolforge.cluster.embedded_dashboard import check_no_coordinator
    from smolforge.cluster.nodes.statedir import StateDir
    from smolforge.errors import SmolforgeError

    port = int(served["base"].rsplit(":", 1)[1])
    monkeypatch.setenv("SMOLFORGE_HOME", str(served["home"]))
    StateDir.at(None).write_coordinator({"host_for_clients": "127.0.0.1", "port": port, "api": served["base"]})
    with pytest.raises(SmolforgeError, match="a coordinator is running"):
        check_no_coordinator()
    StateDir.at(None).coordinator_file.unlink()

    proc = served["proc"]
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=90) == 0, served["log"].read_text()[-3000:]
