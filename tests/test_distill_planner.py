"""Pipeline planning without a cluster: shards, teacher/student assignment, node choice."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from smolforge.distill.planner import (model_nodes, pick_student_node, plan_shards, student_assignment,
                                      teacher_assignment)
from smolforge.errors import SmolforgeError


@dataclass
class Node:
    name: str
    models: list[str] = field(default_factory=list)
    gpus: float = 0
    cpus: float = 2
    alive: bool = True
    takes_work: bool = True
    role: str = "worker"

    @property
    def node_id(self):
        return "id-" + self.name

    @property
    def resources(self):
        return {f"model:{m}": 1000 for m in self.models}


def test_shards_cover_every_prompt_once():
    plan = plan_shards(103, num_shards=4)
    assert plan.shards[0][0] == 0 and plan.shards[-1][1] == 103
    assert all(a[1] == b[0] for a, b in zip(plan.shards, plan.shards[1:]))
    assert plan_shards(10, shard_size=64, min_shards=4).num_shards == 4  # keep every teacher busy
    assert plan_shards(3, num_shards=10).num_shards == 3


def test_assignments():
    assert teacher_assignment(7, 3) == [[0, 3, 6], [1, 4], [2, 5]]  # first round of shards lands first
    split = student_assignment(8, 3)
    assert sorted(s for part in split for s in part) == list(range(8))
    assert student_assignment(4, 2, split=False) == [[0, 1, 2, 3]] * 2
    with pytest.raises(SmolforgeError, match="without sharing"):
        student_assignment(2, 3)


def test_model_nodes_prefer_gpus_and_fail_fast():
    nodes = [Node("cpu-a", ["Qwen/Qwen2.5-7B-Instruct", "qwen2.5:7b"]), Node("gpu", ["qwen2.5:7b"], gpus=1),
             Node("bare"), Node("dead", ["qwen2.5:7b"], alive=False), Node("head", ["qwen2.5:7b"], takes_work=False)]
    chosen, req = model_nodes(nodes, "qwen2.5:7b")
    assert [n.name for n in chosen] == ["gpu", "cpu-a"] and req == "qwen2.5:7b"
    chosen, _ = model_nodes(nodes, "qwen2.5:7B:latest")
    assert [n.name for n in chosen] == ["gpu", "cpu-a"]
    with pytest.raises(SmolforgeError, match="no node holds teacher model 'llama3.1:8b'") as err:
        model_nodes(nodes, "llama3.1:8b")
    assert "bare: no models" in err.value.render() and "--models-dir" in err.value.render()
    chosen, req = model_nodes(nodes, "tiny-llama", any_node_ok=True)  # a preset: any worker can build it
    assert {n.name for n in chosen} == {"cpu-a", "gpu", "bare"} and req is None


def test_a_teacher_lent_the_coordinator_goes_there_and_only_there():
    """--teacher-on-coordinator: the head node (which takes no work otherwise) is the only candidate."""
    nodes = [Node("gpu", ["qwen2.5:7b"], gpus=1), Node("head", ["qwen2.5:7b"], takes_work=False, role="coordinator")]
    chosen, _ = model_nodes(nodes, "qwen2.5:7b", on_coordinator=True)
    assert [n.name for n in chosen] == ["head"]
    chosen, _ = model_nodes([Node("one", role="embedded")], "tiny-llama", any_node_ok=True, on_coordinator=True)
    assert [n.name for n in chosen] == ["one"]  # the one-machine cluster's own node
    with pytest.raises(SmolforgeError, match="the coordinator node does not hold teacher model 'llama3.1:8b'") as err:
        model_nodes(nodes, "llama3.1:8b", on_coordinator=True)
    assert "--teacher-on-coordinator" in err.value.render()


def test_a_ddp_student_group_reads_every_shard_in_one_order(tmp_path):
    """Each rank of a group takes its slice of one stream, so every rank must see the shards in the same
    order: the in-order source waits for shard 0 even when shard 1 is ready first, and a resumed rank's
    replayed shards are not handed out again."""
    from smolforge.cluster.workloads.distill.sync import AverageSync, make_sync
    from smolforge.distill.shard_source import InOrderShardSource

    class Ready:  # hands out whichever shard is ready: 1 before 0
        def __init__(self):
            self.asked = []

        def next_shard(self):
            raise AssertionError("an in-order source never asks for 'whatever is ready'")

        def get_shard(self, sid):
            self.asked.append(sid)
            return sid

        def expected_rows(self):
            return 24

    src = Ready()
    ordered = InOrderShardSource(src, [0, 1, 2])
    assert ordered.get_shard(1) == 1  # a resume replays its recorded order first
    assert [ordered.next_shard(), ordered.next_shard(), ordered.next_shard()] == [0, 2, None]
    assert src.asked == [1, 0, 2] and ordered.expected_rows() == 24
    ddp = make_sync("ddp")
    assert ddp.shards(3, 2, split=True) == [[0, 1, 2], [0, 1, 2]]  # not a split: each rank slices every step
    assert ddp.group_spec(["student-0", "student-1"], [0, 1, 2])["world"] == 2
    assert ddp.group_spec(["student-0"], [0, 1, 2]) is None  # one student: nothing to synchronise
    assert isinstance(make_sync("average"), AverageSync) and make_sync("average").shards(4, 2, True) == [[0, 2], [1, 3]]


def test_student_node_choice_by_mode():
    gpu, cpu, busy = Node("gpu-box", gpus=1), Node("cpu-box", cpus=4), Node("busy")
    free = [(1.0, gpu), (3.0, cpu), (0.0, busy)]
    teachers = {gpu.node_id}
    # teacher_student: the GPU node's spare CPU takes the student, next to its teacher
    assert pick_student_node(free, 1.0, teachers) is gpu
    assert pick_student_node(free, 2.0, teachers) is cpu  # it must fit
    # hybrid: never beside a running teacher
    assert pick_student_node(free, 1.0, teachers, hybrid=True) is cpu
    assert pick_student_node(free, 1.0, {gpu.node_id, cpu.node_id}, hybrid=True) is None  # queued
    assert pick_student_node(free, 8.0, set()) is None


def test_a_resumed_students_eta_counts_only_this_runs_steps():
    """Half the steps came from the checkpoint: the rate is what this run did (10 steps in 10 s),
    so 40 steps left take 40 s, not the 6.7 s that counting the resumed 50 steps would give."""
    import time

    from smolforge.cluster.workloads.distill.state import DistillTask

    task = DistillTask(task_id="student-0", kind="student", store="s", state="running", max_steps=100,
                       progress=0.6, started=time.time() - 10, resumed_step=50)
    assert abs(task.status()["eta_s"] - 40) < 0.5
    fresh = DistillTask(task_id="student-1", kind="student", store="s", state="running", max_steps=100,
                        progress=0.6, started=time.time() - 10)
    assert abs(fresh.status()["eta_s"] - 10 * 0.4 / 0.6) < 0.5
