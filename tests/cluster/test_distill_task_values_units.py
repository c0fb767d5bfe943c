"""A `distill_task` job's `args` VALUES are checked at submit by the builders its stage runs
(`stage_args.stage_call`, then `plans.plan_teachers` / `plan_students`, or the aggregate stage's
`AggregateSettings.checked`), not when the job starts after its wait in the queue: a wrong type or a
value the stage refuses is one message naming the argument (`args.KEY`, then the builder's words), and
the API answers it with a 400 before any job exists. No cluster."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from smolforge.cluster.control import kinds
from smolforge.cluster.control.artifacts import ArtifactStore
from smolforge.cluster.control.jobstore import JobStore
from smolforge.cluster.control.manager import JobManager
from smolforge.cluster.control.specs import TaskConfig
from smolforge.cluster.workloads.distill.stage_args import typed_args
from smolforge.errors import SmolforgeError

TEACHER = {"kind": "distill_task", "stage": "teacher", "args": {"model_path": "tiny-llama", "dataset_path": "bundled"}}
STUDENTS = {"kind": "distill_task", "stage": "students", "teacher_job": "job-0000000001",
            "args": {"base_model": "tiny-llama", "num_students": 2, "peft_config": {"r": 4}}}
AGGREGATE = {"kind": "distill_task", "stage": "aggregate", "student_tasks": ["job-0000000002-student-0"],
             "args": {"method": "mean"}}


def _with(spec: dict, **args) -> dict:
    return {**spec, "args": {**spec["args"], **args}}


BAD = [  # (name, spec, what the message says, where it says it is)
    ("a wrong type", _with(TEACHER, top_k="many"), "args.top_k: Input should be a valid integer", ""),
    ("a list for a number", _with(STUDENTS, kd_ratio=[0.5]), "args.kd_ratio: Input should be a valid number", ""),
    ("sampling the teacher refuses", _with(TEACHER, top_p=2), "top_p must be in (0, 1], got 2", ""),
    ("no teachers", _with(TEACHER, num_teachers=0), "num_teachers must be ≥ 1", ""),
    ("an unknown backend", _with(TEACHER, backend="vllm"), "vllm", ""),
    ("a TaskConfig asking for RAM", _with(TEACHER, task_config={"resources": {"ram_gb": 8}}),
     "cannot honour resources.ram_gb", ", task_config"),
    ("a KD ratio out of range", _with(STUDENTS, kd_ratio=2), "kd_ratio must be in [0, 1], got 2", ""),
    ("an unknown KD loss", _with(STUDENTS, kd_loss="l2"), "unknown KD loss 'l2'", ""),
    ("an unknown sync", _with(STUDENTS, students_sync="ring"), "unknown --students-sync 'ring'", ""),
    ("two PEFT spellings", _with(STUDENTS, lora_config={"r": 4}), "lora_config is peft_type='lora'",
     ", create_student_tasks"),
    ("hybrid without a split", {**_with(STUDENTS, split_shards=False), "mode": "hybrid"},
     "hybrid mode splits the shards", ""),
    ("an unknown merge method", _with(AGGREGATE, method="linear"), "unknown aggregation method 'linear'", ""),
    ("a TIES density of 0", _with(AGGREGATE, method="ties", density=0), "TIES density must be in (0, 1], got 0", ""),
    ("a merged rank of 0", _with(AGGREGATE, rank=0), "the merged LoRA rank must be ≥ 1, got 0", ""),
    ("a density that is no number", _with(AGGREGATE, density="dense"), "args.density: Input should be a valid", ""),
]
# each row's refusal names the args it is about first (`args.KEY: ` then the builder's words)
NAMED = {"a wrong type": "top_k", "a list for a number": "kd_ratio", "sampling the teacher refuses": "top_p",
         "no teachers": "num_teachers", "an unknown backend": "backend", "a TaskConfig asking for RAM": "task_config",
         "a KD ratio out of range": "kd_ratio", "an unknown KD loss": "kd_loss", "an unknown sync": "students_sync",
         "two PEFT spellings": "peft_config, args.lora_config", "hybrid without a split": "split_shards",
         "an unknown merge method": "method", "a TIES density of 0": "density", "a merged rank of 0": "rank",
         "a density that is no number": "density"}


@pytest.mark.parametrize("name,spec,needle,where", BAD, ids=[row[0] for row in BAD])
def test_a_bad_value_is_refused_at_submit_naming_it(name, spec, needle, where):
    with pytest.raises(SmolforgeError) as err:
        kinds.parse(spec)
    assert needle in err.value.what and err.value.fix, (name, err.value.render())
    assert err.value.where.startswith(f"job spec (args of the {spec['stage']} stage)"), err.value.render()
    assert err.value.where.endswith(where or "stage)"), err.value.render()


def test_the_stage_runs_with_the_values_checked_at_submit():
    spec = kinds.parse(_with(TEACHER, top_k=8.0, task_config={"max_retries": 1}))  # JSON's 8.0 for an int
    args = typed_args("teacher", spec.args)
    assert args["top_k"] == 8 and isinstance(args["top_k"], int)
    assert args["task_config"] == TaskConfig(max_retries=1) and set(args) == set(spec.args)  # no defaults added
    assert typed_args("aggregate", {"method": "ties"}) == {"method": "ties"}


def test_the_api_answers_a_bad_value_with_a_400_and_queues_nothing(tmp_path):
    from fastapi.testclient import TestClient

    from smolforge.cluster.api import create_app

    mgr = JobManager(JobStore(tmp_path / "jobs.db"), ArtifactStore(tmp_path / "art"))
    core = SimpleNamespace(token="t", manager=mgr, store=mgr.store, artifacts=mgr.artifacts)
    http = TestClient(create_app(core))
    r = http.post("/api/v1/jobs", headers={"Authorization": "Bearer t"}, json=_with(STUDENTS, kd_ratio=2))
    # the refused key's path too (`field`): a client that read the spec from a file names its line (config.placed)
    assert r.status_code == 400 and set(r.json()) == {"error", "where", "fix", "field"}, r.text
    assert r.json()["field"] == ["args", "kd_ratio"] and "kd_ratio" in r.json()["error"] and "args of the students stage" in r.json()["where"], r.text
    assert mgr.store.list_jobs() == []


@pytest.mark.parametrize("name,spec", [row[:2] for row in BAD], ids=[row[0] for row in BAD])
def test_every_refused_value_is_named_as_its_args_key(name, spec):
    with pytest.raises(SmolforgeError) as err:
        kinds.parse(spec)
    assert err.value.what.startswith(f"args.{NAMED[name]}: "), (name, err.value.render())


def test_the_aggregate_stage_runs_with_the_values_checked_at_submit():
    """The aggregate job's runner passes the typed values (JSON's "0.5" and 4.0 as a float and an int), and
    the settings checked at submit are the merge's own keyword arguments, with their defaults (one list)."""
    import inspect
    from dataclasses import fields

    from smolforge.cluster.workloads.distill.runner import DistillTaskRunner
    from smolforge.distill.aggregate import AggregateSettings, aggregate_student_outputs

    spec = kinds.parse(_with(AGGREGATE, method="ties", density="0.5", rank=4.0))
    seen: dict = {}
    runner = SimpleNamespace(
        spec=spec, out=Path("/run"), job_id="job-3", _sync=lambda: None, _student_dir=lambda t: f"/students/{t}",
        ctx=SimpleNamespace(embedded=False, artifacts=SimpleNamespace(put_dir=lambda *a: None)),
        _session=SimpleNamespace(aggregate_student_outputs=lambda dirs, target, **kw: seen.update(kw) or {
            "output": "/run/merged_model/final_adapter"}))
    DistillTaskRunner._aggregate_stage(runner)  # type: ignore[arg-type]
    assert seen == {"method": "ties", "density": 0.5, "rank": 4} and type(seen["rank"]) is int, seen
    params = inspect.signature(aggregate_student_outputs).parameters
    assert {f.name: f.default for f in fields(AggregateSettings)} == {
        name: p.default for name, p in params.items() if name not in ("student_output_dirs", "output_path")}


def test_the_api_answers_a_bad_aggregate_value_with_a_400_and_queues_nothing(tmp_path):
    from fastapi.testclient import TestClient

    from smolforge.cluster.api import create_app

    mgr = JobManager(JobStore(tmp_path / "jobs.db"), ArtifactStore(tmp_path / "art"))
    http = TestClient(create_app(SimpleNamespace(token="t", manager=mgr, store=mgr.store, artifacts=mgr.artifacts)))
    r = http.post("/api/v1/jobs", headers={"Authorization": "Bearer t"}, json=_with(AGGREGATE, density=0))
    assert r.status_code == 400 and r.json()["error"].startswith("args.density: TIES density"), r.text
    assert "args of the aggregate stage" in r.json()["where"] and mgr.store.list_jobs() == [], r.text


def test_a_tokenizer_refusal_names_the_args_it_is_about(monkeypatch):
    """On-policy steps over two vocabularies (`check_shared_tokenizer`, which reads the tokenizers' files:
    stood in here) are refused naming the two args whose models disagree."""
    from smolforge.cluster.workloads.distill import stage_args

    def differ(teacher, students, needs, **_):
        raise SmolforgeError(f"the teacher {teacher} and the student {students[0]} have different tokenizers",
                             fix="pick one vocabulary")

    monkeypatch.setattr(stage_args, "check_shared_tokenizer", differ)
    with pytest.raises(SmolforgeError) as err:
        kinds.parse(_with(STUDENTS, teacher_model="twin:gpt2", on_policy_ratio=0.5))
    assert err.value.what.startswith("args.teacher_model, args.base_model: the teacher twin:gpt2"), err.value.render()
    assert err.value.where == "job spec (args of the students stage)", err.value.render()
