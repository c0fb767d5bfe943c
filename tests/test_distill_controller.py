"""The distillation controller without Ray: event sequences in, plans out (controller.py), and the
pure "which node" rules (cluster/control/distill_placement.py).

Each test folds a sequence of events with `apply` and asserts what `plan` says: every failure case
(a teacher that fails, past its shard retries; a student whose worker is lost, past its budget; an
error of its own; a ddp group's lost rank; a lost node; no node for `replace_timeout_s`; a corrupt
shard; pause and cancel) and a property: no event sequence leaves a task both running and restarted.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from smolforge.cluster.control.distill_placement import (own_cpus, freest_node, hosts, pick_group_nodes,
                                                         retry_teacher_node, teacher_nodes)
from smolforge.cluster.workloads.distill.controller import (
    ACTIVE, CancelAsked, DistillRun, Eligible, GiveUp, NodeLost, NotStarted, PauseAsked, Place, Queued, RunEnded, RunSettings,
    ShardCorrupt, ShardFound, ShardWritten, Stop, StudentProgress, Task, TaskAdded, TaskEnded, TaskFailed, TaskPlaced, TaskStarted, Wait,
    apply, plan, started,
)


@dataclass(frozen=True)
class N:
    node_id: str
    cpus: float = 2.0
    gpus: float = 0.0

    @property
    def name(self) -> str:
        return self.node_id


A, B, C = N("a"), N("b"), N("c")


def run_of(*events, **fields) -> DistillRun:
    return reduce(lambda run, ev: apply(ev, run), events, DistillRun(**fields))


def teacher(tid="teacher-0", shards=(0, 1)) -> TaskAdded:
    return TaskAdded(Task(task_id=tid, kind="teacher", shards=tuple(shards)))


def student(tid, group=None, cpus=1.0) -> TaskAdded:
    return TaskAdded(Task(task_id=tid, kind="student", group=group, cpus=cpus))


# -- placement, rotation and the end of a run ------------------------------------------------------


def test_a_run_places_teacher_then_students_and_ends_when_the_students_have():
    run = run_of(teacher(), student("student-0"), student("student-1"), num_shards=2)
    acts = plan(run, [A, B], now=0)
    assert acts[0] == Place(("teacher-0",), ("a",), 0)
    # the teacher's CPU counts: the students go to the freest nodes, b then a
    assert acts[1:] == [Place(("student-0",), ("b",), 0), Place(("student-1",), ("a",), 0)]
    run = run_of(TaskPlaced("teacher-0", "a", 0), TaskPlaced("student-0", "b", 0), TaskPlaced("student-1", "a", 0),
                 ShardWritten("teacher-0", 0, 0), ShardWritten("teacher-0", 1, 0), TaskEnded("teacher-0", "completed", 0),
                 StudentProgress("student-0", 3, 5, 0), TaskEnded("student-0", "completed", 0), **vars_of(run))
    assert plan(run, [A, B], now=0) == []
    run = apply(TaskEnded("student-1", "completed", 0), run)
    assert plan(run, [A, B], now=0) == [RunEnded("completed", "2 students completed")]
    assert run.written == {0, 1} and run.tasks["student-0"].step == 3


def vars_of(run: DistillRun) -> dict:
    return {f: getattr(run, f) for f in run.__dataclass_fields__}


def test_a_busy_cluster_queues_a_student_until_a_teacher_frees_its_node():
    small = N("a", cpus=1.0)
    run = run_of(teacher(), student("student-0"), TaskPlaced("teacher-0", "a", 0), num_shards=2)
    assert plan(run, [small], now=0) == [Wait(("student-0",), False)]  # busy, not unplaceable
    run = apply(TaskEnded("teacher-0", "completed", 0), run)
    assert plan(run, [small], now=0) == [Place(("student-0",), ("a",), 0)]  # rotation


def test_hybrid_keeps_students_off_a_running_teachers_node():
    run = run_of(teacher(), student("student-0"), TaskPlaced("teacher-0", "a", 0), num_shards=2, hybrid=True)
    assert plan(run, [A], now=0) == [Wait(("student-0",), False)]
    assert plan(run, [A, B], now=0) == [Place(("student-0",), ("b",), 0)]


def test_a_group_starts_whole_or_waits_and_fails_once_no_node_could_run_it():
    run = run_of(student("student-0", group="student-0"), student("student-1", group="student-0"),
                 replace_timeout_s=10)
    assert plan(run, [A], now=0) == [Place(("student-0", "student-1"), ("a", "a"), 0)]  # 2 CPUs hold both
    one = N("a", cpus=1.0)
    assert plan(run, [one], now=0) == [Wait(("student-0", "student-1"), True)]  # too few CPUs even idle
    run = apply(Queued(("student-0", "student-1"), at=100.0, unplaceable=True), run)
    assert plan(run, [one], now=105) == [Wait(("student-0", "student-1"), True)]
    run = apply(Queued(("student-0", "student-1"), at=105.0, unplaceable=True), run)  # still: the clock runs on
    give_up = plan(run, [one], now=110)
    assert isinstance(give_up[0], GiveUp) and give_up[0].task_ids == ("student-0", "student-1")
    run = reduce(lambda r, t: apply(TaskFailed(t, give_up[0].reason, False, 0), r), give_up[0].task_ids, run)
    assert [a.state for a in plan(run, [one], now=110) if isinstance(a, RunEnded)] == ["failed"]


def test_a_group_placed_that_does_not_start_waits_again_without_a_restart_then_starts():
    """Two stage jobs placed groups on the same 2 CPUs before Ray's table showed either: the group whose
    rank 0 Ray could not start goes back to waiting (its placement undone, a new attempt, no restart
    spent), is placed again once its node frees, and starts; one that never starts fails by replace_timeout_s."""
    g = "student-0"
    added = [student("student-0", group=g), student("student-1", group=g)]
    run = run_of(*added, replace_timeout_s=60, max_restarts=2)
    first = plan(run, [A], now=0)
    assert first == [Place(("student-0", "student-1"), ("a", "a"), 0)]
    run = run_of(TaskPlaced("student-0", "a", 0), TaskPlaced("student-1", "a", 0), **vars_of(run))
    assert not started(run)  # placed only: Ray's table may not show it yet, so the queue's claim holds
    run = apply(NotStarted("student-0", 0, at=30.0), run)
    assert [(run.tasks[t].state, run.tasks[t].node_id, run.tasks[t].attempt, run.tasks[t].restarts)
            for t in ("student-0", "student-1")] == [("waiting", None, 1, 0)] * 2
    assert run.failures == {} and run.tasks["student-0"].unstarted_since == 30.0
    assert plan(run, [A], now=31, held={"a": 2.0}) == [Wait(("student-0", "student-1"), False)]  # the other group's
    assert apply(NotStarted("student-0", 0, at=40.0), run) == run  # the undone attempt's late news: stale
    again = plan(run, [A], now=50, held={"a": 0.0})  # the other group ended: its CPUs are free
    assert again == [Place(("student-0", "student-1"), ("a", "a"), 1)]
    run = run_of(TaskPlaced("student-0", "a", 1), TaskPlaced("student-1", "a", 1), TaskStarted("student-0", 1),
                 **vars_of(run))
    assert apply(NotStarted("student-0", 1, at=55.0), run) == run  # a member started: a start is not undone
    assert not started(run)  # one member of two
    run = apply(TaskStarted("student-1", 1), run)
    assert [(run.tasks[t].state, run.tasks[t].unstarted_since) for t in ("student-0", "student-1")] == [("running", None)] * 2
    assert started(run)  # the claim can go
    never = apply(NotStarted("student-0", 1, at=40.0), run_of(*added, TaskPlaced("student-0", "a", 0),
                                                               TaskPlaced("student-1", "a", 0),
                                                               NotStarted("student-0", 0, at=30.0),
                                                               TaskPlaced("student-0", "a", 1), TaskPlaced("student-1", "a", 1),
                                                               replace_timeout_s=60))
    assert plan(never, [A], now=89, held={"a": 2.0}) == [Wait(("student-0", "student-1"), False)]
    gave_up = plan(never, [A], now=90, held={"a": 2.0})  # 60 s since it was first placed and did not start
    assert gave_up == [GiveUp(("student-0", "student-1"), gave_up[0].reason)] and "placed 2 times" in gave_up[0].reason


def test_a_starting_groups_wait_ends_met_only_once_ray_has_every_member_and_sooner_when_it_has_none():
    """`sync.start_verdict`, the session's one look at a placed group (`DataParallelSync.rendezvous`): met
    once rank 0 answered and Ray has a worker for every member; back to waiting when Ray has had no CPUs for
    a member for UNSCHEDULED_S (shorter than START_S, the bound on a started process that never answers)."""
    from smolforge.cluster.workloads.distill.sync import START_S, UNSCHEDULED_S, start_verdict

    assert UNSCHEDULED_S < START_S
    assert start_verdict(True, None, 3.0) == "met"
    assert start_verdict(True, 0.0, 3.0) == "wait"  # rank 0 answered, rank 1 has no CPUs yet: not met
    assert start_verdict(False, UNSCHEDULED_S - 1, 30.0) == "wait"
    assert start_verdict(True, UNSCHEDULED_S, 30.0) == "not_started"
    assert start_verdict(False, None, START_S - 1) == "wait"  # every member has its worker: rank 0 imports
    assert start_verdict(False, None, START_S) == "timeout"


# -- failures ----------------------------------------------------------------------------------------


def test_a_failed_teacher_hands_its_unfinished_shards_to_another_node_until_their_retries_run_out():
    run = run_of(teacher(shards=(0, 1)), student("student-0"), TaskPlaced("teacher-0", "a", 0),
                 ShardWritten("teacher-0", 0, 0), TaskFailed("teacher-0", "OOM", True, 0),
                 num_shards=2, max_shard_retries=1)
    retry = run.tasks["teacher-1"]
    assert retry.shards == (1,) and retry.exclude == "a" and run.shard_retries == {1: 1}
    assert plan(run, [A, B], now=0)[0] == Place(("teacher-1",), ("b",), 0)  # not where it failed
    run = apply(TaskPlaced("teacher-1", "b", 0), run)
    run = apply(TaskFailed("teacher-1", "OOM again", True, 0), run)
    assert "teacher-2" not in run.tasks and "shards [1]" in run.store_failed
    acts = plan(run, [A, B], now=0)
    assert acts == [GiveUp(("student-0",), run.store_failed)]


def test_a_lost_student_restarts_from_its_checkpoint_within_the_one_budget_then_fails():
    run = run_of(student("student-0"), TaskPlaced("student-0", "a", 0), TaskStarted("student-0", 0), max_restarts=1)
    run = apply(TaskFailed("student-0", "worker died", True, 0, checkpoint="step_4"), run)
    t = run.tasks["student-0"]
    assert (t.state, t.attempt, t.restarts, t.lost_nodes) == ("waiting", 1, 1, frozenset({"a"}))
    assert plan(run, [A, B], now=0) == [Place(("student-0",), ("b",), 1)]  # never on the node it was lost on
    stale = apply(TaskStarted("student-0", 0), run)  # the old attempt's late news changes nothing
    assert stale == run
    run = reduce(lambda r, e: apply(e, r), [TaskPlaced("student-0", "b", 1), TaskFailed("student-0", "died", True, 1)], run)
    assert run.tasks["student-0"].state == "failed" and "gave up after 2 failures" in run.tasks["student-0"].error
    assert plan(run, [A, B], now=0)[0].state == "failed"


def test_an_error_of_the_students_own_is_not_retried():
    run = run_of(student("student-0"), TaskPlaced("student-0", "a", 0),
                 TaskFailed("student-0", "bad data", False, 0))
    assert run.tasks["student-0"].state == "failed" and "not retried" in run.tasks["student-0"].error
    assert run.failures == {"student-0": 1}


def test_a_group_that_loses_a_rank_restarts_whole_on_one_budget():
    g = "student-0"
    run = run_of(student("student-0", group=g), student("student-1", group=g),
                 TaskPlaced("student-0", "a", 0), TaskPlaced("student-1", "b", 0), NodeLost("b"), max_restarts=2)
    assert [run.tasks[t].state for t in ("student-0", "student-1")] == ["waiting", "waiting"]
    assert run.failures == {"group:student-0": 1}  # one failure for the group, though two ranks ended
    assert plan(run, [A], now=0) == [Place(("student-0", "student-1"), ("a", "a"), 1)]


def test_a_rank_lost_after_its_group_finished_counts_as_completed_else_the_group_restarts_whole():
    g = "student-0"
    placed = [student("student-0", group=g), student("student-1", group=g),
              TaskPlaced("student-0", "a", 0), TaskPlaced("student-1", "b", 0)]
    run = run_of(*placed, TaskEnded("student-0", "completed", 0), TaskFailed("student-1", "gone", True, 0))
    assert [run.tasks[t].state for t in ("student-0", "student-1")] == ["completed", "completed"]
    assert run.failures == {}  # nothing to retry: the group's adapter is written
    run = run_of(*placed, TaskEnded("student-1", "completed", 0), TaskFailed("student-0", "gone", True, 0))
    assert [(run.tasks[t].state, run.tasks[t].attempt) for t in ("student-0", "student-1")] == [("waiting", 1)] * 2


def test_a_lost_node_fails_its_teacher_and_restarts_its_student():
    run = run_of(teacher(shards=(0,)), student("student-0"), TaskPlaced("teacher-0", "a", 0),
                 TaskPlaced("student-0", "a", 0), NodeLost("a"), num_shards=1)
    assert run.tasks["teacher-0"].state == "failed" and run.tasks["teacher-1"].shards == (0,)
    assert run.tasks["student-0"].state == "waiting" and "a" in run.tasks["student-0"].lost_nodes
    assert plan(run, [B], now=0) == [Place(("teacher-1",), ("b",), 0), Place(("student-0",), ("b",), 1)]


def test_a_corrupt_shard_is_regenerated_once():
    run = run_of(teacher(shards=(0,)), TaskPlaced("teacher-0", "a", 0), ShardWritten("teacher-0", 0, 0),
                 TaskEnded("teacher-0", "completed", 0), ShardCorrupt(0), ShardCorrupt(0), num_shards=1)
    assert run.written == frozenset() and [t for t in run.tasks if t.startswith("teacher")] == ["teacher-0", "teacher-1"]


def test_pause_stops_every_placed_task_and_the_run_ends_paused_once_they_have():
    run = run_of(student("student-0"), student("student-1"), TaskPlaced("student-0", "a", 0), PauseAsked(), CancelAsked())
    assert run.stop == "pause"  # the first stop asked stands
    assert plan(run, [A], now=0) == [Stop(("student-0",), "pause")]
    run = apply(TaskEnded("student-0", "paused", 0), run)
    assert plan(run, [A], now=0) == [RunEnded("paused", "pause asked")]


def test_a_lost_worker_during_a_cancel_is_not_restarted():
    run = run_of(student("student-0"), TaskPlaced("student-0", "a", 0), CancelAsked(),
                 TaskFailed("student-0", "killed", True, 0))
    assert run.tasks["student-0"].state == "failed"
    assert plan(run, [A], now=0) == [RunEnded("cancelled", "cancel asked")]


# -- the property ------------------------------------------------------------------------------------

IDS = ("teacher-0", "student-0", "student-1", "student-2")
event = st.one_of(
    st.builds(TaskPlaced, st.sampled_from(IDS), st.sampled_from("ab"), st.integers(0, 3)),
    st.builds(TaskStarted, st.sampled_from(IDS), st.integers(0, 3)),
    st.builds(NotStarted, st.sampled_from(IDS), st.integers(0, 3), st.floats(0, 10)),
    st.builds(ShardWritten, st.sampled_from(IDS), st.integers(0, 2), st.integers(0, 3)),
    st.builds(StudentProgress, st.sampled_from(IDS), st.integers(0, 9), st.just(9), st.integers(0, 3)),
    st.builds(TaskEnded, st.sampled_from(IDS), st.sampled_from(["completed", "paused", "cancelled"]), st.integers(0, 3)),
    st.builds(TaskFailed, st.sampled_from(IDS), st.just("x"), st.booleans(), st.integers(0, 3)),
    st.builds(NodeLost, st.sampled_from("ab")),
    st.builds(ShardCorrupt, st.integers(0, 2)),
    st.builds(Queued, st.tuples(st.sampled_from(IDS)), st.floats(0, 10), st.booleans()),
    st.just(PauseAsked()),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(event, max_size=30))
@example([TaskPlaced("student-0", "a", 0), NotStarted("student-0", 0, 1.0), TaskPlaced("student-0", "b", 1)])
@example([TaskPlaced("student-1", "a", 0), TaskPlaced("student-2", "b", 0), NotStarted("student-2", 0, 1.0)])
def test_no_event_sequence_leaves_a_task_both_running_and_restarted(events):
    run = run_of(teacher(shards=(0, 1, 2)), student("student-0"), student("student-1", group="student-1"),
                 student("student-2", group="student-1"), num_shards=3, max_restarts=2)
    for ev in events:
        before = run
        run = apply(ev, run)
        for tid, t in run.tasks.items():
            old = before.tasks.get(tid)
            if old is not None and t.attempt > old.attempt:  # restarted by this event: not running, nowhere
                assert t.state == "waiting" and t.node_id is None
            elif old is not None and old.state not in ACTIVE:  # an ended task comes back only restarted
                assert t == old
        placing = [tid for a in plan(run, [A, N("b")], now=20) if isinstance(a, Place) for tid in a.task_ids]
        assert len(placing) == len(set(placing))  # one start per task per plan
        assert all(run.tasks[tid].state == "waiting" for tid in placing)  # never a running one again


# -- the pure placement rules ------------------------------------------------------------------------


def test_placement_rules_without_a_cluster():
    assert own_cpus([("a", 1.0), (None, 4.0), ("a", 0.5), ("b", 1.0)]) == {"a": 1.5, "b": 1.0}
    assert hosts(1.0, 3, [2.0, 1.0]) and not hosts(1.5, 2, [2.0, 1.0])
    gpu = N("g", cpus=2.0, gpus=1.0)
    assert pick_group_nodes([(1.0, [A, gpu])], {}, set()) == [gpu]  # GPU nodes first
    assert pick_group_nodes([(2.0, [A]), (2.0, [A])], {}, set()) is None  # all members or none
    assert pick_group_nodes([(1.0, [A, B]), (1.0, [A, B])], {"a": 1.0}, set()) == [B, A]  # B took one: a tie, by name
    assert teacher_nodes([A, B], 3) == [A, B, A]
    assert retry_teacher_node([A, B], "a") is B and retry_teacher_node([A], "a") is A
    assert freest_node([A, B], {"a": 1.0}) is B


# -- what the live session tells the run (decide.py) ---------------------------------------------------


def test_what_the_session_tells_the_run_a_live_node_held_cpus_and_the_earliest_no_node():
    run = run_of(student("student-0"), TaskPlaced("student-0", "a", 0),
                 TaskFailed("student-0", "worker died", True, 0, node_gone=False))
    assert run.tasks["student-0"].lost_nodes == frozenset()  # only its process died: a may take it again
    assert plan(run, [A], now=0) == [Place(("student-0",), ("a",), 1)]
    assert plan(run, [A, B], now=0, held={"a": 2.0}) == [Place(("student-0",), ("b",), 1)]  # a is full (another job)
    run = apply(Eligible("student-0", frozenset({"b"})), run)
    assert plan(run, [A, B], now=0) == [Place(("student-0",), ("b",), 1)]
    run = run_of(student("student-0"), Queued(("student-0",), 50, True), Queued(("student-0",), 20, True),
                 RunSettings(False, 30.0, 2))
    assert run.tasks["student-0"].no_node_since == 20 and plan(run, [], now=50)[0] == GiveUp(
        ("student-0",), plan(run, [], now=50)[0].reason)


def test_a_corrupt_shard_found_on_disk_is_regenerated_by_a_teacher_on_the_least_busy_node():
    run = run_of(teacher(shards=(1,)), TaskPlaced("teacher-0", "a", 0), ShardFound(0), ShardCorrupt(0),
                 num_shards=2)
    assert run.tasks["teacher-1"].shards == (0,) and 0 not in run.written
    assert plan(run, [A, B], now=0)[0] == Place(("teacher-1",), ("b",), 0)  # a runs teacher-0
