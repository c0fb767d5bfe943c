"""What a distillation's teacher tasks and student actors are sent (issue 42, item 2): a frozen, typed
plan, the stage's checked plan whole, not a dict of keys (`cluster/workloads/distill/task_plans.py`).
Pure: no Ray, no cluster; pickling stands in for Ray's own (driver -> task) serialization."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from smolforge.cluster.workloads.distill.plans import StudentCall, TeacherCall, plan_students, plan_teachers
from smolforge.cluster.workloads.distill.sync import GroupSeat
from smolforge.cluster.workloads.distill.task_plans import (
    ResumePoint, StudentTaskPlan, TeacherTaskPlan, group_seat, student_config, student_record, teacher_task_plan,
)
from smolforge.distill.prompts import PromptItem


def test_a_teacher_task_gets_the_stages_plan_whole_with_its_own_prompts_and_shards(tmp_path):
    stage = plan_teachers(TeacherCall("tiny-llama", "bundled", tmp_path, cpus_per_teacher=3, temperature=0.7,
                                      top_k=8, backend="hf", dtype="bf16"))
    # (a dataset row without messages is skipped, so an item's example_id may be past its place)
    items = [PromptItem(i + 3, [{"role": "user", "content": f"q{i}"}], f"a{i}") for i in range(12)]
    plan = pickle.loads(pickle.dumps(teacher_task_plan("teacher-2", "w1", stage, items, {4: (8, 12), 1: (2, 5)})))
    assert isinstance(plan, TeacherTaskPlan) and plan.teacher == stage  # whole: sampling, backend, dtype, CPUs
    assert plan.ranges() == {1: (2, 5), 4: (8, 12)} and plan.num_threads == 3
    assert sorted(plan.prompt_items()) == [2, 3, 4, 8, 9, 10, 11]  # only its shards' prompts travel
    assert plan.prompt_items()[9] == PromptItem(9, items[9].prompt_messages, "a9")  # numbered by place
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.task_id = "teacher-3"  # type: ignore[misc]


def _student_record(tmp_path, **call) -> StudentTaskPlan:
    """A student's record as `StudentTasks._add_student` writes it (config: the plan's, base, output dir)."""
    stage = plan_students(StudentCall("tiny-llama", tmp_path, **call))
    config = student_config({"base_model": "tiny-llama", "output_dir": str(tmp_path / "output" / "student_0"),
                             **stage.student_config("tiny-llama")})
    return student_record("student-0", config, "abc", ({"messages": []},), None)


def test_a_student_actor_gets_a_typed_config_that_equals_the_stages_plan(tmp_path):
    rec = _student_record(tmp_path, peft_type="ia3", kd_loss="reverse_kl", lr=1e-3, max_steps=7, save_every=3,
                          on_policy_ratio=0.5)
    plan = pickle.loads(pickle.dumps(rec.placed("w2")))
    assert isinstance(plan, StudentTaskPlan) and plan.group is None and plan.resume is None
    cfg = plan.config
    assert (cfg.peft.method, cfg.kd.loss, cfg.lr, cfg.max_steps, cfg.save_every) == ("ia3", "reverse_kl", 1e-3, 7, 3)
    assert cfg.teacher_model == "tiny-llama" and cfg.on_policy_ratio == 0.5  # the store's teacher scores on-policy
    assert plan.teacher_hash == "abc" and plan.eval_examples == ({"messages": []},)
    here = plan.config_for("/node/copy", "/tmp/out")  # on the actor's node: its copy, its own dir
    assert (here.base_model, here.output_dir, here.resume, here.peft) == ("/node/copy", "/tmp/out", False, cfg.peft)


def test_a_group_member_gets_its_seat_and_a_resumed_one_its_checkpoint(tmp_path):
    rec = dataclasses.replace(_student_record(tmp_path, students_sync="ddp"), task_id="student-1")
    rec = dataclasses.replace(rec, resume=ResumePoint("step_4", b"packed", 4), group=group_seat(
        {"sync": "ddp", "strategy": "ddp", "members": ["student-0", "student-1"], "world": 2, "shards": [0, 1, 2]},
        1, "cpu"))
    meet = {"addr": "10.0.0.5", "port": 29500, "secret": "s3"}
    plan = pickle.loads(pickle.dumps(rec.placed("w3", meet)))
    assert plan.group == GroupSeat(sync="ddp", strategy="ddp", members=("student-0", "student-1"), world=2,
                                   shards=(0, 1, 2), rank=1, device="cpu", addr="10.0.0.5", port=29500, secret="s3")
    assert plan.resume == ResumePoint("step_4", b"packed", 4) and plan.config_for("b", "o").resume is True
    assert rec.group.addr is None and rec.node_name == ""  # the driver's record is not changed by what was sent


def test_a_store_left_on_disk_regenerates_its_shards_with_its_own_teacher_and_sampling(tmp_path):
    from smolforge.cluster.workloads.distill.plans import stored_teacher_plan
    from smolforge.distill.prompts import GenSettings
    from smolforge.distill.store import StorePlan

    stored = StorePlan(num_shards=2, num_examples=8, shard_size=4, teacher="tiny-llama", dataset="bundled",
                       tokenizer_hash="", vocab_size=0, k=8, compress=False, backend="reference")
    sampling = GenSettings(temperature=0.5, top_k=8, seed=3)
    plan = stored_teacher_plan(stored, tmp_path, sampling)
    assert (plan.model, plan.dataset, plan.backend, plan.compress, plan.settings) == (
        "tiny-llama", "bundled", "reference", False, sampling)
    assert plan == dataclasses.replace(plan_teachers(TeacherCall("tiny-llama", "bundled", tmp_path, backend="reference",
                                                                 compress_outputs=False)), settings=sampling)
