"""What one teacher or student task is sent, typed (issue 42, item 2): the stage's plan travels whole.

A teacher task gets a `TeacherTaskPlan` (the stage's `TeacherPlan` whole, plus its prompts and shard
ranges); a student actor gets a `StudentTaskPlan` (its `StudentConfig`, built on the driver from the
stage's `StudentPlan`, its group seat, its resume point). Both are frozen and pickle through Ray on
our own driver -> task path (as a data-parallel rank's `RankPlan` does), never from a network peer.
The tasks read fields, not dict keys: a setting misspelt on one side is an AttributeError at once,
not a default quietly taken. A student's plan is also the driver's own record of it (`DistillTask.plan`,
`student_record`): what it is sent is that record placed (`StudentTaskPlan.placed`). No Ray here
(`StudentConfig`'s module brings torch, which every module that starts these tasks holds already).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from smolforge.cluster.workloads.distill.plans import TeacherPlan
from smolforge.cluster.workloads.distill.sync import GroupSeat
from smolforge.config import PeftSpec
from smolforge.distill.kdconfig import KDConfig
from smolforge.distill.prompts import PromptItem
from smolforge.distill.student import StudentConfig


@dataclass(frozen=True)
class TeacherTaskPlan:
    """One teacher task: the stage's plan whole, its prompts and its shards.

    `items`: the prompts of its shards, numbered by their place in the stage's prompt list; `shards`: (shard id, first prompt index,
    end index), end exclusive; `node_name`: the node it was placed on (its log lines' label)."""

    task_id: str
    node_name: str
    teacher: TeacherPlan
    items: tuple[PromptItem, ...]
    shards: tuple[tuple[int, int, int], ...]

    @property
    def num_threads(self) -> int:
        """Torch's (and a llamacpp teacher's) threads: the task's CPUs, at least 1."""
        return max(1, int(self.teacher.cpus))

    def prompt_items(self) -> dict[int, PromptItem]:
        """The prompts by dataset index, as `produce_shards` takes them."""
        return {it.example_id: it for it in self.items}

    def ranges(self) -> dict[int, tuple[int, int]]:
        """Shard id -> (first prompt index, end index), as `produce_shards` takes them."""
        return {sid: (a, b) for sid, a, b in self.shards}


def teacher_task_plan(task_id: str, node_name: str, teacher: TeacherPlan, items: list[PromptItem],
                      ranges: dict[int, tuple[int, int]]) -> TeacherTaskPlan:
    """The plan of a teacher on `ranges` (shard id -> prompt range of `items`, the stage's prompts)."""
    shards = tuple((int(sid), int(a), int(b)) for sid, (a, b) in sorted(ranges.items()))
    # numbered by their place in the stage's prompts, which the shard ranges count (as the store's rows do)
    return TeacherTaskPlan(task_id=task_id, node_name=node_name, teacher=teacher, shards=shards,
                           items=tuple(replace(items[i], example_id=i) for _sid, a, b in shards for i in range(a, b)))


@dataclass(frozen=True)
class ResumePoint:
    """A kept checkpoint a student continues from: its directory name, its packed files, its step."""

    name: str
    payload: bytes
    step: int


@dataclass(frozen=True)
class StudentTaskPlan:
    """One student actor's run: its `config` (base and output dir as the driver knows them: the actor
    uses its node's copy of the base and a temporary output dir), the store's tokenizer hash, the eval
    examples (chat records), its resume point and its group seat (None: trains alone).

    It is also the driver's own record of the student (`DistillTask.plan`): there `node_name` is "" and
    the seat has no meeting point until a placement (`placed`); a restart replaces its resume point."""

    task_id: str
    node_name: str
    config: StudentConfig
    teacher_hash: str | None
    eval_examples: tuple[dict[str, Any], ...] | None
    resume: ResumePoint | None
    group: GroupSeat | None

    def config_for(self, base_model: str, output_dir: str) -> StudentConfig:
        """The config as it runs on the actor's node: its copy of the base, its own output dir."""
        return replace(self.config, base_model=base_model, output_dir=output_dir, resume=self.resume is not None)

    def placed(self, node_name: str, meet: dict[str, Any] | None = None) -> StudentTaskPlan:
        """The plan a student placed on `node_name` is sent; for a group member, with where its group meets
        (`meet`: rank 0's addr, port and the group's secret, `DataParallelSync.rendezvous`). The record
        it is made from is not changed (frozen)."""
        group = self.group
        if group is not None and meet:
            port = meet.get("port", group.port)
            group = replace(group, addr=meet.get("addr", group.addr), port=None if port is None else int(port),
                            secret=meet.get("secret", group.secret))
        return replace(self, node_name=node_name, group=group)


def student_config(fields: dict[str, Any]) -> StudentConfig:
    """A StudentConfig from the students stage's shared config (`StudentPlan.student_config`, the PEFT and
    KD settings as their dumps) plus a student's base and output dir."""
    return StudentConfig(**{**fields, "peft": PeftSpec(**fields["peft"]), "kd": KDConfig(**fields["kd"])})


def student_record(task_id: str, config: StudentConfig, teacher_hash: str | None,
                   eval_examples: tuple[dict[str, Any], ...] | None, resume: ResumePoint | None) -> StudentTaskPlan:
    """The driver's record of a new student (`DistillTask.plan`): not placed (no node), in no group yet
    (`group_seat`: set when its group forms)."""
    return StudentTaskPlan(task_id=task_id, node_name="", config=config, teacher_hash=teacher_hash,
                           eval_examples=eval_examples, resume=resume, group=None)


def group_seat(group: dict[str, Any], rank: int, device: str) -> GroupSeat:
    """Member `rank`'s seat in the group `group` (`DataParallelSync.group_spec`: sync, strategy, members,
    world, shards) on `device`; where it meets is told at each placement (`StudentTaskPlan.placed`)."""
    return GroupSeat(sync=group["sync"], strategy=group["strategy"], members=tuple(group["members"]),
                     world=int(group["world"]), shards=tuple(group["shards"]), rank=rank, device=device)
