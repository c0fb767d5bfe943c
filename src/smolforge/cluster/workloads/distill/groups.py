"""A `--students-sync ddp` student group: how it forms, and how it heals when it loses a rank.

A group that loses a rank (its process or its node died) restarts WHOLE, from the group's last kept
checkpoint (its leader's, `student_N/checkpoints/`), at its own world size, on whichever nodes can run
its members now, within the run's student restarts (`FailurePolicy`, one budget for the group).
Why not re-form on the ranks left, as a `diloco` data-parallel job does: a ddp group's ranks share
every step's rows (rank r takes slice r of the global batch) and every step's gradients, so a smaller
group is a different run (another global batch, other rows per rank), and its ranks would have to
agree on where to go on from inside a broken collective. The restart keeps the world, the rows and
the optimizer state as they were at the checkpoint, so it ends where an undisturbed run ends; it
costs the steps since that checkpoint and a model load per rank.

A group whose members no live nodes could hold at once (too few nodes hold the model, or they have
too few CPUs) waits for nodes to join, and fails, saying why, after `replace_timeout_s`
(`_unplaceable_why`); one merely busy waits like any queued student.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from smolforge.cluster.nodes import ray_glue
from smolforge.cluster.workloads.distill.controller import TaskFailed
from smolforge.cluster.workloads.distill.state import DistillTask, short_error
from smolforge.cluster.workloads.distill.task_plans import group_seat
from smolforge.train import checkpoint as ckpt

LOST_PEER_GRACE_S = 10.0  # a rank whose collective broke: how long to look for the peer whose worker died


def node_gone(node_id: str | None) -> bool:
    """Whether the node of a lost worker is gone: the run never places there again (`TaskFailed.node_gone`).
    The one verdict every runner asks (`ray_glue.probe_node`, which gives a live node whose only worker
    just died `ray_glue.NODE_VERDICT_S` to start a new one: a 4 s probe once called such a node gone and
    the ddp group of 2, left 1 eligible worker, waited as unplaceable: CI's "did not finish within 300s")."""
    return bool(node_id) and not ray_glue.probe_node(node_id, timeout=ray_glue.NODE_VERDICT_S)


class StudentGroups:
    """The student groups (a mixin of StudentTasks): forming one, and what a lost rank does to it."""

    def _form_group(self, group: dict[str, Any] | None) -> None:
        """Make the students named in `group` one data-parallel group (see `sync.py`): each member
        knows its group rank; only the first writes the adapter (its `student_N/`), and every member
        resumes from the first's checkpoint (all ranks hold the same weights)."""
        if group is None:
            return
        st = self._dstate()
        members = [st.tasks[t] for t in group["members"]]
        leader = members[0]
        for i, task in enumerate(members):
            task.plan = replace(task.plan, group=group_seat(group, i, task.plan.config.device))
            if not task.plan.config.max_steps:  # steps from the rows: each step takes world × batch
                task.max_steps = max(1, -(-task.max_steps // group["world"]))
            if i:
                task.output_dir = None  # one adapter for the group: the leader's
                task.plan, task.resumed_step = replace(task.plan, resume=leader.plan.resume), leader.resumed_step
        self._devent("student_group", f"{', '.join(group['members'])} train as one {group['strategy']} group of "
                     f"{group['world']} over shards {group['shards']}; one adapter in {leader.output_dir}",
                     members=group["members"], strategy=group["strategy"], output_dir=leader.output_dir)

    def _members(self, task: DistillTask) -> list[DistillTask]:
        """The students that start and stop together with `task`: its group, or itself alone."""
        seat = task.seat
        return [self._dstate().tasks[t] for t in seat.members] if seat else [task]

    def _unplaceable_why(self, task: DistillTask, limit: float) -> str:
        """Why a student that no live nodes could run for `limit` seconds fails (the monitor's verdict)."""
        model = task.plan.config.base_model
        members = self._members(task)
        if len(members) == 1:
            return (f"no node could run it for {limit:.0f}s (it needs {task.cpus:g} free CPUs and model "
                    f"{model}): join a worker that holds the model, then rerun; its last checkpoint is kept")
        seat = task.seat
        return (f"no nodes could run its {seat.strategy} student group ({', '.join(seat.members)}) for "
                f"{limit:.0f}s: its {len(members)} ranks need {task.cpus:g} CPUs each at once on live nodes that "
                f"hold {model}; join workers that hold the model, then rerun with --resume (the group's last "
                "checkpoint is kept)")

    def _group_member_failed(self, task: DistillTask, ref, err: BaseException) -> bool:
        """A rank of a group ended with `err`: the group restarts whole from its last checkpoint when a
        rank was lost (`_restart_group`), or fails at once, every member saying why (its other ranks
        would only wait in their next collective). Returns whether `task` ended here (False: the
        group restarted, or this is the stale end of a run of the group that is already over)."""
        st = self._dstate()
        members = self._members(task)
        with st.lock:  # two ranks of a group may end at once: the first one's end decides
            if (st.handles.get(task.task_id) or (None, None))[1] is not ref or task.state not in ("pending", "running"):
                return False
            actors = [st.handles[m.task_id][0] for m in members if m.task_id in st.handles]
            refs = {m.task_id: st.handles[m.task_id][1] for m in members if m.task_id in st.handles}
            for m in members:  # this run of the group is over: its members' later ends are stale
                if m.task_id in st.handles:
                    st.handles[m.task_id] = (st.handles[m.task_id][0], None)
        lost = task if self._worker_lost(err) else self._lost_peer(task, members, refs)
        error = short_error(err)
        if lost is not None:
            what = f"on {lost.node}" + ("" if lost is task else f" (rank {task.seat.rank}: {error})")
        else:
            what = error
        who = lost or task
        latest = ckpt.latest_checkpoint(members[0].output_dir)
        gone = lost is not None and node_gone(lost.node_id)
        # The verdict and the restart it asks for as one step: from the verdict on the run holds the
        # members "waiting", and a plan of another thread (the monitor's every PLACEMENT_POLL_S) would
        # start the group while this one still resets it (`SessionState.placing`).
        with st.placing:
            run = self._record(TaskFailed(who.task_id, what, lost is not None, who.attempt,
                                          latest.name if latest else None, gone))
            verdict = run.tasks[who.task_id]
            if verdict.state == "completed":  # its leader had written the adapter: this rank's part is in it
                task.state, task.progress, task.finished = "completed", 1.0, time.time()
                self._devent("student_finished", f"{task.task_id} lost its worker after its group finished; "
                             f"the group's adapter is {members[0].task_id}'s", task_id=task.task_id, node=task.node)
                return True
            for actor in actors:
                self._kill_quietly(actor)
            why = verdict.error or what
            if verdict.state == "waiting" and not st.closing:
                try:
                    self._restart_group(members, who, why, verdict.restarts, gone)
                    return False
                except Exception as again:  # the restart itself failed: the group ends, saying why
                    why = f"{why}; restarting the group failed: {short_error(again)}"
                    self._record(TaskFailed(who.task_id, why, False, verdict.attempt))
        self._fail_group(members, f"{why}; a data-parallel group cannot go on without a rank (rerun with --resume "
                                  "to continue from the group's last checkpoint)")
        return True

    def _lost_peer(self, me: DistillTask, members: list[DistillTask], refs: dict[str, Any]) -> DistillTask | None:
        """`me` ended with an error of its own. In a group that is most often how a rank hears that a
        peer died (its collective broke): the member whose worker or node is gone, if one is."""
        import ray

        others = [(m, refs[m.task_id]) for m in members if m is not me and refs.get(m.task_id) is not None]
        if not others:
            return None
        ready, _ = ray.wait([r for _, r in others], num_returns=len(others), timeout=LOST_PEER_GRACE_S)
        for m, r in others:
            if r in ready:
                try:
                    ray.get(r, timeout=5)
                except Exception as err:  # noqa: BLE001 (any end: only a lost worker counts)
                    if self._worker_lost(err):
                        return m
        for m, _ in others:  # Ray takes ~15 s to call a silent node dead; a probe answers at once
            if m.node_id and not ray_glue.probe_node(m.node_id, timeout=4):
                return m
        return None

    def _restart_group(self, members: list[DistillTask], lost: DistillTask, why: str, restarts: int,
                       gone: bool) -> None:
        """Start the whole group again (the run said so: `why`, its `restarts`th) from its last kept
        checkpoint (or the start), at its world size, where the plan puts its members (a node that is
        `gone` never again); queued when nowhere yet."""
        import ray

        st = self._dstate()
        leader = members[0]
        resume = self._resume_point(Path(leader.output_dir), True)
        step = resume.step if resume else 0
        broker = st.stores[leader.store].broker
        with st.lock:
            for m in members:
                m.restarts = restarts
                m.plan, m.resumed_step, m.step = replace(m.plan, resume=resume), step, step
                m.started, m.finished, m.progress = None, None, step / max(1, m.max_steps)
                m.state, m.node_id, m.queued, m.error = "pending", None, False, None  # their CPUs are not ours now
        ray.get([broker.restart.remote(m.rank) for m in members], timeout=60)
        ids = [m.task_id for m in members]
        self._devent("group_restarted", f"{why}: its group ({', '.join(ids)}) starts again from "
                     + (f"its checkpoint at step {step}" if resume else "the start")
                     + (f"; {lost.node} did not answer a probe for {ray_glue.NODE_VERDICT_S:.0f}s: gone" if gone else ""),
                     task_id=lost.task_id, lost_rank=lost.seat.rank, node=lost.node, step=step,
                     members=ids, restarts=restarts, node_gone=gone)
        self._place_student(leader)

    def _fail_group(self, members: list[DistillTask], why: str) -> None:
        """Every member of the group that has not ended fails with the group's one reason (their
        actors are killed already). The group's checkpoints (its leader's) stay for --resume."""
        for m in members:
            if m.state in ("completed", "failed", "cancelled", "paused"):
                continue
            m.queued, m.state, m.finished, m.error = False, "failed", time.time(), why
            self._devent("student_failed", f"{m.task_id} failed: {why}", task_id=m.task_id, node=m.node, error=why)
