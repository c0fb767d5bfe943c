"""An embedded `launch` whose process dies mid-job is not `running` forever: the next command finds
it interrupted, and `smolforge job resume` continues it from its last checkpoint, in that command."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from localcluster import cli_module

pytestmark = [pytest.mark.timeout(900)]


def _env(home: Path, ray_tmp: str) -> dict:
    env = {**os.environ, "SMOLFORGE_HOME": str(home), "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "token",
           "RAY_USAGE_STATS_ENABLED": "0"}
    for k in ("SMOLFORGE_COORDINATOR", "SMOLFORGE_TOKEN", "SMOLFORGE_RAY_ADDRESS", "RAY_ADDRESS",
              "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "SMOLFORGE_KEEP_HOME"):
        env.pop(k, None)
    return env


def _cli(env: dict, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", cli_module(), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, start_new_session=True)


@pytest.mark.soak  # the CI tier's proof of this path: test_embedded_reaping.py (kill, reap, show, resume)
def test_killed_embedded_launch_is_resumed_from_its_checkpoint(tmp_path):
    from smolforge.cluster.control.jobstore import JobStore
    from smolforge.data.synthetic import generate
    from smolforge.models.tiny import preset_dir

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate(64, seed=5)))
    model = tmp_path / "my-model"  # a model named by a local directory: this machine holds it
    shutil.copytree(preset_dir("tiny-llama"), model)
    home = tmp_path / "home"
    ray_tmp = tempfile.mkdtemp(prefix="sfr", dir="/tmp")
    env = _env(home, ray_tmp)
    steps = 400
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", cli_module(), "launch", "--model", "./my-model", "--dataset", str(data),
             "--workers", "1", "--batch-size", "2", "--max-steps", str(steps), "--max-length", "64",
             "--save-every", "10", "--set", "eval_accuracy=false", "--set", "data.max_eval_samples=4",
             "--name", "interrupted-run", "--quiet"],
            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "launch.log", "w"),
            start_new_session=True)
        db = home / "embedded" / "jobs.db"
        deadline = time.time() + 300
        job = None
        while time.time() < deadline and proc.poll() is None:
            if db.exists():
                jobs = JobStore(db).list_jobs()
                job = jobs[0] if jobs else None
                if job and (job["step"] or 0) >= 25:
                    break
            time.sleep(0.3)
        assert job and (job["step"] or 0) >= 25, (job, (tmp_path / "launch.log").read_text()[-3000:])
        os.killpg(proc.pid, signal.SIGKILL)  # the CLI and the Ray processes it started
        proc.wait(timeout=30)
        assert JobStore(db).get_job(job["id"])["state"] == "running"  # what a dead process leaves behind

        listed = _cli(env, "jobs", "--json")
        assert listed.returncode == 0, listed.stderr[-3000:]
        st = next(j for j in json.loads(listed.stdout) if j["id"] == job["id"])
        assert st["state"] == "paused", st
        logs = _cli(env, "job", "logs", job["id"])
        assert "interrupted" in logs.stdout and "continues from step-" in logs.stdout, logs.stdout[-2000:]

        resumed = _cli(env, "job", "resume", "interrupted-run", "--json")
        assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
        final = json.loads(resumed.stdout.strip().splitlines()[-1])
        assert final["state"] == "completed", final
        assert final["result"]["steps"] == steps
        events = JobStore(db).events(job["id"])
        starts = [e["message"] for e in events if e["kind"] == "state" and "resumed from step-" in e["message"]]
        assert starts, [e["message"] for e in events]
        resumed_at = int(starts[-1].split("step-")[1].split()[0].rstrip(")"))
        assert resumed_at >= 20, starts  # not step 0: the checkpoint before the kill
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
