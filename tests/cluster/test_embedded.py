"""`smolforge launch` with no coordinator runs on an embedded cluster of this machine: the same
scheduler, worker group and control actor, in the CLI's own process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from localcluster import cli_module


@pytest.mark.slow
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
    try:
        proc = subprocess.run(
            [sys.executable, "-m", cli_module(), "launch", "--model", "tiny-llama", "--dataset", str(data),
             "--workers", "2", "--batch-size", "2", "--max-steps", "4", "--max-length", "64",
             "--set", "eval_accuracy=false", "--set", "data.max_eval_samples=4",
             "--output-dir", str(tmp_path / "out"), "--json"],
            capture_output=True, text=True, timeout=500, env=env, start_new_session=True)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["state"] == "completed", out["error"]
    assert out["result"]["world"] == 2 and out["result"]["steps"] == 4
    assert (Path(out["adapter_dir"]) / "adapter_model.safetensors").exists()
    assert Path(out["adapter_dir"]).parent == tmp_path / "out"
