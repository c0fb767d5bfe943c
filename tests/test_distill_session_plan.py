"""The live distill session takes its decisions from the controller (issue 42 item 1), without Ray.

A real `DistillSession` places, fails and restarts students through its own code; only the Ray leaves
(actors, the broker, the node probe) are stand-ins. Its journal (`SessionState.journal`: every event it
told its `DistillRun`, every plan it asked) replayed through `apply` and `plan` gives the actions the
session took, and the session's task records agree with the run's tasks: it decided nothing on its
own. A static check: no distill session module but the controller holds a placement or failure rule.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import ray.exceptions as rex

from smolforge.cluster.workloads.distill import placing
from smolforge.cluster.workloads.distill.controller import Place, Wait
from smolforge.cluster.workloads.distill.decide import Planned, replay
from smolforge.cluster.workloads.distill.session import DistillSession
from smolforge.cluster.workloads.distill.state import DistillTask
from smolforge.cluster.workloads.distill.task_plans import student_record
from smolforge.distill.student import StudentConfig

SRC = Path(__file__).resolve().parents[1] / "src" / "smolforge" / "cluster" / "workloads" / "distill"


def node(name: str) -> SimpleNamespace:
    return SimpleNamespace(name=name, node_id=f"id-{name}", cpus=1.0, gpus=0.0)


class FakeActor:
    def __init__(self):
        self.run = SimpleNamespace(remote=lambda plan, broker, rank: ("ref", plan.task_id))  # a StudentTaskPlan


def session(monkeypatch, tmp_path: Path, nodes: list, n: int) -> DistillSession:
    """A session over `nodes` with `n` lone students of 1 CPU, a journal kept; Ray's leaves stood in."""
    monkeypatch.setattr(placing, "remotes", lambda: {"student": SimpleNamespace(
        options=lambda **_: SimpleNamespace(remote=FakeActor))})
    monkeypatch.setattr("ray.get", lambda refs, timeout=None: refs)
    monkeypatch.setattr("smolforge.cluster.nodes.ray_glue.probe_node", lambda node_id, timeout=4: True)
    s = DistillSession(cluster=None)
    st = s._dstate()
    st.journal = []
    st.stores["store"] = SimpleNamespace(broker=SimpleNamespace(restart=SimpleNamespace(remote=lambda rank: rank)))
    for i in range(n):
        st.tasks[f"student-{i}"] = DistillTask(
            task_id=f"student-{i}", kind="student", store="store", rank=i, max_steps=4,
            output_dir=str(tmp_path / f"student_{i}"), replace_timeout_s=30.0,
            plan=student_record(f"student-{i}", StudentConfig(base_model="tiny-llama", output_dir=str(
                tmp_path / f"student_{i}"), device="cpu", max_steps=4), None, None, None))
    s._student_nodes = lambda task: list(nodes)
    s._options = lambda pick, model, cpus, *a, **k: {}
    return s


def test_a_sessions_journal_replays_to_the_actions_it_took_and_its_records_are_the_runs(monkeypatch, tmp_path):
    s = session(monkeypatch, tmp_path, [node("w1"), node("w2")], 3)
    st = s._dstate()
    s._place_waiting()  # two nodes of 1 CPU: two students start, the third waits
    s._lone_student_failed(st.tasks["student-0"], ValueError("bad data"))  # its own error: not retried
    s._lone_student_failed(st.tasks["student-1"], rex.WorkerCrashedError())  # lost: restarted where the plan says
    s._fail_unplaceable()  # the next plan: student-2 takes the node student-0 freed... or waits
    plans = [e for e in st.journal if isinstance(e, Planned)]
    taken = [a for p in plans for a in p.actions]
    assert any(isinstance(a, Place) for a in taken) and any(isinstance(a, Wait) for a in taken), taken
    pairs = replay(st.journal)
    assert pairs and all(told == again for told, again in pairs), pairs
    # every record is where the run says it is: nothing placed, failed or restarted outside the run
    run = st.run
    state = {"waiting": "queued", "placed": "placed", "running": "placed", "failed": "failed"}
    for tid, t in st.tasks.items():
        mine = "failed" if t.state == "failed" else "placed" if t.node_id else "queued"
        node_id = None if t.state == "failed" else t.node_id  # (an ended record keeps its node, to show)
        assert (mine, t.attempt, node_id) == (state[run.tasks[tid].state], run.tasks[tid].attempt,
                                               run.tasks[tid].node_id), (tid, t, run.tasks[tid])
    assert st.tasks["student-0"].state == "failed" and "not retried" in st.tasks["student-0"].error
    assert (st.tasks["student-1"].attempt, st.tasks["student-1"].restarts) == (1, 1)
    assert run.failures == {"student-0": 1, "student-1": 1}


RULES = {"pick_group_nodes", "pick_student_node", "retry_teacher_node", "freest_node", "hosts", "on_failure",
         "shards_to_retry", "FailurePolicy"}


def names_used(path: Path) -> set[str]:
    """Every name and attribute the module's code uses or imports (not its docstrings)."""
    tree = ast.parse(path.read_text())
    out = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    out |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    return out | {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}


def test_no_distill_session_module_holds_a_rule_of_its_own():
    """Where to place, whether to retry or give up: the controller's alone (the runner's FailurePolicy
    ends a whole run; runner.py is the base runner's client, not a session module)."""
    session_modules = ["session.py", "teachers.py", "students.py", "groups.py", "placing.py", "decide.py", "state.py"]
    found = {m: sorted(RULES & names_used(SRC / m)) for m in session_modules}
    assert not any(found.values()), found
