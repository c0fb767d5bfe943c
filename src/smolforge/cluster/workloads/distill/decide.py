"""The live session's one answer to "what now": its `DistillRun`, fed with what it sees, asked by `plan`.

The session (`DistillTasks`) keeps the Ray side of a run: actors, generators, brokers, files. What it
sees (a teacher task made or placed, a shard written or found corrupt, a student started, progressing,
ended or failed, its node gone) it turns into the controller's events (`controller.py`) and folds into
its `DistillRun` with `apply`, here (`_record`); what to do next, it asks `plan` (`_plan`): which
teacher or student to place on which node, which to leave waiting, which to give up on. A failure's
verdict (restart from the checkpoint, or fail, under the run's one `FailurePolicy`) is the task's state
after its `TaskFailed` is applied (`_verdict`). The session has no rule of its own beside these.

With a journal (`SessionState.journal`, a list; None by default: nothing kept), every event and every
plan (its inputs and its actions) goes to it, so a test replays a session's journal through `apply`
and `plan` and gets the same actions the session took (`replay`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from smolforge.cluster.workloads.distill.controller import (
    Action,
    DistillRun,
    Eligible,
    Event,
    RunSettings,
    Task,
    TaskAdded,
    TaskPlaced,
    TaskStarted,
    apply,
    plan,
)
from smolforge.cluster.workloads.distill.state import DistillTask, SessionState

SHARD_SPAN = 1 << 20  # shard keys of one session: store number × SHARD_SPAN + the store's shard id


@dataclass(frozen=True)
class Planned:
    """One journal entry of a plan: its inputs (node ids and CPUs, held CPUs, time) and its actions."""

    nodes: tuple[tuple[str, float, float], ...]  # (node id, CPUs, GPUs)
    held: tuple[tuple[str, float], ...] | None
    now: float
    actions: tuple[Action, ...]


@dataclass(frozen=True)
class JournalNode:
    """A node as `plan` sees it (id, CPUs, GPUs), rebuilt from the journal."""

    node_id: str
    cpus: float
    gpus: float = 0.0

    @property
    def name(self) -> str:
        return self.node_id


def replay(journal: Sequence[Any]) -> list[tuple[tuple[Action, ...], tuple[Action, ...]]]:
    """Fold a session's journal from an empty run: each plan entry as (what the session was told,
    what `plan` says again on the replayed run). Equal pairs: the session decided nothing outside `plan`."""
    run, pairs = DistillRun(), []
    for entry in journal:
        if isinstance(entry, Planned):
            nodes = [JournalNode(*n) for n in entry.nodes]
            again = plan(run, nodes, entry.now, dict(entry.held) if entry.held is not None else None)
            pairs.append((entry.actions, tuple(again)))
        else:
            run = apply(entry, run)
    return pairs


class RunRecord:
    """The session's `DistillRun` (a mixin of DistillTasks): events in, `plan` out, the journal kept."""

    def _dstate(self) -> SessionState:  # (TeacherTasks')
        raise NotImplementedError

    def _record(self, *events: Event) -> DistillRun:
        """Fold `events` into the run (in order) and journal them; returns the run after them."""
        st = self._dstate()
        with st.lock:
            for event in events:
                st.run = apply(event, st.run)
                if st.journal is not None:
                    st.journal.append(event)
            return st.run

    def _attempt(self, task: DistillTask) -> int:
        """The run's current attempt of `task` (events of another attempt are stale)."""
        known = self._dstate().run.tasks.get(task.task_id)
        return known.attempt if known is not None else task.attempt

    def _synced(self) -> None:
        """Tell the run of the tasks it has not heard of yet (a task record made elsewhere: added, and
        placed or started as its record says), and of its settings as the students' specs give them."""
        st = self._dstate()
        with st.lock:
            for t in [t for t in st.tasks.values() if t.kind in ("teacher", "student") and t.task_id not in st.run.tasks]:
                group = t.seat.members if t.seat else None
                self._record(TaskAdded(Task(task_id=t.task_id, kind=t.kind, cpus=t.cpus, group=group[0] if group else None,
                                            attempt=t.attempt)))
                if t.node_id and not t.queued and t.state in ("pending", "running"):
                    self._record(TaskPlaced(t.task_id, t.node_id, t.attempt))
                if t.state == "running":
                    self._record(TaskStarted(t.task_id, t.attempt))
            students = [t for t in st.tasks.values() if t.kind == "student"]
            timeout = float(students[-1].replace_timeout_s or 300.0) if students else st.run.replace_timeout_s
            stores = list(st.stores.values())
            retries = int(getattr(stores[-1], "max_retries", 2)) if stores else st.run.max_shard_retries
            settings = RunSettings(getattr(self, "mode", "") == "hybrid", timeout, st.max_restarts, retries)
            now = (st.run.hybrid, st.run.replace_timeout_s, st.run.max_restarts, st.run.max_shard_retries)
            if now != (settings.hybrid, timeout, st.max_restarts, retries):
                self._record(settings)

    def _plan(self, nodes: Sequence[Any], held: Mapping[str, float] | None,
              eligible: Mapping[str, Sequence[Any]] | None = None) -> list[Action]:
        """`plan` on the run now: `nodes` the live nodes, `held` each node's CPUs in use, `eligible` the
        nodes that may run each waiting task (told to the run first). Journalled."""
        self._synced()
        st = self._dstate()
        with st.lock:
            for task_id, ok in (eligible or {}).items():
                ids = frozenset(n.node_id for n in ok)
                if task_id in st.run.tasks and st.run.tasks[task_id].eligible != ids:
                    self._record(Eligible(task_id, ids))
            now = time.time()
            actions = plan(st.run, nodes, now, held)
            if st.journal is not None:
                st.journal.append(Planned(tuple((n.node_id, float(n.cpus), float(n.gpus)) for n in nodes),
                                          tuple(sorted(held.items())) if held is not None else None, now,
                                          tuple(actions)))
            return actions


def shard_key(store_no: int, shard: int) -> int:
    """A store's shard as the session's run counts it (one run over every store of the session)."""
    return store_no * SHARD_SPAN + shard


def shard_of(key: int) -> tuple[int, int]:
    """(store number, shard id) of a shard key."""
    return divmod(key, SHARD_SPAN)

