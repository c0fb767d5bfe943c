"""Placement in one room (issue 42 item 4): every kind's "which node" decision is a pure function of
`cluster/control/` (`placement.py`, `stage_plan.py`), driven here by node tables built by hand: no Ray
cluster, no model, no clock."""

from __future__ import annotations

import pytest

from smolforge.cluster.control import placement, stage_plan
from smolforge.cluster.control.specs import DataParallelJob
from smolforge.cluster.nodes import ray_glue
from smolforge.errors import SmolforgeError


def _node(name: str, role: str = "worker", models: tuple[str, ...] = (), cpus: float = 2, free: float | None = None,
          gpus: float = 0, alive: bool = True) -> ray_glue.NodeInfo:
    res = {"CPU": float(cpus), "memory": 8e9, **({"GPU": float(gpus)} if gpus else {})}
    if role == "worker":
        res[ray_glue.WORKER_RESOURCE] = float(cpus)
    for m in models:
        res[ray_glue.model_resource(m)] = 1000.0
    avail = {**res, "CPU": float(cpus if free is None else free)}
    return ray_glue.NodeInfo(node_id=(name * 8)[:16].ljust(16, "x"), name=name, address="127.0.0.1", alive=alive,
                             role=role, cpus=cpus, gpus=gpus, ram_gb=8.0, gpu_type=None, models=sorted(models),
                             resources=res, available=avail,
                             labels={ray_glue.NAME_LABEL: name, ray_glue.ROLE_LABEL: role})


def _job(**over) -> DataParallelJob:
    return DataParallelJob.model_validate({"num_workers": 2, "train": {"model": "org/m", "data": {"path": "bundled"},
                                                                         "batch_size": 2}, **over})


# -- a served model's stages ------------------------------------------------------------------------

def test_stage_candidates_are_holders_then_travel_targets_workers_first_and_none_is_refused():
    table = [_node("coord", "coordinator", ("org/m",)), _node("w2", models=("org/m",)), _node("w1"),
             _node("dead", models=("org/m",), alive=False)]
    # some node holds it: it travels, so every live worker may run a stage; the coordinator's machine last
    assert [n.name for n in stage_plan.stage_candidates("org/m", table, False)] == ["w1", "w2", "coord"]
    assert [n.name for n in stage_plan.stage_candidates("org/m", table, False, {"w2"})] == ["w2"]
    with pytest.raises(SmolforgeError):  # nobody holds it: no candidate, and the refusal lists the nodes
        stage_plan.stage_candidates("org/other", table, False)
    # a preset is built anywhere: any live node with CPUs, no model resource asked for
    assert len(stage_plan.stage_candidates("tiny-llama", table, False)) == 3
    assert stage_plan.stage_model_resources("tiny-llama", table[1], False) is None
    assert stage_plan.stage_model_resources("org/m", table[1], False) == {"model:org/m": ray_glue.MODEL_REQUEST}
    assert stage_plan.stage_model_resources("org/m", table[2], False) is None  # it receives a part


def test_the_probe_reads_sizes_from_a_holder_with_room_else_adds_one_and_labels_twins_apart():
    w1, w2 = _node("w1"), _node("w2", models=("org/m",))
    probed, source, labels = stage_plan.probe_plan("org/m", [w1, w2], [w1, w2], cpus=1, embedded=False)
    assert [n.name for n in probed] == ["w1", "w2"] and source == 1 and labels == {w1.node_id: "w1", w2.node_id: "w2"}
    busy = _node("w2", models=("org/m",), free=0)  # the holder has no room: probed last, for the sizes only
    twin = _node("w1", cpus=4)
    twin.node_id = "another-node-id!"
    probed, source, labels = stage_plan.probe_plan("org/m", [w1, twin, busy], [w1, twin, busy], 1, False)
    assert [n.node_id for n in probed] == [w1.node_id, twin.node_id, busy.node_id] and source == 2
    assert labels[w1.node_id] == f"w1-{w1.node_id[:6]}" and labels[twin.node_id] == "w1-anothe"
    assert labels[busy.node_id] == "w2"


def test_a_stage_goes_where_planned_else_to_the_least_used_holder_with_room():
    w1, w2, w3 = _node("w1"), _node("w2", models=("org/m",)), _node("w3", free=0)
    cands = [w1, w2, w3]
    assert stage_plan.stage_node(cands, 1, "org/m", 1e9, {}, planned=w3.node_id) is w3  # the plan's own choice
    assert stage_plan.stage_node(cands, 1, "org/m", 1e9, {}, planned="gone") is w2  # a holder: nothing sent
    assert stage_plan.stage_node(cands, 1, "org/m", 1e9, {w2.node_id: 1}) is w1  # fewer stages of the model first
    assert stage_plan.stage_node([w3], 1, "org/m", 1e9, {}) is w3  # no room anywhere: it waits there
    assert stage_plan.with_room(cands, 1) == [w1, w2]


# -- a data-parallel round, a joiner --------------------------------------------------------------------

def test_a_round_starts_whole_or_degraded_only_when_recovering_after_the_grace():
    job = _job()
    table = [_node("coord", "coordinator"), _node("w1", models=("org/m",), cpus=1), _node("w2", models=("org/m",), cpus=1)]
    req = placement.requirements_for(job, False, table)
    plan = placement.round_plan(job, table, req, False)
    assert plan is not None and (plan.world, plan.n_coord, plan.asked, plan.full) == (2, 0, 2, True)
    assert all("model:org/m" in b for b, _ in plan.bundles)
    one = table[:2]  # w2 is gone: one rank fits
    assert placement.round_plan(job, one, req, False) is None  # a first round waits for all it asked
    assert placement.round_plan(job, one, req, False, quick=True, waited_s=1.0) is None  # within the grace
    plan = placement.round_plan(job, one, req, False, quick=True, waited_s=6.0)
    assert plan is not None and (plan.world, plan.asked, plan.full) == (1, 2, False)
    odd = _job(num_workers=3, train={"model": "org/m", "data": {"path": "bundled"}, "batch_size": 2})
    plan = placement.round_plan(odd, table, placement.requirements_for(odd, False, table), False, True, 6.0)
    assert plan is not None and plan.world == 2  # 3 asked, 2 fit, and the global batch 6 splits over 2


def test_a_joiner_needs_a_worker_s_rank_on_its_node_or_the_coordinator_s():
    job = _job()
    worker = ray_glue.Requirements(model="org/m", cpus=1.5, gpu="preferred", min_ram_gb=3)
    there = placement.joiner_requirements(job, "w9", False, worker, only_there=True)
    assert (there.allowed_nodes, there.model, there.cpus, there.gpu, there.min_ram_gb) == (["w9"], "org/m", 1.5,
                                                                                            "preferred", 0.0)
    assert placement.joiner_requirements(job, "w9", False, worker) is worker
    assert placement.joiner_requirements(job, placement.COORDINATOR, False, worker).on_coordinator
    assert placement.may_travel("org/m", None, False) and not placement.may_travel("org/m", False, False)
    assert not placement.may_travel("tiny-llama", None, False)


# -- one task's node: a trunk, a split client, an export ------------------------------------------------

def test_the_trunk_plan_prefers_room_and_a_gpu_avoids_where_it_was_lost_and_pins_nothing():
    req = ray_glue.Requirements(model="m", cpus=1, gpu="preferred")
    table = [_node("cpu1", models=("m",)), _node("gpu1", models=("m",), gpus=1), _node("gpu2", models=("x",), gpus=1)]
    plan = placement.trunk_plan(req, table, avoid=set())
    assert plan.node.name == "gpu1" and "a GPU node" in plan.why
    assert "scheduling_strategy" not in plan.options and "label_selector" not in plan.options  # the runner pins it
    plan = placement.trunk_plan(req, [table[0], _node("cpu2", models=("m",), free=0)], avoid={table[0].node_id})
    assert plan.node.name == "cpu2" and "not where the trunk was lost" in plan.why
    plan = placement.trunk_plan(req, [table[0], _node("full", models=("m",), free=0)], avoid=set())
    assert plan.node.name == "cpu1"  # room first


def test_a_split_client_and_an_export_task_find_their_node():
    client = placement.client_requirements("org/m", "w1", 2.0, False)
    assert (client.model, client.allowed_nodes, client.on_coordinator) == ("org/m", ["w1"], False)
    assert placement.client_requirements("tiny-llama", placement.COORDINATOR, 1.0, False).on_coordinator
    assert placement.client_requirements("tiny-llama", "w1", 1.0, False).model is None
    req = ray_glue.Requirements(cpus=1)
    holder, busy, idle = _node("h", models=("org/m",)), _node("b", free=1), _node("i", free=2)
    held, node = placement.travel_node(req, "org/m", [holder, busy, idle])
    assert held is not None and held.model == "org/m" and node is None  # a holder runs it: nothing sent
    assert placement.travel_node(req, "org/m", [busy, idle]) == (None, idle)  # the most free CPUs fetches it
    assert placement.travel_node(req, "org/m", []) == (None, None)


def test_a_model_is_sent_from_a_holder_outside_the_receivers_the_coordinator_first():
    coord, w1, w2 = _node("coord", "coordinator", ("org/m",)), _node("w1", models=("org/m",)), _node("w2")
    have, need = placement.lacking("org/m", [(w1.node_id, "w1"), (w2.node_id, "w2"), ("gone", "w3")], [coord, w1, w2])
    assert have == ["w1"] and need == [(w2.node_id, "w2"), ("gone", "w3")]
    assert placement.transfer_source("org/m", need, [w1, w2, coord]) is coord
    assert placement.transfer_source("org/m", [(coord.node_id, "coord")], [w1, coord]) is w1
    assert placement.transfer_source("org/m", [(w1.node_id, "w1")], [w1, w2]) is None


# -- a distillation's students ---------------------------------------------------------------------------

def test_students_go_to_the_freest_node_gpu_first_and_a_group_starts_whole_or_not_at_all():
    gpu, cpu, small = _node("g", gpus=1, cpus=2), _node("c", cpus=4), _node("s", cpus=1)
    assert placement.pick_student_node([(1.0, gpu), (4.0, cpu)], 1.0, set()) is gpu
    assert placement.pick_student_node([(1.0, gpu), (4.0, cpu)], 2.0, set()) is cpu  # it must fit
    assert placement.pick_student_node([(1.0, gpu), (4.0, cpu)], 1.0, {gpu.node_id}, hybrid=True) is cpu
    assert placement.pick_student_node([(1.0, gpu)], 1.0, {gpu.node_id}, hybrid=True) is None  # queued
    # two members of 2 CPUs on c (4) and s (1): both on c, the second counting what the first took
    assert placement.pick_group_nodes([(2.0, [cpu, small]), (2.0, [cpu, small])], {}, set()) == [cpu, cpu]
    assert placement.pick_group_nodes([(2.0, [cpu, small])] * 3, {}, set()) is None  # the third has none
    assert placement.pick_group_nodes([(2.0, [cpu])], {cpu.node_id: 3.0}, set()) is None
    shared = _node("c", cpus=4, free=1)  # another job holds 3 of its CPUs
    assert placement.busy_cpus({shared.node_id: 1.0}, [shared]) == {shared.node_id: 3.0}
    assert placement.busy_cpus({shared.node_id: 4.0}, [shared]) == {shared.node_id: 4.0}
