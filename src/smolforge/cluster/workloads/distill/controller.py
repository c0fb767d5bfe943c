"""A distillation run as one frozen state, typed events and two pure functions (no Ray, no clock).

`apply(event, run) -> run` folds what the teachers, students and the driver report into a new
`DistillRun`; `plan(run, nodes, now) -> list[Action]` says what to do next: which teacher or student
to place on which node, which to stop, which to give up on, and when the run is over. Both are pure,
so every transition is tested without a cluster (tests/test_distill_controller.py), as exo does with
`apply(event, state)` and Ray Train v2's controller with one poll and one failure decision.

The shape of a run:
- a teacher task holds shards; `ShardWritten` marks one done. A teacher that fails (`TaskFailed`,
  or `NodeLost` under it) hands its unfinished shards to a new teacher task, each shard at most
  `shard_retries` times; past that the store fails and so does every student still waiting on it.
- a student task (or a ddp group of them, which start and stop together) is placed, starts,
  reports progress and ends `completed`, `paused` or `cancelled`. A student whose worker was lost
  restarts from its checkpoint under the run's one `FailurePolicy` (a group spends one budget); an
  error of its own is not retried (a group restarts whole, a member that had ended too, unless its
  leader has completed: then a rank lost after it counts as completed). Every start is an attempt; an event of an earlier attempt is
  stale and changes nothing, so a restarted task is never also running.
- a student that finds no node waits (`Queued`); one that no live node could run at all, were
  they idle, fails after `replace_timeout_s` from `Queued(..., unplaceable=True)`.
- a group placed where Ray then had no CPUs for a member (another job's tasks took them before Ray's
  table showed it) does not start: `NotStarted` puts it back to waiting, as a new attempt without
  spending a restart, and `plan` places it again when nodes free; one that has not started within
  `replace_timeout_s` of its first `NotStarted` fails (`GiveUp`), so nothing waits forever.
- `PauseAsked` / `CancelAsked` stop every task; the run ends once no task is active.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence, Union

from smolforge.cluster.control.distill_placement import (
    freest_node, hosts, own_cpus, pick_group_nodes, retry_teacher_node,
)
from smolforge.cluster.control.policy import FailurePolicy

ACTIVE = ("waiting", "placed", "running")  # a task that holds, or wants, a node
ENDED = ("completed", "failed", "cancelled", "paused")


@dataclass(frozen=True)
class Task:
    """One teacher or student task. `state`: waiting (wants a node) | placed | running | an ENDED one."""

    task_id: str
    kind: str  # teacher | student
    cpus: float = 1.0
    state: str = "waiting"
    node_id: str | None = None
    attempt: int = 0  # bumped at every (re)start: events of an older attempt are stale
    shards: tuple[int, ...] = ()
    done: frozenset[int] = frozenset()
    group: str | None = None  # a ddp group's leader task id (the leader's own id for the leader)
    eligible: frozenset[str] | None = None  # node ids that may run it (None: any node)
    lost_nodes: frozenset[str] = frozenset()
    exclude: str | None = None  # a retry teacher: the node its shards failed on
    step: int = 0
    max_steps: int = 0
    restarts: int = 0
    error: str | None = None
    no_node_since: float | None = None
    unstarted_since: float | None = None  # a group placed but never started (`NotStarted`): since when
    unstarted: int = 0  # how often it was placed and did not start


@dataclass(frozen=True)
class DistillRun:
    """The whole run: its tasks, the store's progress, the failure budget's counts, a stop asked for."""

    tasks: dict[str, Task] = field(default_factory=dict)
    num_shards: int = 0
    written: frozenset[int] = frozenset()
    shard_retries: dict[int, int] = field(default_factory=dict)
    max_shard_retries: int = 2
    max_restarts: int = 2
    failures: dict[str, int] = field(default_factory=dict)  # FailurePolicy counts per subject
    store_failed: str | None = None
    stop: str | None = None  # pause | cancel
    hybrid: bool = False
    replace_timeout_s: float = 300.0
    teachers_made: int = 0

    def members(self, task_id: str) -> list[Task]:
        """The tasks that start and stop with `task_id`: its group in rank order, or itself."""
        group = self.tasks[task_id].group
        if group is None:
            return [self.tasks[task_id]]
        return [t for t in self.tasks.values() if t.group == group]


# -- events ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskAdded:
    task: Task


@dataclass(frozen=True)
class TaskPlaced:
    task_id: str
    node_id: str
    attempt: int


@dataclass(frozen=True)
class TaskStarted:
    task_id: str
    attempt: int


@dataclass(frozen=True)
class NotStarted:
    """`task_id`'s group (or itself), placed as `attempt`, did not start at `at` (s): a member's actor was
    still waiting for CPUs in Ray. Its placement is undone: back to waiting, as attempt + 1 (the killed
    actors' news is stale), without a restart spent."""

    task_id: str
    attempt: int
    at: float


@dataclass(frozen=True)
class ShardWritten:
    task_id: str
    shard: int
    attempt: int


@dataclass(frozen=True)
class ShardCorrupt:
    shard: int


@dataclass(frozen=True)
class StudentProgress:
    task_id: str
    step: int
    max_steps: int
    attempt: int


@dataclass(frozen=True)
class TaskEnded:
    task_id: str
    state: str  # completed | paused | cancelled
    attempt: int


@dataclass(frozen=True)
class TaskFailed:
    """`node_gone`: with `worker_lost`, its node itself is gone (never placed there again); False: only
    its process died, the node is alive (a probe answered)."""

    task_id: str
    error: str
    worker_lost: bool
    attempt: int
    checkpoint: str | None = None
    node_gone: bool = True


@dataclass(frozen=True)
class NodeLost:
    node_id: str


@dataclass(frozen=True)
class Queued:
    task_ids: tuple[str, ...]
    at: float
    unplaceable: bool


@dataclass(frozen=True)
class ShardFound:
    """A valid shard already on disk (an earlier run's): written, so a corrupt report regenerates it."""

    shard: int


@dataclass(frozen=True)
class Eligible:
    """The live node ids that may run a waiting task now (nodes join and leave; None: any node)."""

    task_id: str
    node_ids: frozenset[str] | None


@dataclass(frozen=True)
class RunSettings:
    """The run's own settings, as the tasks' specs give them (`hybrid`: students avoid teacher nodes)."""

    hybrid: bool
    replace_timeout_s: float
    max_restarts: int
    max_shard_retries: int = 2


@dataclass(frozen=True)
class PauseAsked:
    pass


@dataclass(frozen=True)
class CancelAsked:
    pass


Event = Union[TaskAdded, TaskPlaced, TaskStarted, NotStarted, ShardWritten, ShardCorrupt, StudentProgress, TaskEnded,
              TaskFailed, NodeLost, Queued, ShardFound, Eligible, RunSettings, PauseAsked, CancelAsked]


# -- actions ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Place:
    """Start these tasks (a group's members together), each on its node, as their `attempt`."""

    task_ids: tuple[str, ...]
    node_ids: tuple[str, ...]
    attempt: int


@dataclass(frozen=True)
class Wait:
    """No node for these tasks now; `unplaceable`: none could run them even idle (nodes must join)."""

    task_ids: tuple[str, ...]
    unplaceable: bool


@dataclass(frozen=True)
class GiveUp:
    """These tasks fail with this reason (their checkpoints stay for a rerun)."""

    task_ids: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Stop:
    """Ask these tasks to stop: pause (checkpoint first) or cancel."""

    task_ids: tuple[str, ...]
    what: str


@dataclass(frozen=True)
class RunEnded:
    """No task is active: the run is `completed`, `failed`, `paused` or `cancelled`."""

    state: str
    reason: str


Action = Union[Place, Wait, GiveUp, Stop, RunEnded]


# -- apply -----------------------------------------------------------------------------------------


def _put(run: DistillRun, *tasks: Task, **fields: Any) -> DistillRun:
    return replace(run, tasks={**run.tasks, **{t.task_id: t for t in tasks}}, **fields)


def _current(run: DistillRun, task_id: str, attempt: int) -> Task | None:
    """The task the event speaks of, if it is of the task's current attempt and the task is active."""
    task = run.tasks.get(task_id)
    if task is None or task.attempt != attempt or task.state not in ACTIVE:
        return None
    return task


def apply(event: Event, run: DistillRun) -> DistillRun:
    """The run after `event`; a stale or unknown event returns `run` unchanged (see the module docstring)."""
    if isinstance(event, TaskAdded):
        made = run.teachers_made + (event.task.kind == "teacher")
        return _put(run, event.task, teachers_made=made)
    if isinstance(event, (PauseAsked, CancelAsked)):
        return run if run.stop else replace(run, stop="pause" if isinstance(event, PauseAsked) else "cancel")
    if isinstance(event, ShardCorrupt):
        return _shard_corrupt(run, event.shard)
    if isinstance(event, ShardFound):
        return replace(run, written=run.written | {event.shard})
    if isinstance(event, RunSettings):
        return replace(run, hybrid=event.hybrid, replace_timeout_s=event.replace_timeout_s,
                       max_restarts=event.max_restarts, max_shard_retries=event.max_shard_retries)
    if isinstance(event, Eligible):
        task = run.tasks.get(event.task_id)
        return run if task is None or task.state != "waiting" else _put(run, replace(task, eligible=event.node_ids))
    if isinstance(event, NodeLost):
        for task in [t for t in run.tasks.values() if t.node_id == event.node_id and t.state in ("placed", "running")]:
            run = apply(TaskFailed(task.task_id, f"its node {event.node_id} was lost", True, task.attempt), run)
        return run
    if isinstance(event, Queued):
        return _queued(run, event)
    task = _current(run, event.task_id, event.attempt)
    if task is None:
        return run
    if isinstance(event, TaskPlaced):
        return _put(run, replace(task, state="placed", node_id=event.node_id, no_node_since=None))
    if isinstance(event, TaskStarted):
        return _put(run, replace(task, state="running", unstarted_since=None))
    if isinstance(event, NotStarted):
        return _not_started(run, event)
    if isinstance(event, ShardWritten):
        return _put(run, replace(task, state="running", done=task.done | {event.shard}),
                    written=run.written | {event.shard})
    if isinstance(event, StudentProgress):
        return _put(run, replace(task, state="running", unstarted_since=None, step=max(task.step, event.step),
                                 max_steps=event.max_steps))
    if isinstance(event, TaskEnded):
        return _put(run, replace(task, state=event.state, node_id=None))
    return _failed(run, task, event)


def _not_started(run: DistillRun, event: NotStarted) -> DistillRun:
    """The group of `event.task_id` back to waiting, its placement undone (a new attempt, no restart spent),
    unless a member has started (a start is not undone). Under a pause or cancel it waits too: `plan` then
    ends the run once no task is placed."""
    members = run.members(event.task_id)
    if any(m.state != "placed" or m.attempt != event.attempt for m in members):
        return run
    again = [replace(m, state="waiting", node_id=None, attempt=m.attempt + 1, no_node_since=None,
                     unstarted_since=min(m.unstarted_since or event.at, event.at), unstarted=m.unstarted + 1)
             for m in members]
    return _put(run, *again)


def _queued(run: DistillRun, event: Queued) -> DistillRun:
    tasks = []
    for tid in event.task_ids:
        task = run.tasks.get(tid)
        if task is not None and task.state == "waiting":
            since = min(task.no_node_since or event.at, event.at) if event.unplaceable else None
            tasks.append(replace(task, no_node_since=since))
    return _put(run, *tasks)


def _shard_corrupt(run: DistillRun, shard: int) -> DistillRun:
    """A shard that failed its checksum at a student: not written any more, regenerated by a new teacher."""
    if shard not in run.written:
        return run  # already being regenerated
    writer = next((t for t in run.tasks.values() if t.kind == "teacher" and shard in t.done), None)
    teacher = Task(task_id=f"teacher-{run.teachers_made}", kind="teacher", shards=(shard,),
                   cpus=writer.cpus if writer else 1.0, eligible=writer.eligible if writer else None)
    return _put(run, teacher, written=run.written - {shard}, teachers_made=run.teachers_made + 1)


def _failed(run: DistillRun, task: Task, event: TaskFailed) -> DistillRun:
    if task.kind == "teacher":
        return _teacher_failed(run, task, event)
    members = run.members(task.task_id)
    if len(members) > 1 and members[0].state == "completed":  # trained and written: its part is in the adapter
        return _put(run, replace(task, state="completed", node_id=None))
    subject = task.task_id if len(members) == 1 else f"group:{members[0].task_id}"
    policy = FailurePolicy(run.max_restarts, counts=dict(run.failures))
    decision = policy.on_failure(f"{task.task_id} " + ("lost its worker" if event.worker_lost else "failed")
                                 + f": {event.error}", subject=subject, retryable=event.worker_lost,
                                 checkpoint=event.checkpoint)
    run = replace(run, failures=policy.counts)
    if decision.retry and not run.stop:
        gone = event.worker_lost and event.node_gone and task.node_id
        lost = frozenset({task.node_id}) if gone else frozenset()
        again = [replace(m, state="waiting", node_id=None, attempt=m.attempt + 1, restarts=decision.attempt,
                         lost_nodes=m.lost_nodes | lost, error=decision.reason, no_node_since=None) for m in members]
        return _put(run, *again)
    ended = [replace(m, state="failed", node_id=None, error=decision.reason) for m in members if m.state in ACTIVE]
    return _put(run, *ended)


def shards_to_retry(shards: Sequence[int], retries: dict[int, int], max_retries: int) -> tuple[list[int], dict[int, int]]:
    """A failed teacher's unfinished shards: those still within `max_retries` (each one's count so far
    in `retries`), and the counts with theirs bumped. None left: the store fails."""
    again = [s for s in shards if retries.get(s, 0) < max_retries]
    return again, {**retries, **{s: retries.get(s, 0) + 1 for s in again}}


def _teacher_failed(run: DistillRun, task: Task, event: TaskFailed) -> DistillRun:
    """The teacher ends failed; its unfinished shards go to a new teacher, each within its retries."""
    failed = replace(task, state="failed", node_id=None, error=event.error)
    left = [s for s in task.shards if s not in task.done]
    if not left or run.stop:
        return _put(run, failed)
    again, retries = shards_to_retry(left, run.shard_retries, run.max_shard_retries)
    if not again:
        return _put(run, failed, store_failed=f"teacher failed on shards {left}: {event.error}")
    retry = Task(task_id=f"teacher-{run.teachers_made}", kind="teacher", cpus=task.cpus, shards=tuple(again),
                 eligible=task.eligible, exclude=task.node_id)
    return _put(run, failed, retry, shard_retries=retries, teachers_made=run.teachers_made + 1)


def started(run: DistillRun) -> bool:
    """Whether what the run holds shows in Ray's table: some task is placed and every placed one has started
    (`running`: a group once Ray has a worker for each member, a teacher at its first shard, a lone student
    at its first step). A job runner's queue claim goes then (`runner.DistillRunner._mirror`), not when a task
    is merely placed: Ray shows an actor's CPUs only once it has a worker, and a claim dropped before let
    the queue start a second students stage into the same CPUs (stop 54's demo)."""
    placed = [t for t in run.tasks.values() if t.state in ("placed", "running")]
    return bool(placed) and all(t.state == "running" for t in placed)


# -- plan ------------------------------------------------------------------------------------------


def plan(run: DistillRun, nodes: Sequence[Any], now: float, held: Mapping[str, float] | None = None) -> list[Action]:
    """What to do now, given the live `nodes` (`distill_placement.Node`s) and the time `now` (s).
    `held`: the CPUs already held on each node id, the run's own tasks included (a stage's session
    shares the nodes with other jobs); None: the run's own placed tasks only.

    In order: once a pause or cancel is asked, stop every placed task and end the run when none is
    left; give up on students whose store failed, or that no node could run for `replace_timeout_s`
    (the driver answers a `GiveUp` with a `TaskFailed(worker_lost=False)` per task); place waiting
    teachers, then waiting students and groups (all members or none), else `Wait`; end the run when
    every student has ended (a run without students: when its teachers have).
    """
    active = [t for t in run.tasks.values() if t.state in ACTIVE]
    if run.stop:
        placed = tuple(t.task_id for t in active if t.state != "waiting")
        if placed:
            return [Stop(placed, run.stop)]
        return [RunEnded("paused" if run.stop == "pause" else "cancelled", f"{run.stop} asked")]
    doomed = _doomed(run, now)
    if doomed is not None:
        return [doomed]
    ended = _ended(run)
    if ended is not None:
        return [ended]
    busy = dict(held) if held is not None else own_cpus((t.node_id, t.cpus) for t in active)
    teachers = {t.node_id for t in active if t.kind == "teacher" and t.node_id}
    actions: list[Action] = []
    for t in (t for t in active if t.kind == "teacher" and t.state == "waiting"):
        eligible = [n for n in nodes if t.eligible is None or n.node_id in t.eligible]
        if eligible:
            # a failed teacher's shards: not where it failed; a corrupt shard's: the least busy node
            node = retry_teacher_node(eligible, t.exclude) if t.exclude else freest_node(eligible, busy)
            busy[node.node_id] = busy.get(node.node_id, 0.0) + t.cpus
            actions.append(Place((t.task_id,), (node.node_id,), t.attempt))
    seen: set[str] = set()
    for t in (t for t in active if t.kind == "student" and t.state == "waiting"):
        members = run.members(t.task_id)
        if t.task_id in seen or any(m.state != "waiting" for m in members):
            continue
        seen.update(m.task_id for m in members)
        actions.append(_place_students(run, members, nodes, busy, teachers))
    return actions


def _place_students(run: DistillRun, members: list[Task], nodes: Sequence[Any], busy: dict[str, float],
                    teachers: set[str]) -> Action:
    """A waiting student or group: `Place` on nodes (their CPUs added to `busy`), or `Wait`."""
    eligible = [[n for n in nodes if (m.eligible is None or n.node_id in m.eligible) and n.node_id not in m.lost_nodes]
                for m in members]
    picks = pick_group_nodes([(m.cpus, e) for m, e in zip(members, eligible)], busy, teachers, run.hybrid)
    ids = tuple(m.task_id for m in members)
    if picks is None:
        return Wait(ids, not hosts(members[0].cpus, len(members), [n.cpus for n in eligible[0]]))
    for m, n in zip(members, picks):
        busy[n.node_id] = busy.get(n.node_id, 0.0) + m.cpus
    return Place(ids, tuple(n.node_id for n in picks), members[0].attempt)


def _ended(run: DistillRun) -> RunEnded | None:
    """The run's end, once every student has ended (without students: every teacher)."""
    students = [t for t in run.tasks.values() if t.kind == "student"]
    if students:
        if any(t.state in ACTIVE for t in students):
            return None
        bad = [t for t in students if t.state != "completed"]
        if bad:
            return RunEnded("failed", f"{bad[0].task_id} {bad[0].state}: {bad[0].error}")
        return RunEnded("completed", f"{len(students)} students completed")
    if any(t.state in ACTIVE for t in run.tasks.values()) or not run.tasks:
        return None
    missing = sorted(set(range(run.num_shards)) - run.written)
    if missing or run.store_failed:
        return RunEnded("failed", run.store_failed or f"shards {missing} were not written")
    return RunEnded("completed", f"{run.num_shards} shards written")


def _doomed(run: DistillRun, now: float) -> GiveUp | None:
    """Students that cannot go on: their store failed, or no node could run them for replace_timeout_s."""
    active = [t for t in run.tasks.values() if t.kind == "student" and t.state in ACTIVE]
    if run.store_failed and active:
        return GiveUp(tuple(t.task_id for t in active), run.store_failed)
    late = [t for t in active if t.state == "waiting" and t.no_node_since is not None
            and now - t.no_node_since >= run.replace_timeout_s]
    if late:
        return GiveUp(tuple(t.task_id for t in late),
                      f"no node could run it for {run.replace_timeout_s:.0f}s: join a worker that holds the model, "
                      "then rerun; its last checkpoint is kept")
    unstarted = [t for t in active if t.state == "waiting" and t.unstarted_since is not None
                 and now - t.unstarted_since >= run.replace_timeout_s]
    if not unstarted:
        return None
    return GiveUp(tuple(t.task_id for t in unstarted),
                  f"placed {unstarted[0].unstarted} times, it did not start within {run.replace_timeout_s:.0f}s: Ray "
                  "had no CPUs for its actors there (other jobs' tasks hold them); free CPUs on the workers, then "
                  "rerun; its last checkpoint is kept")
