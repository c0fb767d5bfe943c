"""A SIGKILLed embedded `launch` leaves nothing running and loses nothing: the next command reaps the
Ray processes it started (by PID and session: Ray's agents used to live on for minutes, re-parented
to init), `job show` lists its ranks as stopped, not running, and `job resume` finishes the job into
the launch's --output-dir, where the launch itself would have put the adapter, continuing from the
checkpoint kept before the kill (not from step 0). The model is named by a local directory, as
users' own checkpoints are. The launch is held after step HOLD (fault `hold-step`, in its environment
only: the resume does not hold), so the kill lands at a known step, after the checkpoint of step
SAVE_EVERY, in a run of STEPS: no run made "long enough" to still be going when the test acts.
(tests/cluster/test_embedded_recovery.py, a second instance of the same path with the whole process
group killed, runs in the soak tier.)"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from localcluster import cli_module

pytestmark = [pytest.mark.timeout(900)]

STEPS, SAVE_EVERY, HOLD = 12, 4, 5  # killed while held after step 5: the checkpoint of step 4 is kept


def _env(home, ray_tmp: str) -> dict:
    env = {**os.environ, "SMOLFORGE_HOME": str(home), "RAY_TMPDIR": ray_tmp, "RAY_USAGE_STATS_ENABLED": "0"}
    for k in ("SMOLFORGE_COORDINATOR", "SMOLFORGE_TOKEN", "SMOLFORGE_RAY_ADDRESS", "RAY_ADDRESS", "RAY_AUTH_TOKEN",
              "RAY_AUTH_TOKEN_PATH", "SMOLFORGE_KEEP_HOME"):
        env.pop(k, None)
    return env


def _running(procs: list[psutil.Process]) -> list[str]:
    """Those still alive (a zombie is dead: only its exit status waits for init)."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {p.name()}")
        except psutil.Error:
            continue
    return out


def _wait_for_hold(db, proc: subprocess.Popen, log) -> dict:
    """The launch's job once its rank is held after step HOLD and the checkpoint of step SAVE_EVERY is stored."""
    from smolforge.cluster.control.jobstore import JobStore

    deadline = time.time() + 400  # a hang guard only: the launch reaches it in well under a minute alone
    while time.time() < deadline and proc.poll() is None:
        jobs = JobStore(db).list_jobs() if db.exists() else []
        kinds = {e["kind"] for e in JobStore(db).events(jobs[0]["id"])} if jobs else set()
        if {"held", "checkpoint"} <= kinds and jobs[0]["step"] == HOLD:
            return jobs[0]
        time.sleep(0.2)
    raise AssertionError(f"the launch was never held after step {HOLD}: {log.read_text()[-3000:]}")


def test_a_killed_launch_is_reaped_shown_stopped_and_resumed_into_its_output_dir(tmp_path):
    from smolforge.cluster.control.jobstore import JobStore
    from smolforge.data.synthetic import generate
    from smolforge.models.tiny import preset_dir

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate(48, seed=3)))
    shutil.copytree(preset_dir("tiny-llama"), tmp_path / "my-model")  # a local directory: this machine holds it
    home, out = tmp_path / "home", tmp_path / "run-out"
    ray_tmp = tempfile.mkdtemp(prefix="sfk", dir="/tmp")  # short: Ray's socket paths have a length limit
    env = _env(home, ray_tmp)
    log = tmp_path / "launch.log"
    session: list[psutil.Process] = []
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", cli_module(), "launch", "--model", "./my-model", "--dataset", str(data),
             "--workers", "1", "--batch-size", "1", "--max-steps", str(STEPS), "--max-length", "32",
             "--save-every", str(SAVE_EVERY), "--set", "eval_accuracy=false", "--set", "data.max_eval_samples=2",
             "--output-dir", str(out), "--quiet"],
            cwd=tmp_path, env={**env, "SMOLFORGE_FAULT_HOLD_STEP": str(HOLD)}, stdout=subprocess.DEVNULL,
            stderr=open(log, "w"), start_new_session=True)
        job = _wait_for_hold(home / "embedded" / "jobs.db", proc, log)
        session = psutil.Process(proc.pid).children(recursive=True)  # every process the launch started
        assert session, "the launch started no process"
        os.kill(proc.pid, signal.SIGKILL)  # the CLI alone, not its process group: what `kill -9 PID` does
        proc.wait(timeout=60)

        shown = subprocess.run([sys.executable, "-m", cli_module(), "job", "show", job["id"], "--json"],
                               capture_output=True, text=True, timeout=300, env=env)
        assert shown.returncode == 0, shown.stderr[-3000:]
        assert _running(session) == [], "the next command left the killed launch's Ray processes running"
        st = json.loads(shown.stdout)
        assert st["state"] == "paused", st["state"]
        ranks = [t for t in st["tasks"] if t["kind"] == "dp_rank"]
        assert ranks and {t["state"] for t in ranks} == {"stopped"}, [(t["id"], t["state"]) for t in st["tasks"]]
        logs = subprocess.run([sys.executable, "-m", cli_module(), "job", "logs", job["id"]],
                              capture_output=True, text=True, timeout=300, env=env)
        assert "interrupted" in logs.stdout and "continues from step-" in logs.stdout, logs.stdout[-2000:]

        resumed = subprocess.run([sys.executable, "-m", cli_module(), "job", "resume", job["id"], "--json"],
                                 capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
        assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
        final = json.loads(resumed.stdout.strip().splitlines()[-1])
        assert final["state"] == "completed" and final["result"]["steps"] == STEPS, final
        assert final["adapter_dir"] == str(out / "lora_adapter"), final["adapter_dir"]
        assert (out / "lora_adapter" / "adapter_model.safetensors").is_file()
        events = JobStore(home / "embedded" / "jobs.db").events(job["id"])
        starts = [e["message"] for e in events if e["kind"] == "state" and "resumed from step-" in e["message"]]
        assert starts, [e["message"] for e in events]
        assert int(starts[-1].split("step-")[1].split()[0].rstrip(")")) == SAVE_EVERY, starts  # the checkpoint, not step 0
    finally:
        for p in session:  # a failed run must not leave what it started behind (by PID, as the reaper does)
            try:
                p.kill()
            except psutil.Error:
                pass
        shutil.rmtree(ray_tmp, ignore_errors=True)
