"""The seeds' Python API as their users call it: examples/seeds_api.py (the seed guides' calls, only the
import lines changed) runs against a real local cluster (a coordinator and two workers, each its own
process) from the coordinator's machine: `create_distributed_training(...)` and `Client()` find the
coordinator and its token through $SMOLFORGE_HOME, never through argv."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import pytest

from localcluster import ROOT

pytestmark = [pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def run(module_cluster, tmp_path_factory):
    """The script run once against the session's shared cluster (coordinator + w1, w2; tests/conftest.py):
    (exit code, its timed output, its working dir, the cluster, the ids of the jobs it submitted)."""
    from smolforge.data.synthetic import generate

    base = tmp_path_factory.mktemp("seeds")
    data = base / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate(16, seed=5)))
    work = base / "work"
    work.mkdir()
    cluster = module_cluster.c
    before = {j["id"] for j in cluster.client().list_jobs()}  # other modules' jobs on the shared cluster
    env = {**cluster.env, "SMOLFORGE_HOME": str(cluster.state), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-u", str(ROOT / "examples" / "seeds_api.py"), "--teacher", "tiny-llama",
            "--student", "tiny-llama", "--data", str(data), "--max-samples", "16"]
    assert cluster.token not in " ".join(args)
    t0 = time.time()
    proc = subprocess.Popen(args, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    limit = threading.Timer(600, proc.kill)  # nothing hangs: a stuck script is killed, and the test fails
    limit.start()
    try:
        for line in proc.stdout:  # timed, so a slow phase shows in the failure output
            lines.append(f"{time.time() - t0:6.1f}s {line.rstrip()}")
        proc.wait(timeout=60)
    finally:
        limit.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=15)
    mine = {j["id"] for j in cluster.client().list_jobs()} - before
    return proc.returncode, "\n".join(lines), work, cluster, mine


def test_the_seed_script_runs_as_written(run):
    returncode, out, work, _, _ = run
    assert returncode == 0 and "[✓] SEEDS API OK" in out, out[-6000:]
    # discover_nodes: the seeds' nested resources beside the flat keys
    assert "w1: 1.0 CPUs, 4.0GB RAM, 0 GPUs; Ollama models: none (flat: [])" in out
    assert "No GPU nodes detected" in out
    # the output layout the seeds show
    assert sorted(p.name for p in (work / "teacher_outputs").glob("batch_*.json")) == ["batch_0.json", "batch_1.json"]
    for n, method in enumerate(["lora", "lora", "lora", "prefix", "prompt", "adapter", "ia3"]):
        assert (work / "output" / f"student_{n}" / f"{method}_adapter").is_dir(), (n, method, out[-3000:])
    assert (work / "merged_model" / "final_adapter" / "adapter_config.json").exists()
    assert len(list((work / "parallel" / "teacher_outputs").glob("batch_*.json"))) >= 2
    # the guide's heavy TaskConfig on a teacher: refused, saying what and where it does apply
    assert "refused: a teacher task cannot honour resources.ram_gb, resources.gpu_memory_gb, priority 'high'" in out
    # Client(): the seeds' resource request no node here has is refused at submit, naming the nodes
    assert "no node here could ever run that request" in out
    for line in ("paused: paused", "cancelled: cancelled"):
        assert f"[i] {line}\n" in out + "\n", out[-3000:]
    # resume_job queues the paused job again: it answers pending (queued) or running (already dequeued)
    resumed = re.search(r"\[i\] resumed: (\w+)", out)
    assert resumed and resumed.group(1) in ("pending", "running"), out[-3000:]


def test_the_seed_clients_job_was_joined_paused_resumed_and_cancelled(run):
    """What the script's SOLLOL calls did to its one job, as the coordinator recorded it: `join_job`
    lent the coordinator to it (kept in the job across the pause, so the resumed job places it),
    `pause_job` paused it, `resume_job` queued it from its pause, `cancel_job` ended it."""
    returncode, out, _, cluster, mine = run
    assert returncode == 0, out[-3000:]
    client = cluster.client()
    (job,) = [j for j in client.list_jobs() if j["kind"] == "data_parallel" and j["id"] in mine]
    assert f"[i] {job['id']}: running" in out, out[-3000:]  # jobs[0], the job joined, is the one submitted
    events = client.job_events(job["id"])
    story = "\n".join(f"{e['kind']}: {e['message']}" for e in events)
    assert job["state"] == "cancelled" and job["spec"]["lent_nodes"] == ["@coordinator"], (job, story)
    assert any(e["kind"] == "join_requested" and e["data"]["node"] == "@coordinator" for e in events), story
    states = [(e["data"]["from"], e["data"]["to"]) for e in events if e["kind"] == "state"]
    paused = states.index(("running", "paused"))
    assert states[paused + 1] == ("paused", "pending") and states[-1][1] == "cancelled", story

