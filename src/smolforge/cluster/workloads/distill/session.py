"""`DistillTasks`: teachers and students on the cluster, rotation, monitoring, pause and aggregation."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable

from ray.exceptions import RayError

from smolforge.cluster.workloads.distill.controller import (
    Queued, ShardCorrupt, StudentProgress, TaskEnded, TaskFailed, TaskStarted,
)
from smolforge.cluster.workloads.distill.decide import shard_key
from smolforge.cluster.workloads.distill.state import BROKER_LOST_S, PLACEMENT_POLL_S, POLL_S, DistillTask, StoreState, short_error
from smolforge.cluster.workloads.distill.students import StudentTasks
from smolforge.cluster.workloads.distill.teachers import TeacherTasks
from smolforge.distill.aggregate import aggregate_student_outputs as _aggregate
from smolforge.distill.store import quarantine_shard
from smolforge.errors import SmolforgeError

MAX_HELD_LINES = 50_000  # task lines held for the job runner, which takes them at every poll


class DistillTasks(TeacherTasks, StudentTasks):
    """Distillation tasks on the cluster (see the module docstring): `DistillSession`'s building blocks."""

    # -- rotation ------------------------------------------------------------------------------------

    def _after_finish(self, task: DistillTask) -> None:
        """A finished task frees its node: a finished teacher takes a queued student (rotation)."""
        import ray

        if self._dstate().closing or not ray.is_initialized():
            return
        if task.kind == "teacher" and task.state == "completed":
            try:
                self.reassign_idle_teacher_as_student(task.task_id)
            except SmolforgeError:
                pass
        self._place_queued()

    def _place_queued(self) -> None:
        self._place_waiting()

    def reassign_idle_teacher_as_student(self, task_id: str) -> str | None:
        """Give a finished teacher's node to the next queued student; returns that student's id (or None)."""
        st = self._dstate()
        with st.lock:
            teacher = st.tasks.get(task_id)
            if teacher is None or teacher.kind != "teacher":
                raise SmolforgeError(f"{task_id} is not a teacher task of this orchestrator",
                                     fix="pass an id returned by create_parallel_teacher_tasks")
            if teacher.state not in ("completed", "failed", "cancelled"):
                raise SmolforgeError(f"teacher {task_id} is still {teacher.state}",
                                     fix="reassign it once it has finished its shards")
            queued = [t for t in st.tasks.values() if t.kind == "student" and t.queued
                      and teacher.node_id in {n.node_id for n in self._student_nodes(t)}]
        node = next((n for n in self._nodes() if n.node_id == teacher.node_id), None) if queued else None
        if node is None:
            return None
        student = queued[0]  # the plan says whether the node can take it (its free CPUs)
        if not (self._place_student(student, node) and student.node_id == node.node_id):
            return None
        self._devent("teacher_reassigned", f"{task_id}'s node {node.name} now runs {student.task_id}",
                     teacher=task_id, student=student.task_id, node=node.name)
        return student.task_id

    # -- monitoring ----------------------------------------------------------------------------------

    def _monitor_loop(self) -> None:
        """The run's steps, for a session nobody drives (the Orchestrator's, a stage's)."""
        import ray

        st = self._dstate()
        while not st.closing and ray.is_initialized():
            try:
                self.step()
            except Exception as err:  # keep stepping; say what went wrong
                self._devent("monitor_error", f"distill monitor: {short_error(err)}", error=short_error(err))
                time.sleep(POLL_S)

    def tick(self, seconds: float) -> None:
        """Let `seconds` pass: in steps of the run when this caller drives it, else asleep (the monitor steps)."""
        if self._dstate().driven:
            self.step(seconds)
        else:
            time.sleep(seconds)

    def step(self, timeout: float = POLL_S) -> None:
        """One step of the run, waiting at most `timeout` s for news: every teacher's next shard and
        every student's end collected at once (`ray.wait`), the brokers drained (students' progress,
        checkpoints, lines), and every PLACEMENT_POLL_S queued students placed (nodes come and go)."""
        import ray

        st = self._dstate()
        if st.closing or not ray.is_initialized():
            return
        self._collect(timeout)
        # (a placement under way in another thread, a restart's: this round is skipped, not waited for)
        if time.time() - st.last_placement > PLACEMENT_POLL_S and st.placing.acquire(blocking=False):
            st.last_placement = time.time()
            try:
                self._fail_unplaceable()  # (and every waiting task placed where the plan says)
            except Exception as err:  # keep going; say what went wrong
                self._devent("monitor_error", f"distill placement: {short_error(err)}", error=short_error(err))
            finally:
                st.placing.release()
        for store in list(st.stores.values()):
            self._drain(store)

    def _collect(self, timeout: float) -> None:
        """Wait up to `timeout` s for any teacher's or student's news, then act on all that is ready."""
        import ray

        st = self._dstate()
        with st.lock:
            watch = dict(st.watch)
        if not watch:
            time.sleep(timeout)
            return
        handles = [w[0] for w in watch.values()]
        try:
            ready, rest = ray.wait(handles, num_returns=1, timeout=timeout)
            if ready and rest:
                ready += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
        except RayError as err:  # Ray going away: the run's end says why
            self._devent("monitor_error", f"distill monitor: {short_error(err)}", error=short_error(err))
            return
        now_ready = {id(h) for h in ready}
        for task_id, entry in watch.items():
            if id(entry[0]) not in now_ready:
                continue
            try:
                more = entry[1]()
            except Exception as err:  # its own news is handled; what follows it (placement) said here
                self._devent("monitor_error", f"distill monitor ({task_id}): {short_error(err)}",
                             error=short_error(err), task_id=task_id)
                more = False
            if not more:
                with st.lock:
                    if st.watch.get(task_id) is entry:  # (a restart may have put a new one there)
                        del st.watch[task_id]

    def _drain(self, store: StoreState) -> None:
        """The store's broker's news: the students' events, progress, checkpoints and output lines."""
        import ray

        try:
            news = ray.get(store.broker.drain.remote(), timeout=5)
            store.broker_silent_since = None
        except RayError as err:  # a busy broker: the next step drains it; a gone one ends the run
            store.broker_silent_since = store.broker_silent_since or time.time()
            if time.time() - store.broker_silent_since > BROKER_LOST_S:
                self._broker_lost(store, err)
            return
        self._dlines(news.get("lines") or [])
        try:
            self._absorb_broker(store, news)
        except Exception as err:  # keep going; say what went wrong
            self._devent("monitor_error", f"distill monitor: {short_error(err)}", error=short_error(err))

    def _broker_lost(self, store: StoreState, err: BaseException) -> None:
        """The store's broker has not answered for BROKER_LOST_S: its students cannot get shards or
        ship checkpoints any more, so they fail (their kept checkpoints stay for a rerun)."""
        why = (f"the shard broker of {store.dir.name} has not answered for {BROKER_LOST_S:.0f}s "
               f"({short_error(err)}); rerun the job to continue from the kept checkpoints")
        for t in self._dstate().tasks.values():
            if t.kind == "student" and t.store == str(store.dir) and t.state in ("pending", "running"):
                t.queued, t.state, t.finished, t.error = False, "failed", time.time(), why
                self._record(TaskFailed(t.task_id, why, False, t.attempt))
                self._devent("student_failed", f"{t.task_id} failed: {why}", task_id=t.task_id, error=why)

    def _fail_unplaceable(self) -> None:
        """Place the waiting tasks where the plan says; a queued student that no live node could run for
        `replace_timeout_s` (since its `no_node_since`, told to the run first) fails, saying why."""
        st = self._dstate()
        self._synced()
        for t in [t for t in st.tasks.values() if t.kind == "student" and t.queued and t.state == "pending"]:
            if t.no_node_since is not None:
                self._record(Queued((t.task_id,), t.no_node_since, True))
        self._place_waiting()

    def _absorb_broker(self, store: StoreState, news: dict[str, Any]) -> None:
        st = self._dstate()
        by_rank = {t.rank: t for t in st.tasks.values() if t.kind == "student" and t.store == str(store.dir)}
        for ev in news["events"]:
            task = by_rank.get(ev["rank"])
            if task is None:
                continue
            data = dict(ev["data"])
            if ev["kind"] == "student_started":
                # Broker events are drained every POLL_S: a quick student may have finished (its
                # result awaited by another thread) before its "started" arrives; never go back.
                if task.state == "pending":
                    task.state = "running"
                    self._record(TaskStarted(task.task_id, task.attempt))
                task.started = task.started or data.get("at", time.time())
                self._devent("student_started", f"{task.task_id} started training on {task.node} "
                             f"({data.get('shards_ready')} shards in hand)", task_id=task.task_id, node=task.node, **data)
            elif ev["kind"] == "held":  # fault injection (train/faults.py): the student says where it waits
                self._devent("held", f"{task.task_id}: {data.pop('message', 'held')}", task_id=task.task_id, **data)
            elif ev["kind"] == "shard_corrupt":
                self._devent("shard_corrupt", f"{task.task_id} rejected shard {data.get('shard')}: {data.get('error')}",
                             task_id=task.task_id, **data)
            else:
                self._devent(ev["kind"], f"{task.task_id}: {ev['kind']}", task_id=task.task_id, **data)
        for rank, shipped in news.get("checkpoints", {}).items():
            task = by_rank.get(int(rank))
            if task is not None:
                self._keep_student_checkpoint(task, shipped, why="saved")
        for rank, info in news["progress"].items():
            task = by_rank.get(int(rank))
            if task is not None and task.state == "running":
                task.progress = info["step"] / max(1, info["max_steps"])
                task.step, task.loss = int(info["step"]), info.get("loss")
                task.lr, task.tokens_per_s = info.get("lr"), info.get("tokens_per_s")
                task.max_steps = int(info.get("max_steps") or task.max_steps)
                task.samples_done = info.get("samples_done", 0)
                task.samples_total = info.get("samples_total", task.samples_total)
                self._record(StudentProgress(task.task_id, task.step, task.max_steps, task.attempt))
        for bad in news["corrupt"]:
            sid = int(bad["shard"])
            task = by_rank.get(bad["rank"])
            self._devent("shard_corrupt", f"shard {sid} failed its checksum at {task.task_id if task else 'a student'}; "
                         "regenerating it", shard=sid, error=bad["error"], source="student",
                         task_id=task.task_id if task else None)
            if sid in store.regenerating:
                continue
            store.regenerating.add(sid)
            store.written.discard(sid)
            quarantine_shard(store.dir, sid)
            self._record(ShardCorrupt(shard_key(self._store_no(store), sid)))  # the run makes a teacher for it
            try:
                self._place_waiting()
            except SmolforgeError as err:
                store.broker.fail.remote(str(err))

    def _local_task_status(self, task_id: str) -> dict[str, Any] | None:
        st = getattr(self, "_distill_state", None)
        if st is None:
            return None
        task = st.tasks.get(task_id)
        return task.status() if task is not None else None

    def task_status(self, task_id: str) -> dict[str, Any]:
        """One teacher, student or aggregation task's status (the Orchestrator also answers for jobs)."""
        status = self._local_task_status(task_id)
        if status is None:
            raise SmolforgeError(f"unknown task {task_id}", fix="use an id from create_*_tasks")
        return status

    def distill_tasks(self) -> list[dict[str, Any]]:
        """Every teacher, student and aggregation task of this orchestrator, as status dicts."""
        st = self._dstate()
        return [t.status() for t in st.tasks.values()]

    def wait_distill(self, task_ids: list[str], timeout: float | None = None, callback=None) -> dict[str, dict]:
        """Block until the tasks end (completed, failed or cancelled); raise if any failed."""
        deadline = None if timeout is None else time.time() + timeout
        last: dict[str, tuple] = {}
        while True:
            statuses = {tid: self._local_task_status(tid) or {"state": "unknown"} for tid in task_ids}
            for tid, s in statuses.items():
                key = (s.get("state"), s.get("progress"))
                if callback and last.get(tid) != key:
                    callback(tid, s)
                last[tid] = key
            if all(s["state"] in ("completed", "failed", "cancelled", "paused") for s in statuses.values()):
                failed = {t: s for t, s in statuses.items() if s["state"] == "failed"}
                if failed:
                    tid, s = next(iter(failed.items()))
                    raise SmolforgeError(f"{tid} failed: {s.get('error')}", fix="see the event log for the cause")
                return statuses
            if deadline and time.time() > deadline:
                raise SmolforgeError(f"distillation tasks did not finish within {timeout:.0f}s",
                                     fix="check `smolforge status`, or raise the timeout")
            self.tick(POLL_S)

    def cancel_distill_task(self, task_id: str) -> None:
        """Stop a teacher (cancel its generator) or a student (it stops after its current step)."""
        import ray

        st = self._dstate()
        task = st.tasks.get(task_id)
        if task is None:
            raise SmolforgeError(f"unknown task {task_id}", fix="use an id from create_*_tasks")
        handle = st.handles.get(task_id)
        if task.kind == "teacher" and handle is not None:
            task.state = "cancelled"
            self._record(TaskEnded(task_id, "cancelled", task.attempt))
            try:
                ray.cancel(handle)
            except (RayError, ValueError):
                pass  # it already finished
        elif task.kind == "student":
            if task.queued:
                task.queued, task.state = False, "cancelled"
                self._record(TaskEnded(task_id, "cancelled", task.attempt))
            else:
                st.stores[task.store].broker.request_stop.remote(task.rank, "cancel")
        self._devent("cancelled", f"{task_id} cancelled", task_id=task_id)

    def pause_distill_students(self, task_ids: list[str], timeout: float = 60.0) -> dict[str, str]:
        """Ask students to pause and wait until they have: each checkpoints the steps it has done
        and ships the checkpoint here (`student_N/checkpoints/`), so a resumed run continues from it.

        A student waiting for a shard hears the request at once (the broker answers "stop"); one in
        a step finishes that step first. Those that do not answer within `timeout` are left to
        `shutdown_distill`, which kills them; they restart from their last kept checkpoint.
        Returns each task's state.
        """
        import ray

        st = self._dstate()
        waiting = []
        for tid in task_ids:
            task = st.tasks.get(tid)
            if task is None or task.kind != "student" or task.state in ("completed", "failed", "cancelled", "paused"):
                continue
            if task.queued:
                task.queued, task.state = False, "paused"
                self._record(TaskEnded(tid, "paused", task.attempt))
                continue
            try:
                ray.get(st.stores[task.store].broker.request_stop.remote(task.rank, "pause"), timeout=10)
                waiting.append(task)
            except Exception as err:
                self._devent("pause_failed", f"{tid}: could not ask it to pause: {short_error(err)}", task_id=tid)
        deadline = time.time() + timeout
        while waiting and time.time() < deadline:
            waiting = [t for t in waiting if t.state in ("pending", "running")]
            self.tick(POLL_S)
        for t in waiting:
            self._devent("pause_timeout", f"{t.task_id} did not pause within {timeout:.0f}s; it is stopped "
                         "and resumes from its last kept checkpoint", task_id=t.task_id)
        return {tid: st.tasks[tid].state for tid in task_ids if tid in st.tasks}

    def shutdown_distill(self, timeout: float = 15.0) -> None:
        """Stop our driver threads (joined, so none is inside a Ray call afterwards) and kill our
        actors (brokers, students still running). Call before disconnecting from Ray."""
        import ray

        st = self._dstate()
        st.closing = True
        deadline = time.time() + timeout
        for t in list(st.threads):
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.time()))
        if not ray.is_initialized():
            return
        for handle in list(st.handles.values()):
            try:
                if isinstance(handle, tuple):
                    ray.kill(handle[0])
                else:
                    ray.cancel(handle)
            except (RayError, ValueError):
                pass  # already finished or gone
        for store in st.stores.values():
            try:  # the students' last lines, sent as they finished, after the monitor's last drain
                self._dlines(ray.get(store.broker.take_lines.remote(), timeout=5))
            except RayError:
                pass  # a gone broker: those lines stay in the nodes' Ray logs
            try:
                ray.kill(store.broker)
            except (RayError, ValueError):
                pass  # already gone

    # -- aggregation ---------------------------------------------------------------------------------

    def aggregate_student_outputs(self, student_output_dirs: list[str | Path], output_path: str | Path,
                                  method: str = "mean", **kwargs: Any) -> dict[str, Any]:
        """Merge student adapters into `merged_model/final_adapter/` (see smolforge.distill.aggregate).

        Student task ids are accepted in place of their output directories.
        """
        st = self._dstate()
        dirs = []
        for d in student_output_dirs:
            task = st.tasks.get(str(d))
            if task is not None and task.output_dir is None and task.seat:
                continue  # a data-parallel group's other ranks: the group's one adapter is its leader's
            dirs.append(task.output_dir if task is not None else d)
        task_id = f"aggregate-{next(st.counters['aggregate'])}"
        task = DistillTask(task_id=task_id, kind="aggregate", store="", state="running", started=time.time(),
                           node="driver")
        st.tasks[task_id] = task
        try:
            report = _aggregate(dirs, output_path, method=method, **kwargs)
        except Exception as err:
            task.state, task.error, task.finished = "failed", short_error(err), time.time()
            self._devent("aggregate_failed", f"{task_id} failed: {task.error}", task_id=task_id)
            raise
        task.state, task.progress, task.finished, task.result = "completed", 1.0, time.time(), report
        task.output_dir = report["output"]
        self._devent("aggregated", f"{len(dirs)} students merged ({method}) into {report['output']}",
                     task_id=task_id, **{k: v for k, v in report.items() if k != "truncation_error"})
        return {**report, "task_id": task_id}


class DistillSession(DistillTasks):
    """DistillTasks on a connected cluster: what the distill job runner drives, and what the seeds'
    `Orchestrator` holds on a bare Ray handle (the distill tests' clusters) and hands its calls to."""

    def __init__(self, cluster, mode: str = "teacher_student", driven: bool = False,
                 events: list[dict[str, Any]] | None = None,
                 on_lines: Callable[[list[dict[str, Any]]], None] | None = None):
        """`driven`: the caller steps the run (`step`, `tick`: the distill job runner's poll); else a
        monitor thread does. `events`: the list its events are appended to (default: its own, `events`);
        `on_lines`: where its tasks' output lines go as they come (default: held for `take_lines`)."""
        self.cluster, self.mode = cluster, mode
        self._dstate().driven = driven
        self.events: list[dict[str, Any]] = [] if events is None else events
        self.lines: list[dict[str, Any]] = []
        self._on_lines = on_lines
        self._lines_lock = threading.Lock()

    def log_event(self, kind: str, message: str, **data: Any) -> None:
        self.events.append({"ts": time.time(), "kind": kind, "message": message, "data": data})

    def log_lines(self, lines: list[dict[str, Any]]) -> None:
        """Teachers' and students' output lines, to `on_lines`, or held until the job runner takes
        them (`take_lines`)."""
        if self._on_lines is not None:
            self._on_lines(lines)
            return
        with self._lines_lock:
            self.lines.extend(lines)
            del self.lines[:-MAX_HELD_LINES]  # a runner that stopped taking them must not grow this

    def take_lines(self) -> list[dict[str, Any]]:
        with self._lines_lock:
            out, self.lines = self.lines, []
        return out
