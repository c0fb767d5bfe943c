"""Distillation on a real multi-node Ray cluster on one machine.

The test starts a Ray head and three worker nodes as separate `ray start --block` processes (our
own children, stopped by PID, never `ray stop`), each with distinct resources and labels:
    gpu-box   2 CPUs, 1 GPU (declared), holds teacher-llama
    cpu-box   2 CPUs, holds teacher-llama
    bare      2 CPUs, holds no model
No GPU exists here: the GPU is a declared Ray resource, which is what placement reads. Each worker has
its own SMOLFORGE_NODE_DIR (`node_dir`), where a test writes fault files (`smolforge.train.faults`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from localcluster import orchestrators_on

pytestmark = [pytest.mark.timeout(900)]

TEACHER = "teacher-llama"


def node_dir(base: Path, name: str) -> Path:
    """Worker `name`'s scratch directory, where a test writes its fault files (`train.faults.fault_setting`)."""
    return base / f"node-{name}"


def _spawn_nodes(base: Path, models: Path, procs: list):
    """Head, then each worker in turn (waiting until it registers; a node that fails to start on an
    overloaded machine is started again once). Returns (driver handle, short Ray temp dir)."""
    from smolforge.cluster.nodes import ray_glue
    from smolforge.auth import write_token
    from smolforge.cluster.nodes.ray_process import head_command, spawn, start_head, stop, worker_command
    from smolforge.cluster.nodes.statedir import free_port

    tmp = Path(tempfile.mkdtemp(prefix="sfd", dir="/tmp"))  # short: Ray socket paths
    token_path = base / "token"
    write_token(token_path, os.urandom(16).hex())
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path), "RAY_TMPDIR": str(tmp),
           "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "RAY_raylet_start_wait_time_s": "120"}
    env.pop("RAY_ADDRESS", None)
    port = free_port()
    # a head that exits during start-up (Ray's fixed 30 s registration, missed on a loaded machine) starts again
    head = lambda: head_command(port, cpus=1, node_ip="127.0.0.1", name="head",  # noqa: E731 - a fresh command per attempt
                                resources={ray_glue.HEAD_RESOURCE: 1000}, temp_dir=str(tmp), object_store_mb=100,
                                labels={ray_glue.NAME_LABEL: "head", ray_glue.ROLE_LABEL: "coordinator"})
    procs.append(start_head(head, "127.0.0.1", port, env, base / "head.log", timeout=120, die_with_parent=True))
    handle = ray_glue.connect(f"127.0.0.1:{port}", state_dir=base / "driver", token=token_path.read_text())
    paths = json.dumps({TEACHER: str(models / TEACHER)})
    for name, gpus, holds in (("gpu-box", 1, True), ("cpu-box", 0, True), ("bare", 0, False)):
        res = {ray_glue.WORKER_RESOURCE: 2.0}
        if holds:
            res[ray_glue.model_resource(TEACHER)] = ray_glue.MODEL_AMOUNT
        cmd = worker_command(f"127.0.0.1:{port}", cpus=2, gpus=gpus, node_ip="127.0.0.1", name=name, resources=res,
                             labels={ray_glue.NAME_LABEL: name, ray_glue.ROLE_LABEL: "worker",
                                     ray_glue.GPUS_LABEL: str(gpus)}, temp_dir=str(tmp), object_store_mb=100)
        for attempt in range(2):
            proc = spawn(cmd, {**env, "SMOLFORGE_MODEL_PATHS": paths if holds else "{}",
                               "SMOLFORGE_NODE_DIR": str(node_dir(base, name))},
                         base / f"{name}-{attempt}.log", die_with_parent=True)
            procs.append(proc)
            deadline = time.time() + 150
            while time.time() < deadline and proc.poll() is None:
                if any(n.name == name for n in handle.nodes()):
                    break
                time.sleep(0.5)
            if any(n.name == name for n in handle.nodes()):
                break
            stop(proc)
        else:
            raise AssertionError(f"node {name} did not join; see {base}/{name}-*.log")
    return handle, tmp


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from smolforge.data.synthetic import generate
    from smolforge.models.tiny import preset_dir

    base = tmp_path_factory.mktemp("distill-cluster")
    models = base / "models"
    shutil.copytree(preset_dir("tiny-llama"), models / TEACHER)
    data = base / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate(560, seed=11)))
    with orchestrators_on(lambda ps: _spawn_nodes(base, models, ps), "teacher_student") as (handle, make):
        yield SimpleNamespace(make=make, data=data, base=base, handle=handle)


GEN = dict(max_new_tokens=8, top_k=8, batch_size=8)


def test_teacher_shards_land_only_on_nodes_holding_the_model(cluster):
    from smolforge.distill.store import read_manifest, ready_shards
    from smolforge.errors import SmolforgeError

    orch = cluster.make()
    out = cluster.base / "placement"
    ids = orch.create_parallel_teacher_tasks(TEACHER, str(cluster.data), out, max_samples=32, num_shards=4, **GEN)
    assert len(ids) == 2  # num_teachers=None: one per eligible node
    # one teacher only: the GPU node is preferred (asked for at once: the node is chosen, not waited for)
    [one] = orch.create_parallel_teacher_tasks(TEACHER, str(cluster.data), cluster.base / "one", max_samples=8,
                                               num_shards=2, num_teachers=1, **GEN)
    orch.wait_distill([*ids, one], timeout=300)
    store = out / "teacher_outputs"
    nodes = {read_manifest(store, s)["node"] for s in ready_shards(store)}
    assert ready_shards(store) == [0, 1, 2, 3]
    assert nodes == {"gpu-box", "cpu-box"}
    assert {read_manifest(cluster.base / "one" / "teacher_outputs", s)["node"] for s in (0, 1)} == {"gpu-box"}
    assert orch.task_status(one)["node"] == "gpu-box"
    # nobody holds the model: a clear error at submit (the call raises; no task was made) naming what
    # each node has
    before = len(orch.distill_session()._dstate().tasks)
    with pytest.raises(SmolforgeError, match="no node holds teacher model 'qwen2.5:7b'") as err:
        orch.create_parallel_teacher_tasks("qwen2.5:7b", str(cluster.data), cluster.base / "none", **GEN)
    assert len(orch.distill_session()._dstate().tasks) == before
    assert "gpu-box" in err.value.render() and "worker join --models-dir" in err.value.render()
    orch.shutdown_distill()


def test_students_stream_rotate_and_aggregate(cluster):
    """Timeline: a student starts before the last shard is written; a queued student takes a
    finished teacher's node; outputs follow the seed layout; monitor_tasks reports both kinds.
    The order is made by holds (faults `hold-shard`, `hold-step`) released on the run's events, not
    by teachers made slow enough: each teacher holds after its 2nd shard until a student has started
    training, and the student on `bare` holds after step 15 of its 20 until it has said so and a
    teacher's node has taken a queued student."""
    orch = cluster.make()
    run = cluster.base / "run"
    # 24 shards of 10 prompts: 8 shards (80 rows, 20 steps of 4) for each of the 3 students.
    shard_holds = [node_dir(cluster.base, n) / "fault-hold-shard" for n in ("gpu-box", "cpu-box")]
    for f in shard_holds:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("2")
    # 2 CPUs per student: one fits on `bare` at once, the others wait; a finished teacher's node takes one.
    # The student on `bare` is held after step 15 of its 20 (one epoch; fault `hold-step`) until a
    # teacher's node has taken a queued student, so it is still busy when a teacher finishes: without
    # the hold, a student done first would let `bare` take the queued ones (no rotation, seen in CI).
    hold = node_dir(cluster.base, "bare") / "fault-hold-step"
    hold.parent.mkdir(parents=True, exist_ok=True)
    hold.write_text("15")
    seen: dict[str, set] = {}

    def watch(tid: str, status: dict) -> None:
        seen.setdefault(tid, set()).add(status["state"])
        kinds = {e["kind"] for e in orch.events}
        if "student_started" in kinds:  # a student trains: the teachers may write their last shards now
            for f in shard_holds:
                f.unlink(missing_ok=True)
        if {"teacher_reassigned", "held"} <= kinds:
            hold.unlink(missing_ok=True)

    try:
        teachers = orch.create_parallel_teacher_tasks(TEACHER, str(cluster.data), run, num_shards=24, max_samples=240,
                                                      **GEN)
        students = orch.create_student_tasks("tiny-llama", run / "teacher_outputs", num_students=3,
                                             peft_type="lora", peft_config={"r": 4, "alpha": 8, "dropout": 0.0},
                                             epochs=1, batch_size=4, cpus_per_student=2, eval_data=str(cluster.data),
                                             max_eval_samples=8, max_new_tokens=4)
        orch.monitor_tasks(teachers + students, callback=watch, poll=0.3, timeout=600)
    finally:
        for f in (hold, *shard_holds):
            f.unlink(missing_ok=True)
    for tid in teachers + students:
        assert orch.task_status(tid)["state"] == "completed", orch.task_status(tid)
        assert "completed" in seen[tid]
    ev = orch.events
    started = [e for e in ev if e["kind"] == "student_started"]
    written = [e for e in ev if e["kind"] == "shard_written"]
    assert len(written) == 24 and len(started) == 3
    t0 = ev[0]["ts"]
    timeline = "\n".join(f"{e['ts'] - t0:6.2f} {e['kind']}: {e['message']}" for e in ev)
    assert min(e["ts"] for e in started) < max(e["ts"] for e in written), timeline
    assert any(e["kind"] == "student_queued" for e in ev)
    held = [(e["data"]["node_id"], e["data"]["step"]) for e in ev if e["kind"] == "held"]
    bare = next(n.node_id for n in cluster.handle.nodes() if n.name == "bare")
    assert held == [(bare, 15)], timeline  # only `bare` held, once: its student, at step 15
    rot = [e for e in ev if e["kind"] == "teacher_reassigned"]
    assert rot and rot[0]["data"]["node"] in ("gpu-box", "cpu-box"), "\n".join(e["kind"] + ": " + e["message"] for e in ev)
    # hybrid split: no shard trained by two students
    trained = {e["data"]["task_id"]: set(e["data"]["shards"]) for e in ev
               if e["kind"] == "student_finished" and "shards" in e["data"]}
    assigned = {t: set(orch.task_status(t)["shards"]) for t in students}
    assert sum(map(len, assigned.values())) == 24 and set().union(*assigned.values()) == set(range(24))
    assert sorted(trained) == sorted(students)
    assert sum(map(len, trained.values())) == len(set().union(*trained.values()))
    assert all(trained[t] <= assigned[t] for t in students)
    for i in range(3):
        assert (run / "output" / f"student_{i}" / "lora_adapter" / "adapter_model.safetensors").exists()
        summary = json.loads((run / "output" / f"student_{i}" / "summary.json").read_text())
        assert summary["mode"] == "logit" and "eval_loss" in summary["eval"]
    report = orch.aggregate_student_outputs(students, run / "merged_model")
    assert Path(report["output"]) == run / "merged_model" / "final_adapter"
    assert (run / "merged_model" / "final_adapter" / "adapter_config.json").exists()
    assert orch.task_status(report["task_id"])["state"] == "completed"
    orch.shutdown_distill()


def test_corrupt_shards_are_caught_and_regenerated(cluster):
    """On disk (an earlier run's store) and in transit (bytes that no longer match the manifest). The
    earlier run's store is the first test's (4 shards of 8 prompts, copied: a store is its directory),
    made here (3 shards) when that test did not run: its teachers' work is not done twice."""
    import ray

    from smolforge.distill.store import read_manifest, ready_shards

    run = cluster.base / "corrupt"
    store = run / "teacher_outputs"
    earlier = cluster.base / "placement" / "teacher_outputs"
    if earlier.is_dir():
        shutil.copytree(earlier, store)
    else:
        orch = cluster.make()
        ids = orch.create_parallel_teacher_tasks(TEACHER, str(cluster.data), run, max_samples=24, num_shards=3, **GEN)
        orch.wait_distill(ids, timeout=300)
        orch.shutdown_distill()
    good = {s: read_manifest(store, s)["sha256"] for s in ready_shards(store)}
    assert len(good) >= 3, good
    path = store / "batch_2.safetensors"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))

    # A new orchestrator picks the store up from disk: shard 2 fails its checksum and is regenerated.
    orch = cluster.make()
    students = orch.create_student_tasks("tiny-llama", store, num_students=1, epochs=1.0, batch_size=4,
                                         peft_config={"r": 4, "alpha": 8})
    state = orch.distill_session()._dstate().stores[str(store.resolve())]
    # ... and shard 0's bytes get damaged on their way to the student.
    manifest = read_manifest(store, 0)
    bad = bytearray((store / "batch_0.safetensors").read_bytes())
    bad[100] ^= 0x01
    ray.get(state.broker.add.remote(0, json.dumps(manifest), [ray.put((json.dumps(manifest), bytes(bad)))]), timeout=30)
    orch.wait_distill(students, timeout=600)
    ev = orch.events
    corrupt = [e["data"] for e in ev if e["kind"] == "shard_corrupt"]
    assert {(c.get("source"), c["shard"]) for c in corrupt} >= {("disk", 2), ("student", 0)}, "\n".join(
        e["kind"] + ": " + e["message"] for e in ev)
    regen = [e["data"]["shard"] for e in ev if e["kind"] == "shard_regenerated"]
    assert sorted(set(regen)) == [0, 2]
    summary = json.loads((run / "output" / "student_0" / "summary.json").read_text())
    trained = {s["shard"]: s["sha256"] for s in summary["shards"]}
    assert trained == good, (summary, "\n".join(e["kind"] + ": " + e["message"] for e in ev))  # only verified, regenerated bytes were trained on (greedy: identical shards)
    orch.shutdown_distill()
