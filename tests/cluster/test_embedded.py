"""`smolforge launch` with no coordinator runs on an embedded cluster of this machine: the same
scheduler, worker group and control actor, in the CLI's own process; everything it starts listens on
loopback only."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from listeners import ListenerSampler
from localcluster import cli_module


@pytest.mark.timeout(600)
def test_launch_without_coordinator_uses_embedded_cluster(tmp_path):
    from smolforge.data.synthetic import generate

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate(64, seed=5)))
    ray_tmp = tempfile.mkdtemp(prefix="sfe", dir="/tmp")
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}
    for k in ("SMOLFORGE_COORDINATOR", "SMOLFORGE_TOKEN", "SMOLFORGE_RAY_ADDRESS", "RAY_ADDRESS",
              "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(k, None)
    seen: set = set()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", cli_module(), "launch", "--model", "tiny-llama", "--dataset", str(data),
             "--workers", "2", "--batch-size", "2", "--max-steps", "8", "--max-length", "64",
             "--set", "eval_accuracy=false", "--set", "data.max_eval_samples=4",
             "--output-dir", str(tmp_path / "out"), "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
        # every socket the embedded cluster and the job's ranks listen on, sampled while they run
        sampler = ListenerSampler([proc.pid]).start()
        try:
            stdout, stderr = proc.communicate(timeout=500)
        finally:
            seen = sampler.stop()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
    outside = [x for x in seen if not x.loopback]
    assert not outside, outside  # "listen where told": an embedded cluster has no reason to be reachable
    names = {x.name for x in seen}
    assert "gcs_server" in names and "raylet" in names and any(n.startswith("ray::DPW") for n in names), names
    out = json.loads(stdout.strip().splitlines()[-1])
    assert out["state"] == "completed", out["error"]
    assert out["result"]["world"] == 2 and out["result"]["steps"] == 8
    # the headline a script or benchmark reads: one object, these keys at its top
    assert out["strategy"] == "ddp" and out["workers"] == 2 and out["steps"] == 8 and out["samples"] == 8 * 2 * 2
    assert out["final_loss"] > 0 and out["eval_loss"] > 0 and out["seconds"] > 0
    for key in ("comm_bytes_sent_per_rank", "peak_rss_mb_per_rank", "optimizer_state_bytes_per_rank"):
        assert len(out[key]) == 2 and all(v > 0 for v in out[key]), (key, out[key])
    assert (Path(out["adapter_dir"]) / "adapter_model.safetensors").exists()
    assert Path(out["adapter_dir"]).parent == tmp_path / "out"
