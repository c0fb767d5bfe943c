"""The queue's rules without Ray: order, who starts, who waits and why, resource requests on specs."""

from __future__ import annotations

import pytest

from smolforge.cluster.control import kinds

from smolforge.cluster.nodes import ray_glue
from smolforge.cluster.control.queue import Demand, Waiting, decide, order
from smolforge.cluster.control.specs import DataParallelJob, from_seed_task
from smolforge.errors import SmolforgeError


def node(name, cpus=1, ram=4.0, used=None, models=(), gpus=0):
    res = {"CPU": float(cpus), ray_glue.WORKER_RESOURCE: float(cpus), "memory": ram * 1e9}
    if gpus:
        res["GPU"] = float(gpus)
    for m in models:
        res[ray_glue.model_resource(m)] = 1000.0
    avail = dict(res)
    for k, v in (used or {}).items():
        avail[k] -= v
    return ray_glue.NodeInfo(node_id=name * 4, name=name, address="127.0.0.1", alive=True, role="worker", cpus=cpus,
                             gpus=gpus, ram_gb=ram, gpu_type=None, models=sorted(models), resources=res,
                             available=avail, labels={ray_glue.NAME_LABEL: name})


BUSY = {"CPU": 1.0, ray_glue.WORKER_RESOURCE: 1.0}


def w(job_id, tasks=1, priority="normal", created=0.0, **req):
    return Waiting(job_id, priority, created, Demand(tasks, ray_glue.Requirements(**req)))


def test_order_is_priority_then_first_submitted():
    jobs_ = [w("n1", created=1), w("l1", priority="low", created=0), w("h2", priority="high", created=5),
             w("n0", created=0.5), w("h1", priority="high", created=3)]
    assert [x.job_id for x in order(jobs_)] == ["h1", "h2", "n0", "n1", "l1"]


def test_busy_nodes_make_a_job_wait_with_a_reason_naming_them():
    nodes = [node("w1", used=BUSY), node("w2", used=BUSY)]
    d = decide([w("job-c", tasks=2)], nodes, {}, {"w1": ["job-a"], "w2": ["job-b"]})
    assert d.start == []
    assert d.reasons["job-c"] == "waiting for 2 workers with 1 CPU: w1 busy with job-a, w2 busy with job-b"


def test_jobs_that_fit_side_by_side_start_together_and_claim_disjoint_slots():
    nodes = [node("w1"), node("w2")]
    d = decide([w("a"), w("b"), w("c")], nodes, {}, {})
    assert d.start == ["a", "b"]
    assert set(d.claims["a"]) != set(d.claims["b"])  # one node each
    assert "taken by a" in d.reasons["c"] and "taken by b" in d.reasons["c"]
    # the claims of admitted jobs count until they are placed: the next pass starts nothing more
    again = decide([w("c")], nodes, d.claims, {})
    assert again.start == [] and "(starting)" in again.reasons["c"]


def test_a_high_priority_job_overtakes_and_holds_what_it_can_use():
    """No backfill onto what a waiting job ahead can use: the normal 1-worker job submitted before a
    2-worker high job does not take the one free node (the high job holds it until w2 frees up);
    a node neither can use (it lacks their model) is open to a low job behind them."""
    nodes = [node("w1", models=("m",)), node("w2", used=BUSY, models=("m",)), node("other")]
    queue_ = [w("normal-1", created=1, model="m"), w("high-2", tasks=2, priority="high", created=2, model="m"),
              w("low-3", priority="low", created=3)]
    d = decide(queue_, nodes, {}, {"w2": ["job-x"]})
    assert d.start == ["low-3"]  # on 'other'
    assert d.reasons["high-2"] == "waiting for 2 workers with 1 CPU: w2 busy with job-x"
    assert d.reasons["normal-1"] == "waiting for 1 worker with 1 CPU: w1 held for high-2 (ahead in the queue), " \
                                    "w2 busy with job-x"
    # w2 frees up: the high job starts first, the normal one waits for the next free node
    free = [node("w1", models=("m",)), node("w2", models=("m",))]
    d = decide(queue_[:2], free, {}, {})
    assert d.start == ["high-2"] and "normal-1" in d.reasons


def test_ram_reservation_keeps_two_jobs_off_one_node():
    nodes = [node("big", cpus=4, ram=4.0)]
    d = decide([w("a", reserve_ram_gb=3), w("b", reserve_ram_gb=3)], nodes, {}, {})
    assert d.start == ["a"] and "b" in d.reasons
    # once a runs, Ray's table shows its memory taken: b still waits, and says for what
    running = [node("big", cpus=4, ram=4.0, used={"CPU": 1, ray_glue.WORKER_RESOURCE: 1, "memory": 3e9})]
    d = decide([w("b", reserve_ram_gb=3)], running, {}, {})
    assert d.reasons["b"] == "waiting for 1 worker with 1 CPU, 3 GB RAM: big has 1 GB RAM free"
    assert decide([w("b", reserve_ram_gb=1)], running, {}, {}).start == ["b"]


def test_the_seeds_task_shape_and_resource_requests():
    seed = DataParallelJob.model_validate({"model": "tiny-llama", "dataset": "bundled", "priority": "high",
                                           "resources": {"gpu_ids": [0, 1], "cpu_cores": 16, "ram_gb": 32},
                                           "max_retries": 5, "checkpointing": True})
    assert seed.train.model == "tiny-llama" and seed.train.data.path == "bundled" and seed.priority == "high"
    assert (seed.cpus_per_worker, seed.min_ram_gb, seed.gpu, seed.gpu_ids) == (16, 32, "required", [0, 1])
    assert seed.max_retries == 5 and seed.train.save_every == 50  # specs.default_save_every, as `launch`
    req = kinds.KINDS["data_parallel"].demand(seed, False).req
    assert (req.cpus, req.reserve_ram_gb, req.gpus, req.gpu) == (16, 32, 2.0, "required")
    assert req.per_task(True) == {"CPU": 16, ray_glue.WORKER_RESOURCE: 16, "memory": 32e9, "GPU": 2.0}
    gpu_node = node("g", cpus=32, ram=64, gpus=1)
    assert "has 1 GPUs < 2" in "; ".join(req.reasons(gpu_node))
    assert from_seed_task({"kind": "serve", "model": "m"}) == {"kind": "serve", "model": "m"}  # not a task
    # stored and read back by the runner: the same job (no contradiction with its own mapping)
    assert DataParallelJob.model_validate(seed.model_dump(mode="json")) == seed
    steps = DataParallelJob.model_validate({"checkpointing": True, "train": {"model": "m", "data": {"path": "bundled"},
                                                                             "max_steps": 40}})
    assert steps.train.save_every == 10  # a tenth of 40, at least 10
    off = DataParallelJob.model_validate({"checkpointing": False, "train": {"model": "m", "data": {"path": "bundled"}}})
    assert off.train.save_every == 0


@pytest.mark.parametrize("spec, match", [
    ({"cpus_per_worker": 2, "resources": {"cpu_cores": 4}}, "resources.cpu_cores is 4 but cpus_per_worker is 2"),
    ({"gpu": "no", "resources": {"gpu_ids": [0]}}, "gpu is 'no' but the job asks for GPU ids"),
    ({"checkpointing": False, "train": {"save_every": 5}}, "checkpointing is false but train.save_every is 5"),
    ({"priority": "urgent"}, "priority"),
    ({"resources": {"gpu_ids": [1, 1]}}, "distinct GPU indices"),
])
def test_contradictions_are_one_message(spec, match):
    base = {"kind": "data_parallel", "train": {"model": "m", "data": {"path": "bundled"}, **spec.pop("train", {})}}
    with pytest.raises(SmolforgeError, match=match):
        kinds.parse({**base, **spec})


def test_kinds_take_only_what_they_can_honour():
    with pytest.raises(SmolforgeError, match="a serve job cannot reserve it; it takes cpu_cores"):
        kinds.parse({"kind": "serve", "model": "m", "resources": {"ram_gb": 2}})
    serve = kinds.parse({"kind": "serve", "model": "m", "stages": 3, "resources": {"cpu_cores": 2}, "priority": "low"})
    assert serve.cpus_per_stage == 2 and kinds.KINDS["serve"].demand(serve, False).describe() == "3 stages with 2 CPUs"
    distill = kinds.parse({"kind": "distill", "checkpointing": False, "resources": {"cpu_cores": 2},
                          "distill": {"teacher": "tiny-llama", "students": ["tiny-llama"], "data": "bundled"}})
    assert (distill.distill.cpus_per_teacher, distill.distill.cpus_per_student, distill.distill.save_every) == (2, 2, 0)


def test_no_node_could_ever_hold_it_fails_at_submit_listing_nodes(tmp_path):
    from smolforge.cluster.control.artifacts import ArtifactStore
    from smolforge.cluster.control.jobstore import JobStore
    from smolforge.cluster.control.manager import JobManager

    mgr = JobManager(JobStore(tmp_path / "j.db"), ArtifactStore(tmp_path / "a"))
    job = kinds.parse({"model": "tiny-llama", "dataset": "bundled", "num_workers": 1, "resources": {"ram_gb": 6}})
    with pytest.raises(SmolforgeError) as err:
        mgr.check_capacity(job, [node("w1"), node("w2")])
    text = err.value.render()
    assert "can reserve 4.0 GB RAM < 6 GB" in text and "  - w1 [worker]" in text and "  - w2 [worker]" in text


def test_the_store_keeps_the_reason_while_pending_only(tmp_path):
    from smolforge.cluster.control.jobstore import JobStore

    store = JobStore(tmp_path / "j.db")
    job_id = store.create_job("data_parallel", {"priority": "high"})
    assert store.get_job(job_id)["pending_reason"] == "queued"
    store.update_job(job_id, pending_reason="waiting for 1 worker with 1 CPU: w1 busy with job-x")
    assert "w1 busy" in store.get_job(job_id)["pending_reason"]
    store.set_state(job_id, "running")
    store.upsert_task("t0", job_id, "dp_rank", "running", node_name="w1")
    assert store.get_job(job_id)["pending_reason"] is None and store.busy_nodes() == {"w1": [job_id]}
    store.set_state(job_id, "paused")
    assert store.busy_nodes() == {}
    store.set_state(job_id, "pending")
    assert store.get_job(job_id)["pending_reason"] == "queued"


def test_the_queue_ticks_only_while_a_job_waits(tmp_path, monkeypatch):
    """The queue's thread waits on its wake event without a timeout while no job waits (issue 42: no
    TICK_S tick through a running distillation), and every TICK_S while one does; a schedule on another
    thread that leaves a job waiting wakes it at once."""
    import threading

    from smolforge.cluster.control import manager as manager_mod
    from smolforge.cluster.control.artifacts import ArtifactStore
    from smolforge.cluster.control.jobstore import JobStore
    from smolforge.cluster.control.manager import JobManager

    mgr = JobManager(JobStore(tmp_path / "j.db"), ArtifactStore(tmp_path / "a"))
    nodes = [node("w1", used=BUSY)]
    monkeypatch.setattr(mgr, "healthy_nodes", lambda: nodes)
    monkeypatch.setattr(mgr, "_ensure_ticker", lambda: None)  # the test drives the queue's loop itself
    started: list[str] = []
    monkeypatch.setattr(mgr, "_start", lambda job_id, reason: started.append(job_id)
                        or mgr.store.set_state(job_id, "running"))
    job = kinds.parse({"model": "tiny-llama", "dataset": "bundled", "num_workers": 1})
    job_id = mgr.store.create_job(job.kind, job.model_dump(mode="json"))
    mgr.specs[job_id] = job
    assert mgr.schedule() == [] and mgr._wake.is_set()  # w1 is busy: the job waits, the ticker is told
    waits: list[float | None] = []

    class Wake(threading.Event):
        def wait(self, timeout=None):
            waits.append(timeout)
            if len(waits) == 1:
                nodes[:] = [node("w1")]  # w1 is free by the next look
            else:
                mgr.closed = True
            return True

    mgr._wake = Wake()
    mgr._tick()
    assert started == [job_id] and waits == [manager_mod.TICK_S, None]


def test_a_students_stage_asks_for_its_largest_group_so_two_ddp_stages_do_not_share_two_cpus():
    """A ddp students stage's group of 2 starts whole or not at all: the stage asks the queue for both its
    students' CPUs (`kinds._distill_task_demand`, its plan's groups), so on a 2-CPU node the second such
    stage waits for the first instead of being started into the same CPUs (the demo's race, stop 54);
    independent students ask for one, at their CPUs per student (a TaskConfig's cpu_cores too)."""
    from smolforge.cluster.control.specs import DistillTaskJob

    def stage(**args):
        return DistillTaskJob(stage="students", teacher_job="job-t", args={"base_model": "tiny-llama", **args})

    def ask(job):
        demand = kinds.KINDS["distill_task"].demand(job, True)
        return demand.tasks, demand.req.cpus

    kd, sft = stage(num_students=2, students_sync="ddp"), stage(num_students=2, students_sync="ddp")
    assert ask(kd) == (2, 1.0)
    assert ask(stage(num_students=3, students_sync="average", cpus_per_student=2)) == (1, 2.0)
    assert ask(stage(base_model=["tiny-llama", "tiny-llama"], num_students=3, students_sync="ddp",
                     task_config={"resources": {"cpu_cores": 2}})) == (3, 2.0)  # per base: one group of 3
    assert kinds.KINDS["distill_task"].demand(DistillTaskJob(stage="aggregate", student_tasks=["j-student-0"]), True) is None
    waiting = [Waiting(j, "normal", t, kinds.KINDS["distill_task"].demand(s, True)) for j, t, s in
               (("job-kd", 0.0, kd), ("job-sft", 1.0, sft))]
    d = decide(waiting, [node("w1", cpus=2)], {}, {})
    assert d.start == ["job-kd"] and "job-sft" in d.reasons
    assert d.reasons["job-sft"] == "waiting for 2 tasks with 1 CPU: w1 taken by job-kd (starting)"


def test_why_a_job_waited_stays_in_its_events_each_reason_once(tmp_path, monkeypatch):
    """The queue's reason is the job's `pending_reason` while it waits, and a `queued` event the first time it
    gives it (a reason that comes back, as two alternate tick by tick, is not said again): its log keeps
    why it waited once it runs (`smolforge job logs`)."""
    from smolforge.cluster.control.artifacts import ArtifactStore
    from smolforge.cluster.control.jobstore import JobStore
    from smolforge.cluster.control.manager import JobManager

    mgr = JobManager(JobStore(tmp_path / "j.db"), ArtifactStore(tmp_path / "a"))
    nodes = [node("w1", used=BUSY)]
    monkeypatch.setattr(mgr, "healthy_nodes", lambda: nodes)
    monkeypatch.setattr(mgr, "_ensure_ticker", lambda: None)
    monkeypatch.setattr(mgr, "_start", lambda job_id, reason: mgr.store.set_state(job_id, "running"))
    job = kinds.parse({"model": "tiny-llama", "dataset": "bundled", "num_workers": 1})
    job_id = mgr.store.create_job(job.kind, job.model_dump(mode="json"))
    mgr.specs[job_id] = job
    busy = {"w1": ["job-x"]}
    monkeypatch.setattr(mgr.store, "busy_nodes", lambda: busy)
    for who in ("job-x", "job-y", "job-x", "job-y"):  # two reasons, alternating
        busy["w1"] = [who]
        assert mgr.schedule() == []
    said = [e["message"] for e in mgr.store.events(job_id) if e["kind"] == "queued"]
    assert said == ["waiting for 1 worker with 1 CPU: w1 busy with job-x", "waiting for 1 worker with 1 CPU: w1 busy with job-y"]
    nodes[:] = [node("w1")]
    assert mgr.schedule() == [job_id] and mgr.reasons_said == {}
