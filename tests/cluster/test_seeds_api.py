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

from localcluster import ROOT, cli_module

pytestmark = [pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def run(module_cluster, tmp_path_factory):
    """The script run once against the session's shared cluster (coordinator + w1, w2; tests/conftest.py):
    (exit code, its timed output, its working dir, the cluster, the ids of the jobs it submitted, and
    `smolforge jobs --json` as another process saw it once the script had made its teacher task)."""
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
    listed = None
    limit = threading.Timer(600, proc.kill)  # nothing hangs: a stuck script is killed, and the test fails
    limit.start()
    try:
        for line in proc.stdout:  # timed, so a slow phase shows in the failure output
            lines.append(f"{time.time() - t0:6.1f}s {line.rstrip()}")
            if "Teacher task created: " in line and listed is None:
                listed = cluster.cli("jobs", "--json").stdout  # from another process, while the script runs
        proc.wait(timeout=60)
    finally:
        limit.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=15)
    mine = {j["id"] for j in cluster.client().list_jobs()} - before
    return proc.returncode, "\n".join(lines), work, cluster, mine, listed


def test_the_seed_script_runs_as_written(run):
    returncode, out, work, _, mine, listed = run
    assert returncode == 0 and "[✓] SEEDS API OK" in out, out[-6000:]
    # its tasks are coordinator jobs: the teacher's was listed by `smolforge jobs` while the script ran
    teacher = re.search(r"Teacher task created: (\S+)", out).group(1)
    job_id = teacher.rsplit("-teacher-", 1)[0]
    assert job_id in mine and job_id in {j["id"] for j in json.loads(listed or "[]")}, (teacher, listed)
    kinds = sorted(j["spec"]["stage"] for j in json.loads(listed) if j["id"] in mine)
    assert kinds == ["teacher"], listed
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
    returncode, out, _, cluster, mine, _ = run
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



def _script(args: list[str], work, cluster) -> subprocess.Popen:
    env = {**cluster.env, "SMOLFORGE_HOME": str(cluster.state), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-u", str(ROOT / "examples" / "seeds_tasks_as_jobs.py"), *args], cwd=work,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _read_until(proc: subprocess.Popen, marker: str, timeout: float = 300) -> tuple[str | None, list[str]]:
    """The first line holding `marker` (None if the script ended first), and every line read; a hang guard kills it."""
    lines: list[str] = []
    limit = threading.Timer(timeout, proc.kill)
    limit.start()
    try:
        for line in proc.stdout:
            lines.append(line.rstrip())
            if marker in line:
                return line.rstrip(), lines
    finally:
        limit.cancel()
    return None, lines


def test_the_seeds_tasks_are_jobs_that_outlive_their_script(module_cluster, tmp_path):
    """The seeds' teacher task and the guide's out-of-memory student call (`create_student_tasks(base_model=…,
    num_students=1, peft_type="lora", peft_config={"r": 4})`, no teacher_outputs_dir) run as written: each is a
    coordinator job that `smolforge jobs` lists from another process while the script runs; SIGKILLing the
    script stops neither; a second script's `monitor_tasks` follows them by id, with its callback, to completion."""
    from smolforge.data.synthetic import generate

    cluster = module_cluster.c
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate(8, seed=3)))
    work = tmp_path / "work"
    work.mkdir()
    proc = _script(["--teacher", "tiny-llama", "--student", "tiny-llama", "--data", str(data), "--max-samples", "8"],
                   work, cluster)
    try:
        line, lines = _read_until(proc, "[✓] TASKS ")
        assert line is not None, "\n".join(lines[-40:])
        teacher, student = line.split("[✓] TASKS ", 1)[1].split()
        story = "\n".join(lines)
        assert "using the outputs of this orchestrator's last teacher task" in story, story  # it says so
        listed = cluster.cli("jobs", "--json")  # another process, while the script runs
        jobs = {j["id"]: j for j in json.loads(listed.stdout)}
        teacher_job, student_job = teacher.rsplit("-teacher-", 1)[0], student.rsplit("-student-", 1)[0]
        assert {teacher_job, student_job} <= set(jobs), listed.stdout[-3000:]
        assert jobs[student_job]["kind"] == "distill_task" and jobs[student_job]["spec"]["teacher_job"] == teacher_job
        assert jobs[student_job]["spec"]["args"]["peft_config"] == {"r": 4}
    finally:
        proc.kill()  # SIGKILL: no exit hook runs
        proc.wait(timeout=30)
    client = cluster.client()
    assert client.get_job_status(student_job)["state"] not in ("failed", "cancelled", "paused")
    follow = _script(["--follow", teacher, student], work, cluster)
    line, lines = _read_until(follow, "[✓] FINAL ")
    follow.wait(timeout=60)
    assert line is not None and follow.returncode == 0, "\n".join(lines[-40:])
    assert json.loads(line.split("FINAL ", 1)[1]) == {teacher: "completed", student: "completed"}, "\n".join(lines)
    assert f"[i] {student}: completed (100%)" in lines, lines  # the callback, on the task's last change
    job = client.get_job(student_job)
    assert job["result"]["students"][0]["task_id"] == "student-0", job["result"]
    assert any(t["id"] == student and t["state"] == "completed" for t in job["tasks"]), job["tasks"]
    # the follower is not the script that made them: the outputs stay on the coordinator
    assert [a["name"] for a in client.list_artifacts(student_job) if a["kind"] == "student"] == ["student_0"]


@pytest.mark.soak
def test_the_seeds_tasks_survive_a_coordinator_restart(module_cluster, tmp_path):
    """The coordinator is SIGKILLed while the seeds' students job runs (its script already gone) and
    started again: the job resumes (`reattached`) and a follower's `monitor_tasks`, which rides out the
    restart, sees both tasks complete."""
    from smolforge.data.synthetic import generate

    cluster = module_cluster.c
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate(8, seed=4)))
    work = tmp_path / "work"
    work.mkdir()
    proc = _script(["--teacher", "tiny-llama", "--student", "tiny-llama", "--data", str(data), "--max-samples", "8"],
                   work, cluster)
    try:
        line, lines = _read_until(proc, "[✓] TASKS ")
        assert line is not None, "\n".join(lines[-40:])
        teacher, student = line.split("[✓] TASKS ", 1)[1].split()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    student_job = student.rsplit("-student-", 1)[0]
    client = cluster.client()
    deadline = time.time() + 300  # a hang guard
    while client.get_job_status(student_job)["state"] == "pending" and time.time() < deadline:
        time.sleep(0.3)
    assert client.get_job_status(student_job)["state"] == "running"  # it waits for its teacher, or trains
    follow = _script(["--follow", teacher, student], work, cluster)
    first, lines = _read_until(follow, f"[i] {student}: ")  # it follows them (through the coordinator)
    assert first is not None, "\n".join(lines[-40:])
    cluster.kill_coordinator()
    cluster.start_coordinator(models_dir=module_cluster.models)
    line, lines = _read_until(follow, "[✓] FINAL ", timeout=600)
    follow.wait(timeout=60)
    assert line is not None and follow.returncode == 0, "\n".join(lines[-40:])
    assert json.loads(line.split("FINAL ", 1)[1]) == {teacher: "completed", student: "completed"}, "\n".join(lines)
    kinds = [e["kind"] for e in cluster.client().job_events(student_job)]
    assert "reattached" in kinds, kinds


@pytest.mark.soak
def test_the_seeds_tasks_run_as_jobs_of_the_embedded_cluster_without_a_coordinator(tmp_path):
    """No coordinator: the script's tasks are jobs of the embedded cluster (in its own process, as every
    command's), written straight into the paths the calls named, and `smolforge jobs` lists them after."""
    import os
    import shutil
    import tempfile

    from smolforge.data.synthetic import generate

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate(8, seed=6)))
    work = tmp_path / "work"
    work.mkdir()
    ray_tmp = tempfile.mkdtemp(prefix="sfs", dir="/tmp")
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0",
           "SMOLFORGE_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    for k in ("SMOLFORGE_COORDINATOR", "SMOLFORGE_TOKEN", "SMOLFORGE_RAY_ADDRESS", "RAY_ADDRESS",
              "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(k, None)
    try:
        proc = subprocess.run([sys.executable, "-u", str(ROOT / "examples" / "seeds_tasks_as_jobs.py"), "--teacher",
                               "tiny-llama", "--student", "tiny-llama", "--data", str(data), "--max-samples", "8"],
                              cwd=work, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0 and "[✓] done" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
        listed = subprocess.run([sys.executable, "-m", cli_module(), "jobs", "--json"], env=env,
                                capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    jobs = json.loads(listed.stdout)
    assert sorted((j["spec"]["stage"], j["state"]) for j in jobs) == [("students", "completed"), ("teacher", "completed")]
    written = sorted(p.relative_to(work).as_posix() for p in work.rglob("*") if p.is_file())
    assert any(p.startswith("teacher_outputs/batch_") for p in written), ("the store is not where the call named", written)
    assert (work / "output" / "student_0" / "lora_adapter").is_dir(), written
