"""The seeds' distillation calls as jobs, decided without a cluster: what each call submits (a
`distill_task` job of one stage), how a task id is read back from another process, and what a bad call
says. The real cluster run is tests/cluster/test_seeds_api.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from smolforge import ResourceConfig, TaskConfig
from smolforge.cluster.control import kinds
from smolforge.cluster.workloads.distill.runner import split_task_id
from smolforge.errors import SmolforgeError
from smolforge.cluster.control.jobview import job_task_status as _job_task_status
from smolforge.orchestrator import Orchestrator


class FakeCoordinator:
    """The Client surface the orchestrator uses, recording the specs it submits (they are parsed as the
    coordinator parses them)."""

    runs_in_process = False

    def __init__(self):
        self.specs: dict[str, dict] = {}

    def submit_job(self, spec: dict) -> str:
        kinds.parse(spec)
        job_id = f"job-{len(self.specs):010x}"
        self.specs[job_id] = spec
        return job_id

    def get_job_status(self, job_id: str) -> dict:
        return {"job_id": job_id, "state": "completed", "progress": 1.0, "nodes": [], "error": None,
                "result": {"output": "x"}, "tasks": []}

    def wait_for_job(self, job_id: str, **kw) -> dict:
        return self.get_job_status(job_id)

    def download_artifact(self, job_id, kind, name, dest, overwrite=False):
        self.downloaded = (job_id, kind, name, Path(dest), overwrite)
        return Path(dest)


@pytest.fixture
def orch():
    return Orchestrator("teacher_student", backend=FakeCoordinator())


def test_the_guides_out_of_memory_call_runs_as_written_on_the_last_teacher(orch, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    teacher = orch.create_teacher_task(model_path="tiny-llama", dataset_path="bundled", output_dir="./teacher_outputs",
                                       batch_size=8, max_samples=8)
    students = orch.create_student_tasks(base_model="tiny-llama", num_students=1, peft_type="lora",
                                         peft_config={"r": 4})
    teacher_job, student_job = (split_task_id(teacher)[0], split_task_id(students[0])[0])
    assert (split_task_id(teacher)[1], students) == ("teacher-0", [f"{student_job}-student-0"])
    spec = orch.backend.specs[student_job]
    assert (spec["kind"], spec["stage"], spec["teacher_job"], spec.get("first_student", 0)) == (
        "distill_task", "students", teacher_job, 0)
    assert spec["args"] == {"base_model": "tiny-llama", "num_students": 1, "peft_type": "lora", "peft_config": {"r": 4}}
    assert orch.backend.specs[teacher_job]["args"]["max_samples"] == 8 and "output_dir" not in orch.backend.specs[teacher_job]
    said = [e for e in orch.events if e["kind"] == "students_use_last_teacher"]
    assert said and said[0]["data"]["job_id"] == teacher_job
    assert f"last teacher task (job {teacher_job}" in capsys.readouterr().err
    # students of later calls number on (the seeds' output/student_N), and a local store maps to its job
    more = orch.create_student_tasks("tiny-llama", "./teacher_outputs", num_students=2)
    assert [split_task_id(t)[1] for t in more] == ["student-1", "student-2"]
    assert orch.backend.specs[split_task_id(more[0])[0]]["teacher_job"] == teacher_job


def test_a_bad_seed_call_fails_at_the_call_saying_why(orch, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SmolforgeError, match="no teacher_outputs_dir given and this orchestrator has created no teacher"):
        orch.create_student_tasks(base_model="tiny-llama", num_students=1)
    with pytest.raises(TypeError, match="num_techers"):
        orch.create_parallel_teacher_tasks("tiny-llama", "bundled", "./t", num_techers=2)
    heavy = TaskConfig(priority="high", resources=ResourceConfig(gpu_memory_gb=24, cpu_cores=8, ram_gb=64))
    with pytest.raises(SmolforgeError, match="a teacher task cannot honour resources.ram_gb"):
        orch.create_teacher_task("tiny-llama", "bundled", "./teacher_outputs", task_config=heavy)
    with pytest.raises(SmolforgeError, match="was not written by a teacher task of this orchestrator"):
        orch.create_student_tasks("tiny-llama", tmp_path / "elsewhere" / "teacher_outputs")
    with pytest.raises(SmolforgeError, match="is not a student of this orchestrator"):
        orch.aggregate_student_outputs(["./output/student_9"], "./merged_model")
    assert orch.backend.specs == {}  # nothing was submitted
    with pytest.raises(SmolforgeError, match="a students stage reads one teacher store"):
        kinds.parse({"kind": "distill_task", "stage": "students", "args": {"base_model": "tiny-llama"}})


def test_aggregate_takes_this_orchestrators_student_dirs_and_fetches_the_merge(orch, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    orch.create_teacher_task("tiny-llama", "bundled", "./teacher_outputs")
    students = orch.create_student_tasks("tiny-llama", "./teacher_outputs", num_students=2)
    report = orch.aggregate_student_outputs(["./output/student_0", students[1]], "./merged_model")
    job_id = report["job_id"]
    assert orch.backend.specs[job_id]["student_tasks"] == students
    assert orch.backend.downloaded == (job_id, "adapter", "final_adapter", tmp_path / "merged_model" / "final_adapter", True)


@pytest.mark.parametrize("job_state,row_state,want", [
    ("pending", None, "pending"),        # queued: the job has not started its tasks
    ("running", None, "pending"),        # started, this task not yet
    ("running", "queued", "pending"),    # waiting for a node inside the job
    ("running", "running", "running"),
    ("running", "completed", "completed"),
    ("running", "failed", "failed"),     # its own end, before the job's
    ("failed", "running", "failed"),     # the job ended it
    ("cancelled", None, "cancelled"),
    ("paused", "running", "paused"),
    ("completed", "running", "completed"),  # a row left over from an earlier attempt
])
def test_a_task_reads_its_state_from_its_job_and_its_row(job_state, row_state, want):
    tasks = [] if row_state is None else [{"id": "job-0-student-1", "kind": "student", "state": row_state,
                                            "node_name": "w1", "error": None}]
    st = _job_task_status({"state": job_state, "progress": 0.5, "nodes": ["w1"], "error": None, "tasks": tasks},
                          "job-0-student-1")
    assert (st["state"], st["job_state"]) == (want, job_state)
    assert st["progress"] == (1.0 if want == "completed" else 0.5)


def test_task_ids_name_their_job():
    assert split_task_id("job-1a2b3c4d5e-teacher-12") == ("job-1a2b3c4d5e", "teacher-12")
    assert split_task_id("job-1a2b3c4d5e") is None and split_task_id("student-1") is None


def test_wait_distill_follows_this_orchestrators_jobs_and_names_a_failed_task(orch, tmp_path, monkeypatch):
    """The demo's wait on the job path (`Orchestrator.wait_distill`): it follows the tasks' jobs as
    `monitor_tasks` does (fetching a completed teacher's store to the path the call named) and returns
    their statuses; a task whose job failed is one SmolforgeError naming it and the job's error."""
    monkeypatch.chdir(tmp_path)
    [teacher] = orch.create_parallel_teacher_tasks("tiny-llama", "bundled", "./run", num_teachers=1)
    done = orch.wait_distill([teacher], timeout=5)
    assert done[teacher]["state"] == "completed"
    assert orch.backend.downloaded == (split_task_id(teacher)[0], "store", "teacher_outputs",
                                       (tmp_path / "run" / "teacher_outputs").resolve(), False)
    students = orch.create_student_tasks("tiny-llama", "./run/teacher_outputs", num_students=1)
    failed = {"state": "failed", "progress": 0.0, "nodes": [], "error": "out of memory", "tasks": []}
    monkeypatch.setattr(orch.backend, "get_job_status", lambda job_id: {"job_id": job_id, **failed})
    with pytest.raises(SmolforgeError, match=f"{students[0]} failed: out of memory"):
        orch.wait_distill(students, timeout=5)
