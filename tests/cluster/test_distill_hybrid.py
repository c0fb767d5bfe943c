"""The seeds' hybrid on a real multi-node Ray cluster on one machine: the teacher on the coordinator
node (lent with --teacher-on-coordinator), two students on the workers training as ONE data-parallel
group over the store (--students-sync ddp).

Nodes (our own `ray start --block` children, stopped by PID, never `ray stop`):
    head  1 CPU, role coordinator, no worker resource (takes no work unless lent)
    w1    1 CPU, worker
    w2    1 CPU, worker
The nodes run fp32 (SMOLFORGE_CPU_BF16=0), so the group's adapter can be compared with one process.
Each node has its own SMOLFORGE_NODE_DIR (`node_dir`), where a test writes fault files
(`smolforge.train.faults`): a student held after a known step instead of one made long enough.
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


def node_dir(base: Path, name: str) -> Path:
    """Worker `name`'s scratch directory, where a test writes its fault files (`train.faults.fault_setting`)."""
    return base / f"node-{name}"


def _spawn(base: Path, procs: list):
    from smolforge.cluster.nodes import ray_glue
    from smolforge.auth import write_token
    from smolforge.cluster.nodes.ray_process import head_command, spawn, start_head, worker_command
    from smolforge.cluster.nodes.statedir import free_port

    tmp = Path(tempfile.mkdtemp(prefix="sfh", dir="/tmp"))  # short: Ray socket paths
    token_path = base / "token"
    write_token(token_path, os.urandom(16).hex())
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path), "RAY_TMPDIR": str(tmp),
           "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "RAY_raylet_start_wait_time_s": "120", "SMOLFORGE_CPU_BF16": "0"}
    env.pop("RAY_ADDRESS", None)
    port = free_port()
    # a head that exits during start-up (Ray's fixed 30 s registration, missed on a loaded machine) starts again
    head = lambda: head_command(port, cpus=1, node_ip="127.0.0.1", name="head",  # noqa: E731 - a fresh command per attempt
                                resources={ray_glue.HEAD_RESOURCE: 1000}, temp_dir=str(tmp), object_store_mb=100,
                                labels={ray_glue.NAME_LABEL: "head", ray_glue.ROLE_LABEL: "coordinator"})
    procs.append(start_head(head, "127.0.0.1", port, env, base / "head.log", timeout=120, die_with_parent=True))
    handle = ray_glue.connect(f"127.0.0.1:{port}", state_dir=base / "driver", token=token_path.read_text())
    for name in ("w1", "w2"):
        cmd = worker_command(f"127.0.0.1:{port}", cpus=1, gpus=0, node_ip="127.0.0.1", name=name,
                             resources={ray_glue.WORKER_RESOURCE: 1.0},
                             labels={ray_glue.NAME_LABEL: name, ray_glue.ROLE_LABEL: "worker"}, temp_dir=str(tmp),
                             object_store_mb=100)
        node_env = {**env, "SMOLFORGE_NODE_DIR": str(node_dir(base, name))}
        procs.append(spawn(cmd, node_env, base / f"{name}.log", die_with_parent=True))
        deadline = time.time() + 150
        while not any(n.name == name for n in handle.nodes()):
            assert time.time() < deadline and procs[-1].poll() is None, f"node {name} did not join; see {base}"
            time.sleep(0.5)
    return handle, tmp


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from smolforge.data.synthetic import generate

    base = tmp_path_factory.mktemp("distill-hybrid")
    data = base / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate(64, seed=11)))
    with orchestrators_on(lambda ps: _spawn(base, ps), "hybrid") as (handle, make):
        yield SimpleNamespace(make=make, data=data, base=base)


PEFT = {"r": 4, "alpha": 8, "dropout": 0.0}


def test_ddp_students_with_the_teacher_on_the_coordinator_equal_one_process(cluster, tmp_path):
    """Teacher on the head, a DDP group of two students on w1 and w2 (batch 2 each): ONE adapter, in
    output/student_0/, equal to train_student in this process over the same shards with batch 4."""
    from safetensors.torch import load_file

    from smolforge.cluster.workloads.distill.run import run_distill
    from smolforge.config import PeftSpec
    from smolforge.distill.losses import KDConfig
    from smolforge.distill.settings import DistillSettings
    from smolforge.distill.shard_source import DirShardSource
    from smolforge.distill.student import StudentConfig, train_student

    out = cluster.base / "hybrid"
    cfg = DistillSettings(teacher="tiny-llama", students=["tiny-llama"], data=str(cluster.data), num_students=2,
                          max_samples=24, num_shards=3, top_k=8, max_new_tokens=8, teacher_batch_size=8,
                          max_steps=3, batch_size=2, lr=1e-3, peft_config=PEFT, save_every=2, eval=False,
                          device="cpu", students_sync="ddp", teacher_on_coordinator=True)
    summary = run_distill(cfg, cluster.make().distill_session(), output_dir=out, mode="hybrid")

    assert {t["node"] for t in summary["teacher_tasks"]} == {"head"}
    assert sorted(s["node"] for s in summary["student_tasks"]) == ["w1", "w2"]
    assert [s["state"] for s in summary["student_tasks"]] == ["completed", "completed"]
    # one adapter for the group, its first member's; nothing averaged, and the summary says so
    assert summary["students_sync"] == "ddp"
    lines = summary["per_student"]
    assert [(s["base"], s["steps"], s["group"]["rank"]) for s in lines] == [("tiny-llama", 3, 0), ("tiny-llama", 3, 1)]
    assert lines[0]["output_dir"] == str(out / "output" / "student_0") and lines[1]["output_dir"] is None
    assert not (out / "output" / "student_1" / "lora_adapter").exists()
    assert "no averaging" in summary["merged"]["tiny-llama"]["merge"]
    assert (out / "merged_model" / "final_adapter" / "adapter_config.json").exists()
    assert (out / "output" / "student_0" / "checkpoints" / "step-2").is_dir()  # rank 0's, shipped to the driver

    ref = train_student(StudentConfig(base_model="tiny-llama", output_dir=str(tmp_path / "one"), max_steps=3,
                                      batch_size=4, lr=1e-3, device="cpu", num_threads=1, precision="fp32",
                                      peft=PeftSpec(method="lora", **PEFT), kd=KDConfig(kd_ratio=0.5)),
                        DirShardSource(out / "teacher_outputs", poll_s=0.05))
    one = load_file(str(Path(ref.adapter_dir) / "adapter_model.safetensors"))
    group = load_file(str(out / "output" / "student_0" / "lora_adapter" / "adapter_model.safetensors"))
    assert group.keys() == one.keys()
    assert any(float(v.abs().sum()) > 0 for k, v in one.items() if "lora_B" in k)  # it trained
    for k in one:
        assert float((group[k] - one[k]).abs().max()) <= 1e-5, (k, float((group[k] - one[k]).abs().max()))


def test_two_student_bases_on_one_store_each_get_their_own_output_and_merge(cluster, capsys):
    """The seeds' multi-model ensemble: one teacher's store (the test above's, reused when it is
    there), students of two different bases, each with its own output dir, its own merge under
    merged_model/<base>/final_adapter/, and its own line in the summary and the printed table."""
    from smolforge.cli.distill import _print_summary
    from smolforge.cluster.workloads.distill.run import run_distill
    from smolforge.distill.settings import DistillSettings

    out = cluster.base / "ensemble"
    if (cluster.base / "hybrid" / "teacher_outputs").is_dir():  # valid shards are reused, not regenerated
        shutil.copytree(cluster.base / "hybrid" / "teacher_outputs", out / "teacher_outputs")
    cfg = DistillSettings(teacher="tiny-llama", students=["tiny-llama", "tiny-qwen2"], data=str(cluster.data),
                          num_students=1, max_samples=24, num_shards=3, top_k=8, max_new_tokens=8,
                          teacher_batch_size=8, max_steps=2, batch_size=4, lr=1e-3, peft_config=PEFT, save_every=0,
                          max_eval_samples=4, eval_max_new_tokens=4, device="cpu", teacher_on_coordinator=True)
    summary = run_distill(cfg, cluster.make("teacher_student").distill_session(), output_dir=out)

    lines = {s["base"]: s for s in summary["per_student"]}
    assert sorted(lines) == ["tiny-llama", "tiny-qwen2"]
    for base, line in lines.items():
        assert line["state"] == "completed" and line["steps"] == 2 and line["loss"] > 0, line
        assert line["kd"] == "logit"  # the presets share one tokenizer: both learn from the teacher's logits
        assert "eval_loss" in line["eval"] and "accuracy" in line["eval"], line
        assert (Path(line["output_dir"]) / "lora_adapter" / "adapter_model.safetensors").exists()
        merged = out / "merged_model" / base / "final_adapter"
        assert summary["merged"][base]["output"] == str(merged) and (merged / "adapter_config.json").exists()
    assert lines["tiny-llama"]["output_dir"] != lines["tiny-qwen2"]["output_dir"]
    cfg_of = {b: json.loads((out / "merged_model" / b / "final_adapter" / "adapter_config.json").read_text())
              for b in lines}
    assert cfg_of["tiny-llama"]["base_model_name_or_path"] != cfg_of["tiny-qwen2"]["base_model_name_or_path"]
    _print_summary(summary)
    printed = capsys.readouterr().out
    assert "tiny-qwen2" in printed and "merged (tiny-llama)" in printed and "merged (tiny-qwen2)" in printed


def _keep_lines(orch) -> list[dict]:
    """What the orchestrator's teachers and students print, kept for `_story` (an Orchestrator drops
    them; a session hands them to whoever sets `log_lines`)."""
    kept: list[dict] = []
    orch.log_lines = kept.extend
    return kept


def _story(orch, lines: list[dict], last: int = 120) -> str:
    """The run's events, then its tasks' last `last` output lines, one per line with its time: what a
    failure message shows, so a flaky failure explains itself."""
    events = [f"{e['ts']:.2f} {e['kind']}: {e['message']}" for e in list(orch.events)]
    said = [f"{x.get('ts', 0):.2f} [{x.get('task')}@{x.get('node')}] {x.get('line')}" for x in list(lines)[-last:]]
    return "\n".join(["events:", *events, f"task lines (last {last}):", *said])


def _wait_for(orch, students: list[str], done, what: str, limit: float = 300.0,
              lines: list | None = None) -> list[dict]:
    """The events `done(events)` waits for (a hang guard only: the students must still be live)."""
    deadline = time.time() + limit
    while not done(orch.events):
        assert time.time() < deadline and all(orch.task_status(s)["state"] in ("pending", "running")
                                              for s in students), \
            f"{what}: {[orch.task_status(s) for s in students]}\n{_story(orch, lines or [])}"  # (a str: shown whole)
        time.sleep(0.2)
    return list(orch.events)


def _wait_distill(orch, task_ids: list[str], lines: list[dict], timeout: float = 300.0) -> None:
    """`wait_distill` as a hang guard whose failure shows the run's events and its tasks' lines."""
    from smolforge.errors import SmolforgeError

    try:
        orch.wait_distill(task_ids, timeout=timeout)
    except SmolforgeError as err:
        raise AssertionError(f"{err.render()}\n{_story(orch, lines)}") from err


def test_a_ddp_group_that_loses_a_rank_restarts_from_its_checkpoint_and_ends_as_an_undisturbed_run(cluster, tmp_path):
    """Rank 1's worker process is SIGKILLed while the group is held after step 3 (its checkpoint of step
    2 kept on the driver): the group restarts whole from step 2, on the nodes that can run it, with
    no human, and ends with the adapter of an undisturbed run (one process over the same shards with
    the group's global batch, which the first test shows the group equals)."""
    import signal

    from safetensors.torch import load_file

    from smolforge.config import PeftSpec
    from smolforge.distill.losses import KDConfig
    from smolforge.distill.shard_source import DirShardSource
    from smolforge.distill.student import StudentConfig, train_student

    out = cluster.base / "lost-rank"
    if (cluster.base / "hybrid" / "teacher_outputs").is_dir():
        shutil.copytree(cluster.base / "hybrid" / "teacher_outputs", out / "teacher_outputs")
    orch = cluster.make()
    lines = _keep_lines(orch)
    teachers = orch.create_parallel_teacher_tasks("tiny-llama", str(cluster.data), out, max_samples=24, num_shards=3,
                                                  top_k=8, max_new_tokens=8, batch_size=8, teacher_on_coordinator=True)
    hold = [node_dir(cluster.base, n) / "fault-hold-step" for n in ("w1", "w2")]
    try:
        for f in hold:  # both ranks stop after step 3 and wait there (the group is training)
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text("3")
        students = orch.create_student_tasks("tiny-llama", out / "teacher_outputs", num_students=2, peft_config=PEFT,
                                             max_steps=4, batch_size=2, lr=1e-3, device="cpu", save_every=2,
                                             students_sync="ddp", eval_data=str(cluster.data), max_eval_samples=4,
                                             eval_accuracy=False)
        events = _wait_for(orch, students, lambda evs: len([e for e in evs if e["kind"] == "held"]) == 2 and any(
            e["kind"] == "student_checkpoint" and e["data"]["step"] == 2 for e in evs), "both held, step 2 kept",
                           lines=lines)
        held = {e["data"]["task_id"]: e["data"] for e in events if e["kind"] == "held"}
        assert sorted((t, d["step"]) for t, d in held.items()) == [(s, 3) for s in students], held
        os.kill(held[students[1]]["pid"], signal.SIGKILL)  # rank 1's worker process dies mid-run
    finally:
        for f in hold:  # read as a rank starts: the restarted group goes on unheld
            f.unlink(missing_ok=True)
    _wait_distill(orch, teachers + students, lines)  # a hang guard: nothing but the kill was done by hand

    restarted = [e["data"] for e in orch.events if e["kind"] == "group_restarted"]
    assert [(d["task_id"], d["lost_rank"], d["step"], d["restarts"]) for d in restarted] == [(students[1], 1, 2, 1)], \
        restarted
    states = [orch.task_status(s) for s in students]
    assert [(s["state"], s["step"]) for s in states] == [("completed", 4), ("completed", 4)], states
    resumed = [e["data"] for e in orch.events if e["kind"] == "student_resumed"]
    assert sorted(d["step"] for d in resumed) == [2, 2], resumed  # both ranks went on from the checkpoint

    eval_examples = orch.distill_session()._eval_examples(str(cluster.data), None, 4)  # (no held-out file: the data's split)
    ref = train_student(StudentConfig(base_model="tiny-llama", output_dir=str(tmp_path / "one"), max_steps=4,
                                      batch_size=4, lr=1e-3, device="cpu", num_threads=1, precision="fp32",
                                      peft=PeftSpec(method="lora", **PEFT), kd=KDConfig(kd_ratio=0.5),
                                      eval_accuracy=False),
                        DirShardSource(out / "teacher_outputs", poll_s=0.05), eval_examples=eval_examples)
    one = load_file(str(Path(ref.adapter_dir) / "adapter_model.safetensors"))
    group = load_file(str(out / "output" / "student_0" / "lora_adapter" / "adapter_model.safetensors"))
    assert {k: v.shape for k, v in group.items()} == {k: v.shape for k, v in one.items()}
    healed = orch.distill_session()._dstate().tasks[students[0]].result["eval"]["eval_loss"]
    undisturbed = ref.eval["eval_loss"]
    assert abs(healed - undisturbed) <= 0.05 * undisturbed, (healed, undisturbed)
    for k in one:  # the restart lost nothing: the checkpoint held the weights, the optimizer and the data's place
        assert float((group[k] - one[k]).abs().max()) <= 1e-5, (k, float((group[k] - one[k]).abs().max()))


def _node(name: str) -> SimpleNamespace:
    """A 1-CPU worker as placement sees it."""
    return SimpleNamespace(name=name, node_id=f"id-{name}", cpus=1.0, gpus=0.0)


def _waiting_group(nodes: list):
    """A distillation session (no Ray) holding one ddp group of two waiting students of tiny-llama, whose
    eligible nodes are `nodes`; returns (session, the students' ids)."""
    from smolforge.cluster.workloads.distill.session import DistillSession
    from smolforge.cluster.workloads.distill.state import DistillTask
    from smolforge.cluster.workloads.distill.task_plans import student_record
    from smolforge.distill.student import StudentConfig

    s = DistillSession(cluster=None, mode="hybrid")
    st = s._dstate()
    st.stores["store"] = SimpleNamespace()
    ids = ["student-0", "student-1"]
    for rank, tid in enumerate(ids):
        config = StudentConfig(base_model="tiny-llama", output_dir="", device="cpu", max_steps=4)
        st.tasks[tid] = DistillTask(task_id=tid, kind="student", store="store", rank=rank, max_steps=4,
                                    plan=student_record(tid, config, None, None, None), replace_timeout_s=30.0)
    s._form_group({"sync": "ddp", "strategy": "ddp", "members": ids, "world": 2, "shards": [0, 1, 2]})
    s._student_nodes = lambda task: list(nodes)
    return s, ids


def test_a_ddp_group_no_nodes_can_hold_waits_then_fails_saying_why():
    """The decision, in process (no Ray): a group of 2 whose only eligible node has 1 CPU can never start
    there, so it is queued as unplaceable and, after replace_timeout_s, every member fails with the
    group's reason; the same group with a second node that is merely busy waits (no verdict)."""
    from smolforge.cluster.workloads.distill.state import DistillTask
    from smolforge.errors import SmolforgeError

    busy = _node("w2")
    s, ids = _waiting_group([_node("w1"), busy])
    s._dstate().tasks["teacher-0"] = DistillTask(task_id="teacher-0", kind="teacher", store="store", state="running",
                                                 node_id=busy.node_id)
    assert s._place_student(s._dstate().tasks[ids[0]]) is False  # queued: w2 is busy, yet the two could hold it
    assert [s._dstate().tasks[t].no_node_since for t in ids] == [None, None]

    s, ids = _waiting_group([_node("w1")])  # the node that held rank 1 is gone: one 1-CPU node for 2 ranks
    assert s._place_student(s._dstate().tasks[ids[0]]) is False
    tasks = [s._dstate().tasks[t] for t in ids]
    assert all(t.queued and t.no_node_since for t in tasks), [(t.queued, t.no_node_since) for t in tasks]
    assert "no live node can run it" in [e for e in s.events if e["kind"] == "student_queued"][0]["message"]
    s._fail_unplaceable()  # not yet: replace_timeout_s has not passed
    assert [t.state for t in tasks] == ["pending", "pending"]
    for t in tasks:
        t.no_node_since -= 31
    s._fail_unplaceable()
    assert [t.state for t in tasks] == ["failed", "failed"] and len({t.error for t in tasks}) == 1, tasks
    with pytest.raises(SmolforgeError, match=r"no nodes could run its ddp student group \(student-0, student-1\) "
                                             r"for 30s: its 2 ranks need 1 CPUs each at once"):
        s.wait_distill(ids, timeout=5)


def test_two_threads_placing_one_waiting_group_start_it_once():
    """The decision, in process (no Ray): the monitor's periodic placement and a lost rank's restart both
    ask to place the same waiting ddp group. Placement is one step per thread (`SessionState.placing`):
    the second plan comes after the first start was told to the run, so the group starts once. Two starts
    made two copies of the group on nodes of one CPU each, each copy's rank 0 waiting to meet a rank 1
    whose CPU the other copy held (with 3 s held open between a plan and its start, the group failed)."""
    import threading

    from smolforge.cluster.workloads.distill.controller import TaskPlaced

    s, ids = _waiting_group([_node("w1"), _node("w2")])
    st = s._dstate()
    started: list[tuple[str, ...]] = []
    reached = threading.Event()  # the other placer asked for the placing lock, or placed without it

    def other_places() -> None:
        try:
            s._place_waiting()
        finally:
            reached.set()

    other = threading.Thread(target=other_places, name="the other placer")

    class Watched:  # the session's placing lock, telling when the other placer asks for it
        def __enter__(self):
            if threading.current_thread() is other:
                reached.set()
            return placing.__enter__()

        def __exit__(self, *exc):
            return placing.__exit__(*exc)

    placing, st.placing = st.placing, Watched()

    def start(action, by_id):  # as `_start_students` does, with the other thread's plan in the middle
        started.append(action.task_ids)
        if len(started) == 1:
            other.start()
            assert reached.wait(timeout=60)  # (a hang guard only)
        with st.lock:
            for tid, node_id in zip(action.task_ids, action.node_ids):
                st.tasks[tid].node_id = node_id
                s._record(TaskPlaced(tid, node_id, action.attempt))
        return {tid: True for tid in action.task_ids}

    s._start_students = start
    assert s._place_student(st.tasks[ids[0]]) is True
    other.join()
    assert started == [tuple(ids)], started


def test_a_live_node_slow_to_start_a_worker_is_not_called_gone(monkeypatch):
    """The verdict on a lost rank's node, in process (no Ray): the probe of a live node whose only worker
    just died answers once a new worker process starts (here: one that takes 5 s). A 4 s probe called it
    gone, and a group of 2 with one node left waited as unplaceable for replace_timeout_s; the verdict
    gives a live node NODE_VERDICT_S, and a node that never answers is gone."""
    from smolforge.cluster.workloads.distill import groups

    asked: list[float] = []

    def probe(node_id: str, timeout: float = 4.0) -> bool:
        asked.append(timeout)
        return node_id == "id-w2" and timeout >= 5.0  # w2 is alive, its new worker starts in 5 s; w3 is dead

    monkeypatch.setattr("smolforge.cluster.nodes.ray_glue.probe_node", probe)
    assert groups.node_gone("id-w2") is False
    assert groups.node_gone("id-w3") is True
    assert groups.node_gone(None) is False and len(asked) == 2  # no node, no probe
