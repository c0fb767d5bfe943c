"""The job manager: accepts jobs, queues them, starts one runner per active job,
pause/resume/cancel/join/leave, recovery.

What a job kind adds (its spec, runner, uploads, checks and demand) comes from the registry in
`smolforge.cluster.control.kinds`; nothing here branches on a kind.

The queue: a submitted (or resumed) job is `pending` until what its kind's `demand` asks for is
free; `schedule` decides (rules in `smolforge.cluster.control.queue`: priority, FIFO, backfill only onto
what the jobs ahead cannot use) and writes each waiting job's `pending_reason` (and, the first time
it gives a reason, a `queued` event saying it, which stays in the job's log). It runs at once on
submit and resume, whenever a job's runner ends (finished, paused, failed), and, while a job waits,
on a bounded tick (TICK_S) for what the store cannot tell us: a node joining, a node's resources coming
back (with no job waiting its thread sleeps until woken).
Admitted jobs hold a claim on what they will take until their runner's tasks have started (Ray's table
shows an actor's CPUs once it has a worker, not when it is placed), so two jobs are never started into
the same free slots.

A spec is validated once: at submit (`kinds.parse`), or once when a job is loaded from the store
after a restart. The manager keeps the typed spec (`specs`) and hands it to the job's runner;
the queue reads each waiting job's demand from it, never parsing again. A runner sees this
manager only through its `RunnerContext`, and the manager asks a runner only what the runner
says itself (`join`, `leave`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from smolforge.cluster.control import kinds, queue

from smolforge.cluster.nodes import ray_glue
from smolforge.cluster.control.artifacts import ArtifactStore
from smolforge.cluster.control.jobstore import FINAL, JobStore
from smolforge.cluster.control.placement import COORDINATOR, slots_on
from smolforge.cluster.control.runner import CANCEL_GRACE_S, JobRunner, RunnerContext
from smolforge.cluster.control.states import JobState
from smolforge.config import Spec
from smolforge.errors import SmolforgeError

log = logging.getLogger(__name__)

TICK_S = 2.0  # the queue looks again at least this often while jobs wait
CLAIM_TTL_S = 60.0  # an admitted job's claim lapses by then even if its runner never says it placed
PLACED_GRACE_S = 2.0  # Ray's resource table catches up with a new placement group within this
WAIT_LOOK_S = 0.5  # `wait` looks at a job with no running runner, or for its progress callback, this often

class JobManager:
    def __init__(self, store: JobStore, artifacts: ArtifactStore, embedded: bool = False,
                 on_start: Callable[[str], None] = lambda job_id: None):
        self.store, self.artifacts = store, artifacts
        self.embedded = embedded  # one machine: a local model directory is held by every node
        self.on_start = on_start  # told before a job's runner starts (the embedded cluster records its owner)
        self.runners: dict[str, JobRunner] = {}
        self.suspects: dict[str, float] = {}  # node_id -> when it stopped answering
        self.lock = threading.RLock()
        self.closed = False
        self.claims: dict[str, tuple[float, queue.Free]] = {}  # admitted, not yet placed: (expires, what)
        self.start_reasons: dict[str, str] = {}  # job id -> the runner's reason once it leaves the queue
        self.reasons_said: dict[str, set[str]] = {}  # a waiting job -> the reasons its `queued` events gave
        self.specs: dict[str, Spec] = {}  # job id -> its validated spec (at submit, or once on load)
        self.serve_token_file: str | None = None  # embedded `serve`: the token the user gave (cli/serve.py)
        self._wake = threading.Event()
        self._ticker: threading.Thread | None = None
        self._queued = False  # a job waited at the last schedule: the queue's thread looks every TICK_S
        self.context = RunnerContext(
            store=store, artifacts=artifacts, embedded=embedded, healthy_nodes=self.healthy_nodes,
            probe_node=self.probe_node, set_aside=self.set_aside, placed=self.placed, keep_spec=self.keep_spec,
            done=self._runner_done, serve_token_file=lambda: self.serve_token_file)

    # -- submitting -------------------------------------------------------------------------------

    def parse(self, spec: dict[str, Any]) -> Any:
        return kinds.parse(spec)

    def check_capacity(self, job: Any, nodes: list[ray_glue.NodeInfo] | None = None) -> int:
        """Fail at once, listing every node, when no set of nodes could ever hold the job's demand
        (however idle the cluster got); returns how many of its tasks the cluster can hold."""
        nodes = nodes if nodes is not None else ray_glue.nodes()
        demand = kinds.kind_of(job.kind).demand(job, self.embedded)
        cands = ray_glue.check_placeable(demand.req, nodes)
        total = sum(slots_on(n, demand.req, use_available=False) for n in cands)
        if total < demand.tasks:
            listing = "\n".join(f"  - {n.describe()}" for n in nodes)
            raise SmolforgeError(
                f"the job needs {demand.describe()}, but the nodes that can run it have room for {total}; "
                f"nodes:\n{listing}", where="placement",
                fix="lower --workers or the resources it asks, join more workers (`smolforge worker join`), or "
                    "lend the coordinator (`smolforge job join ID`)")
        return total

    def submit(self, spec: dict[str, Any], job: Any = None) -> str:
        """Queue the job SPEC; JOB: SPEC as `kinds.parse` returned it, where the caller parsed (and so
        checked) it already (the embedded cluster, before it starts). SmolforgeError for a refused spec."""
        if self.closed:
            raise SmolforgeError("the coordinator is shutting down", fix="retry once it is back")
        job = kinds.parse(spec) if job is None else job
        kinds.check_output_dir(job, self.embedded)
        self.check_uploads(job)
        if kinds.kind_of(job.kind).check_capacity:
            self.check_capacity(job)
        job_id = self.store.create_job(job.kind, job.model_dump(mode="json"), name=job.name)
        self.specs[job_id] = job
        self.store.add_event(job_id, "queued", f"queued ({job.priority} priority)", {"priority": job.priority})
        self.schedule()
        return job_id

    def check_uploads(self, job: Any) -> None:
        """Every file the job names is an upload this coordinator holds (or 'bundled')."""
        kinds.check_uploads(job, self.artifacts.has_upload)

    def spec_of(self, job: dict) -> Spec:
        """The job's validated spec: kept since submit, or parsed once as it is loaded from the store
        (a job from before a restart). A stored spec that no longer parses raises."""
        spec = self.specs.get(job["id"])
        if spec is None:
            spec = self.specs[job["id"]] = kinds.kind_of(job["kind"]).spec.model_validate(job["spec"])
        return spec

    def keep_spec(self, job_id: str, spec: Spec) -> None:
        """A runner changed its job's spec (a data-parallel job's lent nodes): stored, and kept for the
        job's next start."""
        self.specs[job_id] = spec
        self.store.update_job(job_id, spec=spec.model_dump(mode="json"))

    def set_aside(self, node_id: str) -> None:
        """A node that stopped answering: kept out of placements until it answers again."""
        self.suspects[node_id] = time.time()

    def _start(self, job_id: str, reason: str) -> JobRunner:
        with self.lock:
            old = self.runners.get(job_id)
            if old is not None and old.is_alive():
                raise SmolforgeError(f"job {job_id} is already running", fix="pause or cancel it first")
            job = self.store.get_job(job_id)
            runner = kinds.kind_of(job["kind"]).runner()(self.context, job_id, self.spec_of(job), reason)
            self.on_start(job_id)
            self.runners[job_id] = runner
            runner.start()
            return runner

    def _runner_done(self, job_id: str, runner: JobRunner) -> None:
        with self.lock:
            if self.runners.get(job_id) is runner:
                del self.runners[job_id]
            self.claims.pop(job_id, None)
            if JobState(self.store.get_job(job_id)["state"]).final:
                self.specs.pop(job_id, None)
        self._wake.set()  # what it held is free: the queue looks again (on its own thread)

    # -- the queue --------------------------------------------------------------------------------

    def placed(self, job_id: str) -> None:
        """A runner's tasks have started (a worker process each: Ray's table shows what they hold then, not when
        they are merely placed), so the claim can go, PLACED_GRACE_S later. A runner that never says so keeps
        its claim until CLAIM_TTL_S."""
        with self.lock:
            if job_id in self.claims:
                self.claims[job_id] = (min(self.claims[job_id][0], time.time() + PLACED_GRACE_S),
                                       self.claims[job_id][1])

    def _waiting(self) -> list[tuple[dict, queue.Waiting | None]]:
        """Pending jobs without a runner, with what each asks (None: its kind states no demand, so it
        never waits; a stored spec that no longer parses fails its job)."""
        out = []
        for job in self.store.list_jobs(states=(JobState.PENDING.value,), limit=100_000):
            runner = self.runners.get(job["id"])
            if runner is not None and runner.is_alive():
                continue
            kind = kinds.kind_of(job["kind"])
            try:
                spec = self.spec_of(job)  # validated at submit (or once, on load): not again here
                demand = kind.demand(spec, self.embedded) if kind.demand else None
            except Exception as err:  # noqa: BLE001 - recorded on the job, never kills the queue
                self.store.set_state(job["id"], JobState.FAILED.value, f"failed: its spec no longer parses: {err}",
                                     error=str(err)[:400])
                continue
            out.append((job, queue.Waiting(job["id"], spec.priority, job["created"], demand) if demand else None))
        return out

    def schedule(self) -> list[str]:
        """Start the waiting jobs that fit now, in queue order; record why the others wait."""
        with self.lock:
            if self.closed:
                return []
            now = time.time()
            self.claims = {j: c for j, c in self.claims.items() if c[0] > now}
            waiting = self._waiting()
            if not waiting:
                self._queued = False
                return []
            self._ensure_ticker()
            nodes = self.healthy_nodes()
            decision = queue.decide([w for _, w in waiting if w], nodes, {j: c for j, (_, c) in self.claims.items()},
                                    self.store.busy_nodes())
            started = [job["id"] for job, w in waiting if w is None] + decision.start  # no demand: no wait
            for job_id in started:
                if job_id in decision.claims:
                    self.claims[job_id] = (now + CLAIM_TTL_S, decision.claims[job_id])
                self.store.update_job(job_id, pending_reason=None)
                self.reasons_said.pop(job_id, None)
                self.store.add_event(job_id, "dequeued", "its turn: what it asks for is free; starting")
                self._start(job_id, self.start_reasons.pop(job_id, "started"))
            for job, _ in waiting:
                why = decision.reasons.get(job["id"])
                if why and why != job.get("pending_reason"):
                    self.store.update_job(job["id"], pending_reason=why)
                    said = self.reasons_said.setdefault(job["id"], set())
                    if why not in said:  # each reason once (two that alternate tick by tick: two events)
                        said.add(why)
                        self.store.add_event(job["id"], "queued", why)  # why it waited stays in its log
            queued = len(started) < len(waiting)
            if queued and not self._queued and threading.current_thread() is not self._ticker:
                self._wake.set()  # the queue's thread waits without a timeout while no job waits
            self._queued = queued
            return started

    def _ensure_ticker(self) -> None:
        if self._ticker is None or not self._ticker.is_alive():
            self._ticker = threading.Thread(target=self._tick, daemon=True, name="job-queue")
            self._ticker.start()

    def _tick(self) -> None:
        """Re-check the queue when woken (a job ended, a job left waiting), and every TICK_S while a job
        waits (a node joining or freeing is not told to it); ends with the manager."""
        while not self.closed:
            self._wake.wait(TICK_S if self._queued else None)
            self._wake.clear()
            try:
                self.schedule()
            except Exception:  # noqa: BLE001 - a lost Ray connection must not end the queue for good
                log.exception("job queue: scheduling failed; retrying in %ss", TICK_S)

    # -- control ----------------------------------------------------------------------------------

    def _job(self, job_id: str) -> dict:
        return self.store.get_job(job_id)

    def pause(self, job_id: str) -> dict:
        job = self._job(job_id)
        job_id = job["id"]
        runner = self.runners.get(job_id)
        if job["state"] == JobState.RUNNING and runner is not None:
            runner.request("pause")
            self.store.add_event(job_id, "pause_requested", "pause requested: checkpoint, then release workers")
        elif job["state"] == JobState.PENDING:
            if runner is not None:
                runner.request("pause")
            else:
                self.store.set_state(job_id, JobState.PAUSED.value, "paused before it started")
        elif job["state"] != JobState.PAUSED:
            raise SmolforgeError(f"job {job_id} is {job['state']}; only running or pending jobs can be paused",
                                 fix=f"see `smolforge job show {job_id}`")
        return self._job(job_id)

    def resume(self, job_id: str) -> dict:
        job = self._job(job_id)
        job_id = job["id"]
        if job["state"] != JobState.PAUSED:
            raise SmolforgeError(f"job {job_id} is {job['state']}; only paused jobs can be resumed",
                                 fix=f"see `smolforge job show {job_id}`")
        runner = self.runners.get(job_id)
        if runner is not None and runner.is_alive():
            runner.join(timeout=30)
        where = kinds.kind_of(job["kind"]).resumes_from(self.artifacts, job_id)
        self.start_reasons[job_id] = f"resumed from {where}"
        self.store.set_state(job_id, JobState.PENDING.value, "resume requested: queued")
        self.schedule()
        return self._job(job_id)

    def cancel(self, job_id: str) -> dict:
        job = self._job(job_id)
        job_id = job["id"]
        if job["state"] in FINAL:
            raise SmolforgeError(f"job {job_id} is already {job['state']}", fix="nothing to cancel")
        runner = self.runners.get(job_id)
        if runner is not None and runner.is_alive():
            runner.request("cancel")
            runner.finished.wait(timeout=CANCEL_GRACE_S + 6)
        job = self._job(job_id)
        if job["state"] not in FINAL:
            self.store.set_state(job_id, JobState.CANCELLED.value, "cancelled", force=True)
        self.specs.pop(job_id, None)
        return self._job(job_id)

    def delete(self, job_id: str) -> dict:
        """Remove a finished job, or a damaged one that is not running, with its artifacts; returns
        {"job_id", "deleted": True}. A live job is refused: it is cancelled first."""
        job = self._job(job_id)
        job_id = job["id"]
        runner = self.runners.get(job_id)
        live = (runner is not None and runner.is_alive()) or job["state"] in (JobState.RUNNING, JobState.PAUSED)
        if live or not (job["state"] in FINAL or job.get("damaged")):
            raise SmolforgeError(f"job {job_id} is {job['state']}: only a finished (or damaged) job can be deleted",
                                 fix=f"cancel it first: smolforge job cancel {job_id}")
        self.store.delete_job(job_id)
        self.artifacts.delete_job(job_id)
        self.specs.pop(job_id, None)
        self.runners.pop(job_id, None)
        return {"job_id": job_id, "deleted": True}

    def join(self, job_id: str, node: str | None = None) -> dict:
        """Lend the coordinator node (default) or another node to a running job of a joinable kind;
        the runner checks the node against its spec and says when it takes it in."""
        job = self._job(job_id)
        job_id = job["id"]
        runner = self.runners.get(job_id)
        kind = kinds.kind_of(job["kind"])
        if not kind.joinable:
            raise SmolforgeError(f"job {job_id} is a {kind.label} job; `job join` lends nodes to data-parallel jobs",
                                 fix="it places its tasks on every eligible worker itself")
        if job["state"] != JobState.RUNNING or runner is None:
            raise SmolforgeError(f"job {job_id} is {job['state']}; nodes can join running jobs only",
                                 fix=f"resume it first (`smolforge job resume {job_id}`)")
        target = node or COORDINATOR
        when = runner.take_in(target)
        self.store.add_event(job_id, "join_requested", f"{target} will join at {when}", {"node": target})
        return self._job(job_id)

    def leave(self, job_id: str, node: str | None = None) -> dict:
        """Give back the coordinator node (default) or another node lent to a running job with `join`;
        the runner checks it is a member that can go and says when it leaves."""
        job = self._job(job_id)
        job_id = job["id"]
        runner = self.runners.get(job_id)
        kind = kinds.kind_of(job["kind"])
        if not kind.joinable:
            raise SmolforgeError(f"job {job_id} is a {kind.label} job (kind {kind.name}): it cannot shed a node "
                                 "while it runs", where="job leave",
                                 fix=f"`job leave` gives back nodes lent to data-parallel jobs; to free this "
                                     f"job's nodes, cancel it (`smolforge job cancel {job_id}`)")
        if job["state"] != JobState.RUNNING or runner is None:
            raise SmolforgeError(f"job {job_id} is {job['state']}; nodes leave running jobs only", where="job leave",
                                 fix=f"it holds no node now: resume it and leave then (`smolforge job resume "
                                     f"{job_id}`), or cancel it (`smolforge job cancel {job_id}`)")
        target = node or COORDINATOR
        when = runner.leave(target)
        self.store.add_event(job_id, "leave_requested", f"{target} will leave at {when}", {"node": target})
        return self._job(job_id)

    # -- lifecycle --------------------------------------------------------------------------------

    def recover(self) -> list[str]:
        """After a (re)start: every job that was running or pending runs again from its checkpoint."""
        resumed = []
        for job in self.store.list_jobs(states=(JobState.RUNNING.value, JobState.PENDING.value)):
            where = kinds.kind_of(job["kind"]).resumes_from(self.artifacts, job["id"])
            self.start_reasons[job["id"]] = f"resumed after coordinator restart from {where}"
            if job["state"] == JobState.RUNNING:
                self.store.set_state(job["id"], JobState.PENDING.value, f"coordinator restarted; resuming from {where}",
                                     force=True)
            self.store.add_event(job["id"], "reattached", f"coordinator restarted; job resumes from {where}")
            resumed.append(job["id"])
        # through the queue like any job: the ones that ran hold their place (they were first in it),
        # and what Ray's table still shows of their old groups is gone once their actors are
        self.schedule()
        return resumed

    def mark_interrupted(self, job_id: str) -> None:
        """A job whose embedded command ended (its process is gone) becomes paused, never running
        forever: `job resume` continues it from its last checkpoint."""
        job = self._job(job_id)
        where = kinds.kind_of(job["kind"]).resumes_from(self.artifacts, job["id"])
        self.store.set_state(job["id"], JobState.PAUSED.value, f"interrupted: the command running it ended; "
                             f"`smolforge job resume {job['id']}` continues from {where}", force=True)
        self.store.stop_tasks(job["id"], "stopped: the command running the job ended")

    def active(self) -> list[str]:
        with self.lock:
            return [j for j, r in self.runners.items() if r.is_alive()]

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop watching jobs (they stay 'running' in the store and resume on the next start)."""
        self.closed = True
        self._wake.set()
        with self.lock:
            runners = list(self.runners.values())
        for r in runners:
            r.abandon = True
        for r in runners:
            r.join(timeout=timeout / max(1, len(runners)))

    def wait(self, job_id: str, timeout: float | None = None, on_update: Callable[[dict], None] | None = None) -> dict:
        """Block until the job is final or paused (for the embedded CLI path); returns its row.

        While the job's runner runs, this waits on the runner's `finished` event (its end is when a
        running job becomes final or paused): without `on_update` it does not look at the job until
        then; with it, `on_update(job)` is called every WAIT_LOOK_S (progress). A job with no runner
        (queued, or between attempts) is looked at every WAIT_LOOK_S. `timeout` in seconds (None:
        no limit); on it the job's row as it is then."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self._job(job_id)
            if on_update:
                on_update(job)
            runner = self.runners.get(job["id"])
            ended = runner is None or runner.finished.is_set() or not runner.is_alive()
            if job["state"] in FINAL or (job["state"] == JobState.PAUSED and ended):
                return job
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return job
            if runner is not None and not ended:
                runner.finished.wait(WAIT_LOOK_S if on_update else left)
            else:
                time.sleep(WAIT_LOOK_S if left is None else min(WAIT_LOOK_S, left))

    # -- node health ------------------------------------------------------------------------------

    def probe_node(self, node_id: str, timeout: float = ray_glue.NODE_VERDICT_S) -> bool:
        return ray_glue.probe_node(node_id, timeout)

    def healthy_nodes(self) -> list[ray_glue.NodeInfo]:
        nodes = ray_glue.nodes()
        alive_ids = {n.node_id for n in nodes}
        for nid, since in list(self.suspects.items()):
            if nid not in alive_ids:
                continue  # Ray has caught up: it is gone from the live table
            if time.time() - since > 20 and self.probe_node(nid, 2):
                del self.suspects[nid]
        return [n for n in nodes if n.node_id not in self.suspects]
