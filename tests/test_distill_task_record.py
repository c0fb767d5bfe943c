"""The driver's own record of a distillation student is typed (issue 42, item 2): `DistillTask.plan`, the
frozen `StudentTaskPlan` it is started with, read by field; no `spec[...]` dict. What the record shows the
world did not change with it: the events a run writes, its task rows (`task_status`, the seeds'
`get_task_status`, a job's task rows), the summary's student lines (`run._student_line`, `job show`) and
the plans sent to the student actors are compared with what they were before the change
(`fixtures/distill_task_record.json`, written by the dict-record code of 36fd3ac).

A real `DistillSession` (no Ray: its leaves stood in, as in test_distill_session_plan.py) starts a ddp
group of two and a lone resumed student, restarts the lone one after a lost worker and the group after a
lost rank. Pure and quick: no cluster, no model.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import ray.exceptions as rex

from smolforge.cluster.workloads.distill import placing
from smolforge.cluster.workloads.distill.plans import StudentCall, plan_students
from smolforge.cluster.workloads.distill.run import _student_line
from smolforge.cluster.workloads.distill.session import DistillSession

GOLDEN = Path(__file__).parent / "fixtures" / "distill_task_record.json"
SRC = Path(__file__).resolve().parents[1] / "src" / "smolforge" / "cluster" / "workloads" / "distill"
NODES = [SimpleNamespace(name=f"w{i}", node_id=f"id-w{i}", cpus=1.0, gpus=0.0) for i in (1, 2, 3)]


def _remote(fn) -> SimpleNamespace:
    return SimpleNamespace(remote=fn)


def _checkpoint(out: Path, step: int) -> None:
    """A kept student checkpoint at `step` that verifies (its manifest's checksums)."""
    d = out / "checkpoints" / f"step-{step}"
    d.mkdir(parents=True)
    (d / "state.json").write_text(json.dumps({"step": step}))
    digest = hashlib.sha256((d / "state.json").read_bytes()).hexdigest()
    (d / "manifest.json").write_text(json.dumps({"step": step, "files": {"state.json": digest}}))


def _session(monkeypatch, tmp_path: Path) -> tuple[DistillSession, Any, list, list]:
    """A driven session over NODES whose store (4 shards of 8 prompts) is a stand-in; returns it, the
    store, the plans its student actors were sent and the model each placement requested."""
    sent: list = []
    models: list = []

    class Actor:
        def __init__(self):
            self.free_address = _remote(lambda: ("10.0.0.5", 29500))
            self.run = _remote(lambda plan, broker, rank: sent.append(plan) or ("ref", plan.task_id, len(sent)))

    monkeypatch.setattr(placing, "remotes", lambda: {"student": SimpleNamespace(
        options=lambda **_: SimpleNamespace(remote=Actor))})
    monkeypatch.setattr("ray.get", lambda refs, timeout=None: refs)
    monkeypatch.setattr("smolforge.cluster.nodes.ray_glue.probe_node", lambda node_id, timeout=4: True)
    s = DistillSession(cluster=None, driven=True)
    broker = SimpleNamespace(assign=_remote(lambda rank, shards: rank), update_plan=_remote(lambda plan: None),
                             restart=_remote(lambda rank: rank))
    store = SimpleNamespace(dir=tmp_path / "teacher_outputs", next_rank=0, assigned={}, broker=broker,
                            plan=SimpleNamespace(teacher="tiny-llama", tokenizer_hash="h1", num_shards=4,
                                                 shards=[(i * 8, i * 8 + 8) for i in range(4)], samples_per_prompt=1))
    s._dstate().stores[str(store.dir)] = store
    s._store_for = lambda d: store
    s._model_nodes = lambda model, role, *a, **k: (list(NODES), f"{model}@{role}")
    s._options = lambda pick, model, cpus, *a, **k: models.append([pick.name, model, cpus]) or {}
    return s, store, sent, models


def _sent(plan) -> dict[str, Any]:
    """A sent StudentTaskPlan as JSON: its group's secret (random) out, its resume point by name and step."""
    out = dataclasses.asdict(plan)
    out["config"]["peft"] = plan.config.peft.model_dump()
    out["resume"] = None if plan.resume is None else [plan.resume.name, plan.resume.step]
    if out["group"]:
        out["group"].pop("secret")
    return out


def _run_record(monkeypatch, tmp_path: Path) -> str:
    """Start a ddp group of two and a lone resumed student, lose the lone one's worker and a rank of the
    group; what the run showed the world, as JSON (times out, the tmp dir as <tmp>)."""
    s, store, sent, models = _session(monkeypatch, tmp_path)
    run_dir = tmp_path / "run"
    group = s.start_students(plan_students(StudentCall(
        "tiny-llama", store.dir, num_students=2, students_sync="ddp", max_steps=4, output_dir=run_dir)))
    _checkpoint(run_dir / "output" / "student_2", 3)
    lone = s.start_students(plan_students(StudentCall(
        "tiny-llama", store.dir, num_students=1, resume=True, max_steps=6, output_dir=run_dir, peft_type="ia3",
        kd_loss="reverse_kl", replace_timeout_s=45.0, eval_data=None)))
    st = s._dstate()
    s._lone_student_failed(st.tasks[lone[0]], rex.WorkerCrashedError())
    lost = st.tasks[group[1]]
    s._group_member_failed(lost, st.handles[lost.task_id][1], rex.WorkerCrashedError())
    ids = group + lone
    times = ("started", "finished", "eta_s")
    out = {"events": [{k: v for k, v in e.items() if k != "ts"} for e in s.events],
           "status": [{k: v for k, v in s.task_status(t).items() if k not in times} for t in ids],
           "summary": [_student_line(s, t) for t in ids], "sent": [_sent(p) for p in sent], "options": models,
           "replace_timeout_s": st.run.replace_timeout_s}
    return json.dumps(out, indent=1, sort_keys=True, default=repr).replace(str(tmp_path), "<tmp>")


def test_a_students_record_shows_the_world_what_it_showed_before_it_was_typed(monkeypatch, tmp_path):
    now = json.loads(_run_record(monkeypatch, tmp_path))
    assert now == json.loads(GOLDEN.read_text())


def test_no_distill_module_reads_a_task_record_by_key():
    """A task's record is read by field: no `<x>.spec[...]` / `<x>.spec.get(...)` left in the distill
    workload but the job runner's own job spec (`self.spec`, a typed DistillJob)."""
    found = []
    for path in sorted(SRC.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            sub = node.value if isinstance(node, ast.Subscript) else None
            get = node.value if isinstance(node, ast.Attribute) and node.attr == "get" else None
            spec = sub if sub is not None else get
            if (isinstance(spec, ast.Attribute) and spec.attr == "spec"
                    and not (isinstance(spec.value, ast.Name) and spec.value.id == "self")):
                found.append(f"{path.name}:{node.lineno}")
    assert not found, found
