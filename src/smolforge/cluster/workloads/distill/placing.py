"""Acting on `plan`: the session places what the controller says, where it says, and nothing else.

`_place_waiting` asks `plan` (decide.py) about every waiting teacher and student, the live nodes
that may run each of them given, and acts on its actions: a `Place` starts a teacher (`_start_teacher`)
or a student or a ddp group, all members at once (`_start_students`); a `Wait` queues them, saying why
(`_queue`: busy nodes, or none that could run them at all, which the run records since when); a
`GiveUp` fails them (`_give_up`: their store failed, or no node could run them for replace_timeout_s).
A group whose members Ray could not start where the plan put them (`_not_started`) waits again.
"""

from __future__ import annotations

import time
from typing import Any

from ray.exceptions import RayError

from smolforge.cluster.workloads.distill.controller import (
    GiveUp, NotStarted, Place, Queued, TaskFailed, TaskPlaced, TaskStarted, Wait,
)
from smolforge.cluster.workloads.distill.decide import RunRecord, shard_of
from smolforge.cluster.workloads.distill.remotes import remotes
from smolforge.cluster.workloads.distill.state import DistillTask, short_error
from smolforge.cluster.workloads.distill.sync import DataParallelSync
from smolforge.distill.teacher import prompts_from_dataset
from smolforge.errors import SmolforgeError


class Placing(RunRecord):
    """Placement by the controller's plan (a mixin of StudentTasks; see the module docstring)."""

    def _place_waiting(self, only: set[str] | None = None, node=None) -> dict[str, bool]:
        """`plan` over the waiting tasks, acted on. `only`: act on these students alone (a group's
        members), and on no teacher; `node`: offer them this node alone (a finished teacher's: rotation).
        Returns, per student acted on, whether it was placed (or ended) rather than queued.

        One thread at a time (`SessionState.placing`): a plan and the Places it starts are one step,
        so the monitor's periodic placement and a restart's never both start one waiting group."""
        with self._dstate().placing:
            return self._plan_and_place(only, node)

    def _plan_and_place(self, only: set[str] | None, node) -> dict[str, bool]:
        """`_place_waiting`'s step, with the placing lock held."""
        st = self._dstate()
        with st.lock:
            waiting = [t for t in st.tasks.values() if t.kind == "student" and t.state == "pending" and not t.node_id]
        eligible = {t.task_id: self._student_nodes(t) for t in waiting}
        if node is not None:
            eligible = {tid: [n for n in ok if n.node_id == node.node_id] for tid, ok in eligible.items()}
        if only is None:
            eligible.update(self._teacher_eligible())
        nodes = list({n.node_id: n for ok in eligible.values() for n in ok}.values())
        actions = self._plan(nodes, self._busy_cpus(), eligible)
        by_id = {n.node_id: n for n in nodes}
        done: dict[str, bool] = {}
        for action in actions:
            ids = getattr(action, "task_ids", ())
            teacher = bool(ids) and st.run.tasks[ids[0]].kind == "teacher"
            if (only is not None and not set(ids) & only) or (teacher and only is not None):
                continue
            if isinstance(action, Place) and teacher:
                self._start_teacher(action, by_id)
            elif isinstance(action, Place):
                done.update(self._start_students(action, by_id))
            elif isinstance(action, Wait):
                if node is None:  # (a wait on one offered node says nothing of the others)
                    self._queue(action)
                done.update({tid: False for tid in action.task_ids})
            elif isinstance(action, GiveUp):
                self._give_up(action)
                done.update({tid: True for tid in action.task_ids})
        return done

    def _teacher_eligible(self) -> dict[str, list[Any]]:
        """The live nodes that may run each waiting teacher (a retry's, a corrupt shard's), by its store's
        teacher; a store whose teacher no node can run any more fails that teacher (its shards' retries)."""
        st, out = self._dstate(), {}
        for t in [t for t in st.run.tasks.values() if t.kind == "teacher" and t.state == "waiting"]:
            store = st.stores[st.store_nos[shard_of(t.shards[0])[0]]]
            try:
                out[t.task_id], _ = self._model_nodes(store.teacher, "teacher", store.backend,
                                                      store.teacher_on_coordinator)
            except SmolforgeError as err:
                self._teacher_lost_shards(store, t.task_id, err.render(), False)
        return out

    def _start_teacher(self, action: Place, by_id: dict[str, Any]) -> None:
        """A teacher the run made (a failed one's shards, a corrupt shard) starts on the planned node."""
        st = self._dstate()
        task = st.run.tasks[action.task_ids[0]]
        store_no = shard_of(task.shards[0])[0]
        store = st.stores[st.store_nos[store_no]]
        sids = [shard_of(k)[1] for k in task.shards]
        if not store.items:
            store.items = prompts_from_dataset(store.plan.dataset)
        note = " (regenerating a corrupt shard)" if set(sids) & store.regenerating else " (retry)"
        self._launch_teacher(store, sids, by_id[action.node_ids[0]], note=note, task_id=task.task_id)

    def _queue(self, action: Wait) -> None:
        """No node for these students now: queued, saying why once; `unplaceable` (no live nodes could
        run them at all, were they idle) recorded since when, one verdict for a group's members."""
        st = self._dstate()
        members = [st.tasks[tid] for tid in action.task_ids]
        now = time.time()
        hybrid = getattr(self, "mode", "") == "hybrid"
        for q in members:
            q.no_node_since = (q.no_node_since or now) if action.unplaceable else None
            if not q.queued:
                q.queued = True
                why = ("no live node can run it; waiting for one to join" if q.no_node_since
                       else "every eligible node is busy" + (" or runs a teacher (hybrid)" if hybrid else ""))
                if len(members) > 1:
                    why = f"its group of {len(members)} cannot all start: " + why
                self._devent("student_queued", f"{q.task_id} queued: {why}", task_id=q.task_id)
        since = members[0].no_node_since
        self._record(Queued(action.task_ids, since if since is not None else now, action.unplaceable))

    def _give_up(self, action: GiveUp) -> None:
        """Students that cannot go on fail, saying why (their checkpoints stay for a rerun)."""
        st = self._dstate()
        for tid in action.task_ids:
            t = st.tasks[tid]
            if t.state not in ("pending", "running"):
                continue
            known = st.run.tasks.get(tid)
            no_node = not st.run.store_failed and known is not None and known.no_node_since is not None
            why = self._unplaceable_why(t, st.run.replace_timeout_s) if no_node else action.reason
            self._record(TaskFailed(tid, why, False, self._attempt(t)))  # (the run's: a group waiting again is a new one)
            t.queued, t.state, t.finished, t.error = False, "failed", time.time(), why
            self._devent("student_failed", f"{tid} failed: {why}", task_id=tid, node=t.node, error=why)

    def _start_students(self, action: Place, by_id: dict[str, Any]) -> dict[str, bool]:
        """Start a student, or a group's members together, on the planned nodes, as the planned attempt.
        The group meets at rank 0's address (`DataParallelSync.rendezvous`) before any member trains."""
        st = self._dstate()
        members = [st.tasks[tid] for tid in action.task_ids]
        store = st.stores[members[0].store]
        with st.lock:
            actors = []
            for m, node_id in zip(members, action.node_ids):
                pick = by_id[node_id]
                m.queued, m.state, m.attempt = False, "pending", action.attempt
                m.node, m.node_id = pick.name, pick.node_id
                self._record(TaskPlaced(m.task_id, node_id, action.attempt))
                opts = self._options(pick, m.req_model, m.cpus)
                actors.append(remotes()["student"].options(max_restarts=0, **opts).remote())
                st.handles[m.task_id] = (actors[-1], None)  # shutdown_distill kills it from now on
        try:  # outside the lock: rank 0's process may take a while to start
            meet = DataParallelSync.rendezvous(actors) if len(members) > 1 else {}
        except RayError as err:
            why = (f"its student group could not meet: rank 0 ({members[0].task_id} on {members[0].node}) did not "
                   f"start ({short_error(err)}); free CPUs on the workers, or rerun with --resume")
            self._record(TaskFailed(members[0].task_id, why, False, action.attempt))
            for m, actor in zip(members, actors):
                self._kill_quietly(actor)
                m.state, m.finished, m.error = "failed", time.time(), why
                self._devent("student_failed", f"{m.task_id} failed: {why}", task_id=m.task_id, node=m.node, error=why)
            return {m.task_id: True for m in members}  # ended, not queued
        if meet is None:
            return self._not_started(members, actors, action)
        if len(members) > 1:  # every member has its worker: Ray's table shows the group's CPUs (`started`)
            self._record(*(TaskStarted(m.task_id, action.attempt) for m in members))
        self._run_students(members, actors, store, meet)
        return {m.task_id: True for m in members}

    def _not_started(self, members: list[DistillTask], actors: list[Any], action: Place) -> dict[str, bool]:
        """A group placed where Ray had no CPUs for a member (another job's tasks took them before Ray's
        table showed it, `DataParallelSync.rendezvous`): its actors killed, back to waiting (`NotStarted`:
        no restart spent), placed again by a later plan once CPUs free; `plan` gives it up after
        replace_timeout_s. Returns its members as queued."""
        st = self._dstate()
        where = members[0].node
        for actor in actors:
            self._kill_quietly(actor)
        with st.lock:
            for m in members:
                st.handles.pop(m.task_id, None)
                m.state, m.node, m.node_id, m.queued = "pending", None, None, True
            self._record(NotStarted(members[0].task_id, action.attempt, time.time()))
        ids = [m.task_id for m in members]
        self._devent("student_group_unstarted", f"its group ({', '.join(ids)}) did not start on {where}: Ray had no "
                     "CPUs for a member (another job's tasks took them first); it waits for free CPUs",
                     task_id=ids[0], members=ids, node=where)
        return {tid: False for tid in ids}

    def _run_students(self, members: list[DistillTask], actors: list[Any], store, meet: dict[str, Any]) -> None:
        """The started actors run their students; `step` waits on their results."""
        from functools import partial

        st = self._dstate()
        with st.lock:
            refs = []
            for m, actor in zip(members, actors):
                plan = m.plan.placed(m.node or "", meet)  # its record as placed, sent whole
                refs.append(actor.run.remote(plan, store.broker, m.rank))
                st.handles[m.task_id] = (actor, refs[-1])
        for m, actor, ref in zip(members, actors, refs):
            self._devent("student_submitted", f"{m.task_id} placed on {m.node}", task_id=m.task_id, node=m.node)
            with st.lock:
                st.watch[m.task_id] = (ref, partial(self._student_ready, m, actor, ref))
