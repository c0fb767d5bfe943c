"""A `distill_task` job's `args` are checked at submit against its stage call's own keyword arguments
(`cluster/workloads/distill/stage_args.py`), no cluster needed: a misspelt key, one the job passes
itself or a missing required one is one message naming it and the known ones, and the API answers it
with a 400 in the error shape before any job exists."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from smolforge.cluster.control import kinds
from smolforge.cluster.control.artifacts import ArtifactStore
from smolforge.cluster.control.jobstore import JobStore
from smolforge.cluster.control.manager import JobManager
from smolforge.cluster.workloads.distill.stage_args import known_args
from smolforge.errors import SmolforgeError

TEACHER = {"kind": "distill_task", "stage": "teacher", "args": {"model_path": "tiny-llama", "dataset_path": "bundled"}}
STUDENTS = {"kind": "distill_task", "stage": "students", "teacher_job": "job-0000000001",
            "args": {"base_model": "tiny-llama", "num_students": 1, "peft_config": {"r": 4}}}
AGGREGATE = {"kind": "distill_task", "stage": "aggregate", "student_tasks": ["job-0000000002-student-0"],
             "args": {"method": "mean"}}


def _with(spec: dict, **args) -> dict:
    return {**spec, "args": {**spec["args"], **args}}


def test_the_seeds_calls_as_written_pass():
    for spec in (TEACHER, _with(TEACHER, num_teachers=2, max_samples=8, task_config={"max_retries": 1}),
                 STUDENTS, _with(STUDENTS, lr=1e-3, kd_loss="reverse_kl"), AGGREGATE, _with(AGGREGATE, rank=4)):
        assert kinds.parse(spec).args == spec["args"]


BAD = [  # (name, spec, what the message says, what the fix says)
    ("a misspelt student argument", _with(STUDENTS, lerning_rate=1e-3), "args.lerning_rate is not an argument of the "
     "students stage", "kd_loss"),
    ("a close one", _with(STUDENTS, num_student=2), "(did you mean 'num_students'?)", "num_students"),
    ("a misspelt teacher argument", _with(TEACHER, temprature=0.7), "args.temprature is not an argument of the "
     "teacher stage (did you mean 'temperature'?)", "model_path, dataset_path, num_teachers"),
    ("a misspelt aggregate argument", _with(AGGREGATE, methd="ties"), "args.methd is not an argument of the aggregate "
     "stage (did you mean 'method'?)", "method, rank, density, base_model"),
    ("one the job passes itself", _with(STUDENTS, resume=True), "args.resume is not for the job to give",
     "always resumes"),
    ("where it writes", _with(TEACHER, output_dir="/tmp/x"), "args.output_dir is not for the job to give",
     "the spec's top level"),
    ("a required one missing", {**TEACHER, "args": {"model_path": "tiny-llama"}},
     "the teacher stage needs args.dataset_path", "args.dataset_path"),
]


@pytest.mark.parametrize("name,spec,needle,fix", BAD, ids=[row[0] for row in BAD])
def test_bad_args_are_one_message_at_submit_naming_the_key_and_the_known_ones(name, spec, needle, fix):
    with pytest.raises(SmolforgeError) as err:
        kinds.parse(spec)
    assert needle in err.value.what and fix in err.value.fix, (name, err.value.render())
    assert err.value.where == f"job spec (args of the {spec['stage']} stage)"


def test_the_known_ones_are_the_calls_own_less_what_the_job_passes():
    assert known_args("aggregate") == ["method", "rank", "density", "base_model"]
    assert {"lr", "kd_loss", "peft_config", "base_model"} <= set(known_args("students"))
    assert not {"output_dir", "resume", "teacher_outputs_dir", "self"} & set(known_args("students"))
    assert known_args("teacher")[:2] == ["model_path", "dataset_path"] and "output_dir" not in known_args("teacher")


def test_the_api_answers_a_misspelt_arg_with_a_400_and_queues_nothing(tmp_path):
    from fastapi.testclient import TestClient

    from smolforge.cluster.api import create_app

    mgr = JobManager(JobStore(tmp_path / "jobs.db"), ArtifactStore(tmp_path / "art"))
    core = SimpleNamespace(token="t", manager=mgr, store=mgr.store, artifacts=mgr.artifacts)
    http = TestClient(create_app(core))
    r = http.post("/api/v1/jobs", headers={"Authorization": "Bearer t"}, json=_with(STUDENTS, lerning_rate=1e-3))
    assert r.status_code == 400 and set(r.json()) == {"error", "where", "fix"}, r.text
    assert "args.lerning_rate" in r.json()["error"] and "num_students" in r.json()["fix"], r.text
    assert mgr.store.list_jobs() == []
