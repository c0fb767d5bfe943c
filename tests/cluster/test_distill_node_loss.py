"""A distillation job outlives the node its only student runs on.

The whole `worker join` process group of that node is killed (its Ray raylet and every worker
process, as when a laptop leaves the Wi-Fi). The student restarts from the checkpoint it shipped
to the coordinator on a worker that joins afterwards; when none joins within `replace_timeout_s`,
the job fails and says why, instead of waiting forever (a soak test: its decision is proven in process,
see its comment).

The student is held after step 5 (the fault `hold-step` of `smolforge.train.faults`, a file in its
node's directory) and the test waits for it to say so (`held`), so the node dies at a known step,
after the checkpoint of step 3, in a 12-step run: the replacement resumes from step 3 exactly.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from localcluster import LocalCluster

pytestmark = [pytest.mark.timeout(1200)]


STEPS, SAVE_EVERY, HOLD = 12, 3, 5  # the node dies while its student is held after step 5: checkpoint 3 kept


def _spec(data, **kw) -> dict:
    distill = {"teacher": "tiny-copy", "students": ["tiny-copy"], "data": str(data), "num_students": 1,
               "num_shards": 4, "max_new_tokens": 8, "teacher_batch_size": 8, "top_k": 8, "max_steps": STEPS,
               "batch_size": 4, "save_every": SAVE_EVERY, "peft_config": {"r": 4, "alpha": 8, "dropout": 0.0},
               "max_eval_samples": 8, "eval_max_new_tokens": 4, "device": "cpu", "aggregate": "none"}
    distill.update(kw)
    return {"kind": "distill", "name": "node-loss", "mode": "teacher_student", "distill": distill}


def _events(client, job_id, kind) -> list[dict]:
    return [e for e in client.job_events(job_id) if e["kind"] == kind]


def _wait(client, job_id, what, cond, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = client.get_job_status(job_id)
        if cond(st):
            return st
        assert st["state"] not in ("failed", "cancelled", "completed") or what == "final", (what, st)
        time.sleep(0.5)
    logs = "\n".join(client.job_logs(job_id))
    raise AssertionError(f"job {job_id}: no {what} after {timeout}s\n{logs[-4000:]}")


def _hold(cluster, node: str) -> Path:
    """Students that start on `node` hold after step HOLD (fault `hold-step`) until the file goes."""
    path = cluster.base / f"node-{node}" / "node" / "fault-hold-step"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(str(HOLD))
    return path


def _lose_the_student_node(cluster, client, job_id, node: str) -> int:
    """Wait for the student to be held after step HOLD (so its checkpoint of step SAVE_EVERY is shipped) and the
    teacher to finish; kill the node's group while the student is held; its last checkpoint's step."""
    _wait(client, job_id, "held", lambda st: _events(client, job_id, "held"))
    held = _events(client, job_id, "held")
    assert [e["data"]["step"] for e in held] == [HOLD], held
    _wait(client, job_id, "teacher_finished", lambda st: _events(client, job_id, "teacher_finished"))
    _wait(client, job_id, "student_checkpoint", lambda st: _events(client, job_id, "student_checkpoint"))
    step = _events(client, job_id, "student_checkpoint")[-1]["data"]["step"]
    placed = _events(client, job_id, "student_submitted")[-1]["data"]
    assert placed["node"] == node and held[0]["data"]["task_id"] == placed["task_id"], (placed, held)
    cluster.kill_worker(node)
    return step


def _start(cluster: LocalCluster, tmp_path: Path) -> tuple[Path, Path]:
    """A coordinator and worker s1 on `cluster`, both holding tiny-copy: (models dir, the job's data)."""
    from smolforge.data.synthetic import generate
    from smolforge.models.tiny import preset_dir

    models = tmp_path / "models"
    shutil.copytree(preset_dir("tiny-llama"), models / "tiny-copy")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate(64, seed=11)))
    cluster.start_coordinator(models_dir=models)
    cluster.add_worker("s1", cpus=2, models_dir=models)
    return models, data


def test_a_student_outlives_its_node(tmp_path):
    """The node dies; a worker that joins afterwards takes the student over from its last checkpoint."""
    with LocalCluster(tmp_path) as cluster:
        models, data = _start(cluster, tmp_path)
        client = cluster.client()
        _hold(cluster, "s1")
        job_id = client.submit_job(_spec(data))
        saved = _lose_the_student_node(cluster, client, job_id, "s1")
        _wait(client, job_id, "a queued student", lambda st: any(
            "no live node" in e["message"] for e in _events(client, job_id, "student_queued")), timeout=180)
        cluster.add_worker("s2", cpus=2, models_dir=models)
        st = _wait(client, job_id, "final", lambda st: st["state"] in ("completed", "failed"), timeout=600)
        logs = "\n".join(client.job_logs(job_id))
        assert st["state"] == "completed", logs[-4000:]
        assert _events(client, job_id, "student_submitted")[-1]["data"]["node"] == "s2"
        resumed = _events(client, job_id, "student_resumed")
        # the checkpoint before the hold, and the replacement went on from exactly there
        assert saved == SAVE_EVERY and [e["data"]["step"] for e in resumed] == [saved], (saved, resumed)
        assert st["step"] == STEPS, st


# soak: the decision (no node for replace_timeout_s: the students give up, the run fails saying why) is
# proven in process by tests/test_distill_controller.py::test_a_group_starts_whole_or_waits_and_fails_once_no_node_could_run_it
# and tests/cluster/test_distill_hybrid.py::test_a_ddp_group_no_nodes_can_hold_waits_then_fails_saying_why; a real
# node's loss queueing its student ("no live node") by test_a_student_outlives_its_node above (CI)
@pytest.mark.soak
def test_a_job_whose_student_lost_its_node_and_none_joins_fails_with_a_reason(tmp_path):
    """The node dies and none joins: the job fails within the bound, saying why."""
    with LocalCluster(tmp_path) as cluster:
        _models, data = _start(cluster, tmp_path)
        client = cluster.client()
        _hold(cluster, "s1")
        job_id = client.submit_job(_spec(data, replace_timeout_s=10))
        _lose_the_student_node(cluster, client, job_id, "s1")
        st = _wait(client, job_id, "final", lambda st: st["state"] in ("completed", "failed"), timeout=300)
        assert st["state"] == "failed", st
        assert "no node could run it for 10s" in (st["error"] or ""), st["error"]
