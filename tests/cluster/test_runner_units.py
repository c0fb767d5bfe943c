"""The job runner base owns the lifecycle (issue 29): kinds say what happened, the base decides.

- Only the base runner (`control/runner.py`) and the manager (`control/manager.py`) move a job's
  state; no kind runner calls the store's `set_state` or names a state as a string (an AST scan of
  `smolforge/cluster/`).
- The base applies the job's FailurePolicy to every kind alike: a fake kind (no Ray) that fails once
  is retried and completes, one that keeps failing gives up with the policy's reason, a failure of
  its own making is not retried, and a stop before the start never starts it. In process, no cluster.
"""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest

from smolforge.cluster.control.artifacts import ArtifactStore
from smolforge.cluster.control.jobstore import JobStore
from smolforge.cluster.control.runner import (
    Completed, Failed, JobRunner, Outcome, Regroup, RunnerContext,
)
from smolforge.cluster.control.states import STATES

CLUSTER = Path(__import__("smolforge.cluster", fromlist=["x"]).__file__).parent
# the modules that may move a job's state: the base runner (every kind's outcome) and the manager
# (queue, pause/resume/cancel of jobs without a running runner, recovery after a restart)
MOVERS = {"control/runner.py", "control/manager.py"}


def _calls_set_state(tree: ast.AST) -> list[int]:
    return [n.lineno for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "set_state"]


def test_only_the_base_runner_and_the_manager_move_a_jobs_state():
    movers = {}
    for path in sorted(CLUSTER.rglob("*.py")):
        rel = path.relative_to(CLUSTER).as_posix()
        lines = _calls_set_state(ast.parse(path.read_text(), str(path)))
        if lines and rel != "control/jobstore.py":  # (where set_state is defined)
            movers[rel] = lines
    assert set(movers) <= MOVERS, {k: v for k, v in movers.items() if k not in MOVERS}
    assert "control/runner.py" in movers  # the scan sees the calls it looks for


def _task_state_words(tree: ast.AST) -> set[int]:
    """ids of the state words that name a *task's* state: a task row's (`upsert_task(..., "running")`)
    or a task status compared (`s["state"] == "completed"`, `s` not the job); or words in a message."""
    allowed = set()
    for n in ast.walk(tree):
        task_row = isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "upsert_task"
        task_status = (isinstance(n, ast.Compare) and isinstance(n.left, ast.Subscript)
                       and isinstance(n.left.value, ast.Name) and n.left.value.id != "job"
                       and isinstance(n.left.slice, ast.Constant) and n.left.slice.value == "state")
        if task_row or task_status or isinstance(n, ast.JoinedStr):  # (an f-string: a message)
            allowed |= {id(c) for c in ast.walk(n) if isinstance(c, ast.Constant)}
    return allowed


def test_no_kind_runner_names_a_job_state():
    """A kind runner's outcome is an Outcome object, never a job state it names (a task's own state,
    a row in the job's task table, is the runner's to say)."""
    runners = sorted((CLUSTER / "workloads").glob("*/runner.py"))
    assert len(runners) == 5, runners
    found = {}
    for path in runners:
        tree = ast.parse(path.read_text(), str(path))
        tasks = _task_state_words(tree)
        words = [(n.lineno, n.value) for n in ast.walk(tree)
                 if isinstance(n, ast.Constant) and n.value in STATES and id(n) not in tasks]
        states = [(n.lineno, n.id) for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "JobState"]
        if words or states:
            found[path.parent.name] = words + states
    assert not found, found


class FakeKind(JobRunner):
    """A kind whose attempts come to the outcomes it is given, in order (no Ray)."""

    outcomes: list[Outcome] = []

    def start_attempt(self) -> Outcome | None:
        self.attempts = getattr(self, "attempts", 0) + 1
        return None

    def poll(self) -> Outcome | None:
        return self.outcomes.pop(0)


def _run(tmp_path, outcomes: list[Outcome], want: str | None = None) -> tuple[dict, list[dict], FakeKind]:
    store, artifacts = JobStore(tmp_path / "jobs.db"), ArtifactStore(tmp_path / "artifacts")
    job_id = store.create_job("fake", {"kind": "fake"})
    done = threading.Event()
    ctx = RunnerContext(store=store, artifacts=artifacts, embedded=True, healthy_nodes=list,
                        probe_node=lambda node, timeout: True, set_aside=lambda node: None,
                        placed=lambda job: None, keep_spec=lambda job, spec: None, done=lambda job, r: done.set())
    runner = type("Kind", (FakeKind,), {"outcomes": list(outcomes)})(ctx, job_id, spec=None, reason="started")
    runner.want = want
    runner.start()
    assert done.wait(60), "the runner did not end"
    return store.get_job(job_id), store.events(job_id), runner


def test_a_kind_that_fails_once_is_retried_by_the_base_and_completes(tmp_path):
    job, events, runner = _run(tmp_path, [Failed("its node died", checkpoint="step-5"), Regroup("a node joined"),
                                          Completed("completed: 3 steps", result={"steps": 3})])
    assert job["state"] == "completed" and job["result"] == {"steps": 3} and job["attempts"] == 1, job
    assert runner.attempts == 3  # the retry, then the regroup (no failure counted)
    recovering = [e for e in events if e["kind"] == "recovering"]
    assert len(recovering) == 1 and "retry 1 of 2 from checkpoint step-5" in recovering[0]["message"], recovering
    moves = [(e["data"]["from"], e["data"]["to"]) for e in events if e["kind"] == "state"]
    assert moves == [("pending", "running"), ("running", "completed")], moves


def test_the_base_gives_up_after_max_retries_with_the_policys_reason(tmp_path):
    job, events, runner = _run(tmp_path, [Failed("its node died")] * 3)
    assert job["state"] == "failed" and job["attempts"] == 3 and runner.attempts == 3, job
    assert job["error"] == "its node died"
    last = [e for e in events if e["kind"] == "state"][-1]
    assert "gave up after 3 failures (max_retries 2)" in last["message"], last


def test_a_failure_of_the_jobs_own_making_is_not_retried(tmp_path):
    job, events, runner = _run(tmp_path, [Failed("bad data", retryable=False, error="row 3 is not JSON")])
    assert job["state"] == "failed" and job["error"] == "row 3 is not JSON" and runner.attempts == 1, job
    assert not [e for e in events if e["kind"] == "recovering"]


@pytest.mark.parametrize("want,state", [("pause", "paused"), ("cancel", "cancelled")])
def test_a_stop_before_the_start_never_starts_an_attempt(tmp_path, want, state):
    job, events, runner = _run(tmp_path, [], want=want)
    assert job["state"] == state and not hasattr(runner, "attempts"), job
    assert [e["message"] for e in events if e["kind"] == "state"] == [f"{state} before it started"]


def test_every_runner_class_keeps_thread_join():
    """The manager waits for its runners with `Thread.join(timeout=...)` (`shutdown`, `resume`). A runner
    method named `join` (taking a node into the job) once shadowed it: the demo's exit raised TypeError
    whenever a runner was still registered. Every registered kind's runner, and the base, keep it."""
    import threading

    from smolforge.cluster.control import kinds
    from smolforge.cluster.control.runner import JobRunner

    classes = {JobRunner, *(k.runner() for k in kinds.KINDS.values())}  # each kind's class, imported
    shadowed = [c.__name__ for c in classes if c.join is not threading.Thread.join]
    assert len(classes) > 3 and not shadowed, shadowed
