"""The job manager: runs submitted jobs on the cluster and keeps the job store truthful.

One runner thread per active job, in the coordinator process (or in the CLI process for the
embedded cluster: same code). A data-parallel runner loops over *rounds*; each round places a worker
group (gang-scheduled), starts every rank from the newest checkpoint in the artifact store, and
watches it:

- completed      → the final adapter is already in the artifact store; the job completes.
- a rank failed  → the whole group is released at once (the others would block in all-reduce), the
                   failed node is probed and set aside if it does not answer, and a new round starts
                   on the remaining or replacement nodes from the last checkpoint, with each worker's
                   batch resized so the global batch is unchanged. `max_retries` failures are
                   survived; each failure and recovery is an event.
- pause          → rank 0 checkpoints, every actor is released; resume is a new round.
- cancel         → actors are killed (processes gone within seconds).
- join           → at the next checkpoint boundary the group stops and re-forms with the new node;
                   a join before the group is placed is in its first round, and one the job
                   outlives (it finished first) is an event, never silently lost.

Submitting checks placement at once: a job that no node (or not enough nodes) can run fails with a
message that lists what each node has, instead of waiting forever as Ray alone would.
"""

from __future__ import annotations

import math
import threading
import time
import traceback
from typing import Any, Callable

from smolforge.cluster import ray_glue
from smolforge.cluster.artifacts import ArtifactStore
from smolforge.cluster.jobstore import FINAL, JobStore
from smolforge.cluster.specs import DistillJob, JOB_KINDS, DataParallelJob
from smolforge.config import validate
from smolforge.errors import SmolforgeError

POLL_S = 0.25
CANCEL_GRACE_S = 3.0
COORDINATOR = "@coordinator"


def _short(err: BaseException) -> str:
    cause = getattr(err, "cause", None)  # RayTaskError wraps the worker's own exception
    if isinstance(cause, BaseException) and cause is not err:
        err = cause
    if isinstance(err, SmolforgeError):
        return err.render().replace("\n", " ")[:400]
    text = str(err).strip().splitlines()
    first = next((t for t in text if t.strip()), "")
    return f"{type(err).__name__}: {first[:300]}"


def requirements_for(spec: DataParallelJob) -> ray_glue.Requirements:
    from smolforge.models.tiny import is_preset

    need_model = spec.require_model if spec.require_model is not None else not is_preset(spec.train.model)
    return ray_glue.Requirements(model=spec.train.model if need_model else None, min_ram_gb=spec.min_ram_gb,
                                 cpus=spec.cpus_per_worker, gpu=spec.gpu, allowed_nodes=spec.allowed_nodes)


def coordinator_requirements(spec: DataParallelJob) -> ray_glue.Requirements:
    base = requirements_for(spec)
    return ray_glue.Requirements(model=base.model, cpus=spec.cpus_per_worker, gpu="no", on_coordinator=True)


def slots_on(node: ray_glue.NodeInfo, req: ray_glue.Requirements, use_available: bool) -> int:
    src = node.available if use_available else node.resources
    cpu = src.get("CPU", 0.0)
    k = math.floor((cpu + 1e-6) / req.cpus) if req.cpus > 0 else 64
    if not req.on_coordinator:
        w = src.get(ray_glue.WORKER_RESOURCE, 0.0)
        k = min(k, math.floor((w + 1e-6) / max(req.cpus, 0.001)))
    if req.gpu == "required" or (req.gpu == "preferred" and node.gpus >= 1):
        k = min(k, int(src.get("GPU", 0.0) + 1e-6))
    return max(0, k)


class JobManager:
    def __init__(self, store: JobStore, artifacts: ArtifactStore):
        self.store, self.artifacts = store, artifacts
        self.runners: dict[str, "JobRunner"] = {}
        self.suspects: dict[str, float] = {}  # node_id -> when it stopped answering
        self.lock = threading.RLock()
        self.closed = False

    # -- submitting -------------------------------------------------------------------------------

    def parse(self, spec: dict[str, Any]) -> DataParallelJob | DistillJob:
        kind = spec.get("kind", "data_parallel")
        cls = JOB_KINDS.get(kind)
        if cls is None:
            raise SmolforgeError(f"unknown job kind {kind!r}", where="job spec",
                                 fix=f"use one of {', '.join(JOB_KINDS)}")
        job = validate(cls, spec, where="job spec")
        if isinstance(job, DistillJob):
            from smolforge.distill.pipeline import check_run

            check_run(job.run_config("distill-check"))  # every setting, before anything starts
        return job

    def _check_distill_data(self, job: DistillJob) -> None:
        value = str(job.distill["data"])
        if value == "bundled":
            return
        if not value.startswith("upload:"):
            raise SmolforgeError(f"distill.data {value!r} is a path on the submitting machine", where="job spec",
                                 fix="submit with `smolforge submit`/`launch` or smolforge.Client, which upload "
                                     "the file to the coordinator first")
        if not self.artifacts.has_upload(value.split(":", 1)[1]):
            raise SmolforgeError(f"distill.data: upload {value[7:19]} is not on the coordinator",
                                 where="job spec", fix="upload the file again (Client.upload)")

    def _check_data(self, job: DataParallelJob) -> None:
        for key in ("path", "eval_path"):
            value = getattr(job.train.data, key)
            if value is None or value == "bundled":
                continue
            if not value.startswith("upload:"):
                raise SmolforgeError(f"train.data.{key} {value!r} is a path on the submitting machine",
                                     where="job spec",
                                     fix="submit with `smolforge submit`/`launch` or smolforge.Client, which upload "
                                         "the file to the coordinator first")
            if not self.artifacts.has_upload(value.split(":", 1)[1]):
                raise SmolforgeError(f"train.data.{key}: upload {value[7:19]} is not on the coordinator",
                                     where="job spec", fix="upload the file again (Client.upload)")

    def check_capacity(self, job: DataParallelJob, nodes: list[ray_glue.NodeInfo] | None = None) -> int:
        """Fail at once, listing every node, when the cluster cannot hold the job's workers."""
        nodes = nodes if nodes is not None else ray_glue.nodes()
        req = requirements_for(job)
        cands = ray_glue.check_placeable(req, nodes)
        total = sum(slots_on(n, req, use_available=False) for n in cands)
        if total < job.num_workers:
            listing = "\n".join(f"  - {n.describe()}" for n in nodes)
            raise SmolforgeError(
                f"the job needs {job.num_workers} workers of {job.cpus_per_worker:g} CPUs, but the nodes that can run "
                f"it have room for {total}; nodes:\n{listing}", where="placement",
                fix="lower --workers, join more workers (`smolforge worker join`), or lend the coordinator "
                    "(`smolforge job join ID`)")
        if job.global_batch % job.num_workers:
            raise SmolforgeError("batch size does not split evenly", fix="use a batch size that splits over the workers")
        return total

    def submit(self, spec: dict[str, Any]) -> str:
        if self.closed:
            raise SmolforgeError("the coordinator is shutting down", fix="retry once it is back")
        job = self.parse(spec)
        if isinstance(job, DistillJob):
            self._check_distill_data(job)
        else:
            self._check_data(job)
            self.check_capacity(job)
        job_id = self.store.create_job(job.kind, job.model_dump(mode="json"), name=job.name)
        self._start(job_id, "started")
        return job_id

    def _start(self, job_id: str, reason: str) -> "JobRunner":
        with self.lock:
            old = self.runners.get(job_id)
            if old is not None and old.is_alive():
                raise SmolforgeError(f"job {job_id} is already running", fix="pause or cancel it first")
            if self.store.get_job(job_id)["kind"] == "distill":
                from smolforge.cluster.distill_job import DistillRunner

                runner = DistillRunner(self, job_id, reason)
            else:
                runner = DPRunner(self, job_id, reason)
            self.runners[job_id] = runner
            runner.start()
            return runner

    def _runner_done(self, job_id: str, runner: "JobRunner") -> None:
        with self.lock:
            if self.runners.get(job_id) is runner:
                del self.runners[job_id]

    # -- control ----------------------------------------------------------------------------------

    def _job(self, job_id: str) -> dict:
        return self.store.get_job(job_id)

    def pause(self, job_id: str) -> dict:
        job = self._job(job_id)
        job_id = job["id"]
        runner = self.runners.get(job_id)
        if job["state"] == "running" and runner is not None:
            runner.request("pause")
            self.store.add_event(job_id, "pause_requested", "pause requested: checkpoint, then release workers")
        elif job["state"] == "pending":
            if runner is not None:
                runner.request("pause")
            else:
                self.store.set_state(job_id, "paused", "paused before it started")
        elif job["state"] != "paused":
            raise SmolforgeError(f"job {job_id} is {job['state']}; only running or pending jobs can be paused",
                                 fix=f"see `smolforge job show {job_id}`")
        return self._job(job_id)

    def resume(self, job_id: str) -> dict:
        job = self._job(job_id)
        job_id = job["id"]
        if job["state"] != "paused":
            raise SmolforgeError(f"job {job_id} is {job['state']}; only paused jobs can be resumed",
                                 fix=f"see `smolforge job show {job_id}`")
        runner = self.runners.get(job_id)
        if runner is not None and runner.is_alive():
            runner.join(timeout=30)
        self.store.set_state(job_id, "pending", "resume requested")
        if job["kind"] == "distill":
            self._start(job_id, "resumed: verified teacher shards are reused, students start again")
            return self._job(job_id)
        ckpt = self.artifacts.latest_checkpoint(job_id)
        self._start(job_id, f"resumed from {ckpt}" if ckpt else "resumed (no checkpoint yet: from the start)")
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
            self.store.set_state(job_id, "cancelled", "cancelled", force=True)
        return self._job(job_id)

    def join(self, job_id: str, node: str | None = None) -> dict:
        """Lend the coordinator node (default) or another node to a running data-parallel job."""
        job = self._job(job_id)
        job_id = job["id"]
        runner = self.runners.get(job_id)
        if job["kind"] == "distill":
            raise SmolforgeError(f"job {job_id} is a distillation job; `job join` lends nodes to data-parallel jobs",
                                 fix="a distillation run places teachers and students on every eligible worker itself")
        if job["state"] != "running" or runner is None:
            raise SmolforgeError(f"job {job_id} is {job['state']}; nodes can join running jobs only",
                                 fix=f"resume it first (`smolforge job resume {job_id}`)")
        spec = DataParallelJob.model_validate(job["spec"])
        target = node or COORDINATOR
        nodes = ray_glue.nodes()
        if target == COORDINATOR:
            ray_glue.check_placeable(coordinator_requirements(spec), nodes)
        else:
            req = requirements_for(spec)
            ray_glue.check_placeable(ray_glue.Requirements(model=req.model, cpus=req.cpus, gpu=req.gpu,
                                                           allowed_nodes=[target]), nodes)
        if target in spec.lent_nodes or target in runner.pending_joins:
            raise SmolforgeError(f"{target} already joined job {job_id}", fix="nothing to do")
        world = max(runner.world, 1) + len(runner.pending_joins) + 1
        if spec.global_batch % world:
            raise SmolforgeError(
                f"the job's global batch ({spec.global_batch}) does not split over {world} workers",
                fix=f"jobs that should take extra nodes need a global batch divisible by the new worker count "
                    f"(e.g. {world * max(1, spec.global_batch // world)})")
        runner.request("join", target)
        when = ("the next checkpoint" if spec.train.save_every else "the next step") if runner.training \
            else "the placement of its group"
        self.store.add_event(job_id, "join_requested", f"{target} will join at {when}", {"node": target})
        return self._job(job_id)

    # -- lifecycle --------------------------------------------------------------------------------

    def recover(self) -> list[str]:
        """After a (re)start: every job that was running or pending runs again from its checkpoint."""
        resumed = []
        for job in self.store.list_jobs(states=("running", "pending")):
            if (job.get("spec") or {}).get("kind") == "distill":
                where = "its kept teacher shards and student checkpoints"
            else:
                ckpt = self.artifacts.latest_checkpoint(job["id"])
                where = f"checkpoint {ckpt}" if ckpt else "the start (no checkpoint yet)"
            if job["state"] == "running":
                self.store.set_state(job["id"], "pending", f"coordinator restarted; resuming from {where}", force=True)
            self.store.add_event(job["id"], "reattached", f"coordinator restarted; job resumes from {where}")
            self._start(job["id"], f"resumed after coordinator restart from {where}")
            resumed.append(job["id"])
        return resumed

    def active(self) -> list[str]:
        with self.lock:
            return [j for j, r in self.runners.items() if r.is_alive()]

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop watching jobs (they stay 'running' in the store and resume on the next start)."""
        self.closed = True
        with self.lock:
            runners = list(self.runners.values())
        for r in runners:
            r.abandon = True
        for r in runners:
            r.join(timeout=timeout / max(1, len(runners)))

    def wait(self, job_id: str, timeout: float | None = None, on_update: Callable[[dict], None] | None = None) -> dict:
        """Block until the job is final or paused (for the embedded CLI path)."""
        deadline = None if timeout is None else time.time() + timeout
        while True:
            job = self._job(job_id)
            if on_update:
                on_update(job)
            runner = self.runners.get(job["id"])
            if job["state"] in FINAL or (job["state"] == "paused" and (runner is None or not runner.is_alive())):
                return job
            if deadline and time.time() > deadline:
                return job
            time.sleep(0.5)

    # -- node health ------------------------------------------------------------------------------

    def probe_node(self, node_id: str, timeout: float = 4.0) -> bool:
        """Does the node still run tasks? (Ray needs ~15 s to declare a silent node dead.)"""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        alive = {n.node_id for n in ray_glue.nodes()}
        if node_id not in alive:
            return False
        ref = _probe.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                             max_retries=0).remote()
        try:
            return ray.get(ref, timeout=timeout) is True
        except Exception:
            try:
                ray.cancel(ref, force=True)
            except Exception:
                pass
            return False

    def healthy_nodes(self) -> list[ray_glue.NodeInfo]:
        nodes = ray_glue.nodes()
        alive_ids = {n.node_id for n in nodes}
        for nid, since in list(self.suspects.items()):
            if nid not in alive_ids:
                continue  # Ray has caught up: it is gone from the live table
            if time.time() - since > 20 and self.probe_node(nid, timeout=2):
                del self.suspects[nid]
        return [n for n in nodes if n.node_id not in self.suspects]


def _probe_fn() -> bool:
    return True


class _LazyRemote:
    def __init__(self, fn):
        self.fn, self._remote = fn, None

    def options(self, **kw):
        import ray

        if self._remote is None:
            self._remote = ray.remote(self.fn)
        return self._remote.options(**kw)


_probe = _LazyRemote(_probe_fn)


class JobRunner(threading.Thread):
    """One job's thread: runs `_run` until the job is completed, failed, cancelled or paused.

    What every kind shares: pause/cancel requests land in `want`, `abandon` means the coordinator
    is shutting down (the job stays running in the store and resumes on the next start), and a
    crash of the runner itself is recorded on the job instead of dying silently.
    """

    def __init__(self, mgr: JobManager, job_id: str, reason: str):
        super().__init__(daemon=True, name=f"job-{job_id}")
        self.mgr, self.job_id, self.reason = mgr, job_id, reason
        self.store = mgr.store
        self.want: str | None = None  # pause | cancel
        self.abandon = False
        self.finished = threading.Event()

    def _run(self) -> None:
        raise NotImplementedError

    def _cleanup(self) -> None:
        """Release whatever the job still holds; runs after `_run`, however it ended."""

    def run(self) -> None:
        try:
            self._run()
        except Exception as err:  # a bug or an unexpected Ray failure: record it, never die silently
            if not self.abandon:
                self.store.add_event(self.job_id, "error", f"job runner failed: {_short(err)}",
                                     {"traceback": traceback.format_exc()[-4000:]})
                try:
                    self.store.set_state(self.job_id, "failed", f"failed: {_short(err)}", error=_short(err), force=True)
                except Exception:
                    pass
        finally:
            self._cleanup()
            self.finished.set()
            self.mgr._runner_done(self.job_id, self)


class DPRunner(JobRunner):
    """Runs one data-parallel job until it is completed, failed, cancelled or paused."""

    def __init__(self, mgr: JobManager, job_id: str, reason: str):
        super().__init__(mgr, job_id, reason)
        self.pending_joins: list[str] = []
        self.control = None
        self.group = None
        self.world = 0
        self.training = False  # a placed group is running: a join now waits for its next checkpoint
        self._lock = threading.Lock()

    # -- requests from the API thread ---------------------------------------------------------

    def request(self, what: str, node: str | None = None) -> None:
        with self._lock:
            if what in ("pause", "cancel"):
                if self.want != "cancel":
                    self.want = what
                if self.control is not None:
                    self.control.set_stop.remote(self.want)
            elif what == "join":
                self.pending_joins.append(node or COORDINATOR)
                if self.training:
                    self._ask_regroup()

    def _ask_regroup(self) -> None:
        """Have the running group stop at its next checkpoint (now, without checkpoints) and re-form.

        A join that arrives before a group is placed needs none of this: the next placement takes it
        in (`_take_joins`). One that arrives while a group is being placed is asked for once the group
        runs, so no join is lost however it races the placement.
        """
        spec = DataParallelJob.model_validate(self.store.get_job(self.job_id)["spec"])
        self.control.set_regroup.remote(bool(spec.train.save_every))

    def _pop_joins(self) -> list[str]:
        with self._lock:
            joins, self.pending_joins = self.pending_joins, []
        return joins

    def _take_joins(self, spec: DataParallelJob, why: str) -> DataParallelJob:
        """Fold the nodes that asked to join into the job's spec, so the next placement includes them."""
        joins = self._pop_joins()
        if not joins:
            return spec
        spec = spec.model_copy(update={"lent_nodes": spec.lent_nodes + joins})
        self.store.update_job(self.job_id, spec=spec.model_dump(mode="json"))
        self.store.add_event(self.job_id, "regrouped", f"{', '.join(joins)} joined {why}", {"nodes": joins})
        return spec

    # -- the loop ---------------------------------------------------------------------------------

    def _cleanup(self) -> None:
        self._release()
        if self.control is not None:
            import ray

            try:
                ray.kill(self.control, no_restart=True)
            except Exception:
                pass

    def _release(self) -> None:
        group, self.group = self.group, None
        if group is None:
            return
        members = list(group.members)
        group.release()
        for m in members:
            tid = f"{self.job_id}-g{group.attempt}-r{m.rank}"
            try:
                self.store.upsert_task(tid, self.job_id, "dp_rank", "released")
            except Exception:
                pass

    def _round_no(self) -> int:
        return sum(1 for t in self.store.tasks(self.job_id) if t["kind"] == "dp_group") + 1

    def _run(self) -> None:
        from smolforge.cluster.job_control import create_control

        job = self.store.get_job(self.job_id)
        if job["state"] in FINAL:
            return
        spec = DataParallelJob.model_validate(job["spec"])
        if job["state"] != "running":
            self.store.set_state(self.job_id, "running", f"running ({self.reason})")
        self.control = create_control(self.job_id, str(self.mgr.artifacts.root.resolve()))
        with self._lock:
            if self.want:
                self.control.set_stop.remote(self.want)
        failures = int(job.get("attempts") or 0)
        recovering: str | None = None
        while not self.abandon:
            if self.want:
                self._finish_stopped(self.want, "before the workers started")
                return
            round_no = self._round_no()
            spec = self._take_joins(spec, "before the group was placed")
            try:
                bundles, world, names = self._plan(spec, quick=recovering is not None)
            except SmolforgeError as err:
                if self.want:
                    continue  # paused or cancelled while waiting: handled at the top of the loop
                failures += 1
                self.store.update_job(self.job_id, attempts=failures)
                self.store.add_event(self.job_id, "placement_failed", err.render())
                if failures > spec.max_retries:
                    self.store.set_state(self.job_id, "failed", "failed: no place to run", error=err.what)
                    return
                continue
            from smolforge.parallel.worker_group import WorkerGroup

            group = WorkerGroup(self.job_id, round_no, bundles, self.control)
            self.group, self.world = group, world
            gid = f"{self.job_id}-g{round_no}"
            self.store.upsert_task(gid, self.job_id, "dp_group", "placing", attempt=round_no,
                                   max_retries=spec.max_retries, requirements=requirements_for(spec).to_dict())
            try:
                infos = group.start(spec.placement_timeout_s)
            except Exception as err:
                self._release()
                failures += 1
                self.store.update_job(self.job_id, attempts=failures)
                msg = err.render() if isinstance(err, SmolforgeError) else _short(err)
                self.store.upsert_task(gid, self.job_id, "dp_group", "failed", error=msg)
                self.store.add_event(self.job_id, "placement_failed", msg, task_id=gid)
                if failures > spec.max_retries:
                    self.store.set_state(self.job_id, "failed", "failed: could not place workers", error=msg)
                    return
                time.sleep(1)
                continue
            if self.want:  # paused or cancelled while the group was being placed
                self._release()
                self.store.upsert_task(gid, self.job_id, "dp_group", "released")
                continue
            for info in infos:
                self.store.upsert_task(f"{gid}-r{info['rank']}", self.job_id, "dp_rank", "running",
                                       rank=info["rank"], attempt=round_no, node_id=info["node_id"],
                                       node_name=info["node_name"], pid=info["pid"], max_retries=spec.max_retries)
            self.store.upsert_task(gid, self.job_id, "dp_group", "running")
            node_names = [i["node_name"] for i in infos]
            self.store.update_job(self.job_id, world_size=world, nodes=node_names)
            resume = self.mgr.artifacts.latest_checkpoint(self.job_id)
            cfg = self._cfg(spec, world)
            self.store.add_event(self.job_id, "placed",
                                 f"round {round_no}: {world} ranks on {', '.join(node_names)}"
                                 f" (batch {cfg['batch_size']} per rank, global {spec.global_batch})"
                                 + (f", from {resume}" if resume else ""),
                                 {"nodes": node_names, "world": world, "resume": resume}, task_id=gid)
            if recovering:
                self.store.add_event(self.job_id, "recovered",
                                     f"recovered after {recovering}: group re-formed on {', '.join(node_names)} "
                                     f"from {resume or 'the start'}", {"nodes": node_names, "resume": resume},
                                     task_id=gid)
                recovering = None
            with self._lock:
                self.training = True
                if self.pending_joins:  # asked for while this group was being placed
                    self._ask_regroup()
            refs = group.run(cfg, resume, spec.backend, spec.dist_timeout_s, spec.train.keep_last)
            outcome, detail = self._watch(group, refs)
            with self._lock:
                self.training = False
            if self.abandon:
                return
            if outcome == "completed":
                self._release()
                self.store.upsert_task(gid, self.job_id, "dp_group", "completed")
                late = self._pop_joins()
                if late:
                    self.store.add_event(self.job_id, "join_dropped",
                                         f"the job finished before {', '.join(late)} could join "
                                         f"(joins take effect at the next checkpoint)", {"nodes": late})
                self.store.set_state(self.job_id, "completed", f"completed: {detail.get('steps')} steps",
                                     result=detail)
                return
            if outcome in ("paused", "cancelled"):
                self._release()
                self.store.upsert_task(gid, self.job_id, "dp_group", "released")
                self._finish_stopped("pause" if outcome == "paused" else "cancel", detail.get("where", ""))
                return
            if outcome == "regroup":
                self._release()
                self.store.upsert_task(gid, self.job_id, "dp_group", "released")
                ray_get(self.control.reset.remote())
                spec = self._take_joins(spec, f"at step {detail.get('steps')}; re-forming the group")
                continue
            # a rank failed
            self._release()
            failures += 1
            self.store.update_job(self.job_id, attempts=failures)
            self.store.upsert_task(gid, self.job_id, "dp_group", "failed", error=detail.get("error"))
            rank = detail.get("rank")
            self.store.upsert_task(f"{gid}-r{rank}", self.job_id, "dp_rank", "failed", error=detail.get("error"))
            self.store.add_event(self.job_id, "worker_failed",
                                 f"rank {rank} on {detail.get('node_name')} failed: {detail.get('error')}"
                                 + (f"; nodes set aside: {', '.join(detail['lost'])}" if detail.get("lost") else ""),
                                 detail, task_id=f"{gid}-r{rank}")
            if failures > spec.max_retries:
                self.store.set_state(self.job_id, "failed", f"failed after {failures} worker failures "
                                     f"(max_retries {spec.max_retries})", error=detail.get("error"))
                return
            ckpt = self.mgr.artifacts.latest_checkpoint(self.job_id)
            self.store.add_event(self.job_id, "recovering",
                                 f"re-forming the group from {ckpt or 'the start'} (failure {failures} of "
                                 f"{spec.max_retries} allowed)", {"checkpoint": ckpt})
            recovering = f"rank {rank} failed on {detail.get('node_name')}"

    def _finish_stopped(self, what: str, where: str) -> None:
        if what == "pause":
            ckpt = self.mgr.artifacts.latest_checkpoint(self.job_id)
            self.store.set_state(self.job_id, "paused", f"paused{' ' + where if where else ''}"
                                 + (f" at {ckpt}" if ckpt else ""))
        else:
            self.store.set_state(self.job_id, "cancelled", "cancelled; workers released", force=True)

    def _cfg(self, spec: DataParallelJob, world: int) -> dict:
        cfg = spec.train.model_dump(mode="json")
        cfg["batch_size"] = spec.global_batch // world
        return cfg

    def _plan(self, spec: DataParallelJob, quick: bool) -> tuple[list[tuple[dict, dict]], int, list[str]]:
        """Bundles for this round: as many workers as fit (up to the ask), plus lent nodes."""
        req = requirements_for(spec)
        grace = 5.0 if quick else min(30.0, spec.placement_timeout_s)
        t0 = time.time()
        while True:
            if self.want:
                raise SmolforgeError("stopped while waiting for placement", fix="resume the job")
            nodes = self.mgr.healthy_nodes()
            lent_coord = COORDINATOR in spec.lent_nodes
            lent_other = [n for n in spec.lent_nodes if n != COORDINATOR]
            want = spec.num_workers + len(lent_other)
            pool = sum(slots_on(n, req, use_available=True) for n in req.candidates(nodes)) if req.candidates(nodes) else 0
            n_workers = min(want, pool)
            n_coord = 0
            if lent_coord:
                creq = coordinator_requirements(spec)
                if creq.candidates(nodes) and sum(slots_on(n, creq, True) for n in creq.candidates(nodes)) >= 1:
                    n_coord = 1
            while n_workers > 0 and spec.global_batch % (n_workers + n_coord):
                n_workers -= 1
            world = n_workers + n_coord
            full = n_workers == want and n_coord == int(lent_coord)
            waited = time.time() - t0
            if world >= 1 and spec.global_batch % world == 0 and (full or waited > grace):
                bundles = [req.bundle(nodes) for _ in range(n_workers)]
                if n_coord:
                    bundles.append(coordinator_requirements(spec).bundle(nodes))
                names = [n.name for n in req.candidates(nodes)]
                if not full:
                    self.store.add_event(self.job_id, "degraded",
                                         f"only {world} of {want + int(lent_coord)} workers available; "
                                         f"continuing with {world} (same global batch)")
                return bundles, world, names
            if waited > spec.placement_timeout_s:
                listing = "\n".join(f"  - {n.describe()}" for n in nodes) or "  (no live nodes)"
                raise SmolforgeError(f"no worker can take the job now; nodes:\n{listing}", where="placement",
                                     fix="join a worker (`smolforge worker join`) or free the busy ones")
            time.sleep(1.0)

    def _drain(self) -> None:
        if self.control is None:
            return
        items = ray_get(self.control.drain.remote(), timeout=15) or []
        if not items:
            return
        items.sort(key=lambda i: (i.get("ts", 0), i.get("step", 0)))
        rows: list[tuple[int, str, float]] = []
        last_step = None
        for it in items:
            kind = it.get("type")
            if kind == "step":
                last_step = it
                for name in ("loss", "lr", "grad_norm", "tokens_per_s"):
                    if it.get(name) is not None:
                        rows.append((it["step"], name, it[name]))
            elif kind == "eval":
                step = int(it.get("step", 0))
                for k, v in it.items():
                    if k not in ("type", "step", "ts", "rank") and isinstance(v, (int, float)):
                        rows.append((step, k, float(v)))
                self.store.add_event(self.job_id, "eval", "eval: " + ", ".join(
                    f"{k} {v:.4f}" for k, v in it.items() if k not in ("type", "ts", "rank", "step")
                    and isinstance(v, (int, float))), {k: v for k, v in it.items() if k != "type"}, ts=it.get("ts"))
            elif kind == "event":
                self.store.add_event(self.job_id, it.get("kind", "log"), it.get("message", ""), it.get("data"),
                                     ts=it.get("ts"))
        self.store.add_metrics(self.job_id, rows)
        if last_step is not None:
            self.store.update_job(self.job_id, step=last_step["step"], max_steps=last_step["max_steps"],
                                  samples_done=last_step["samples_done"], samples_total=last_step["samples_total"],
                                  loss=last_step["loss"], eta_s=last_step.get("eta_s"))

    def _watch(self, group, refs: list) -> tuple[str, dict]:
        import ray

        rank_of = {ref: i for i, ref in enumerate(refs)}
        pending = list(refs)
        results: dict[int, dict] = {}
        cancel_at = None
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
            for ref in ready:
                rank = rank_of[ref]
                try:
                    results[rank] = ray.get(ref, timeout=30)
                except Exception as err:
                    try:
                        self._drain()
                    except Exception:
                        pass
                    return "failed", self._diagnose(group, rank, err)
            try:
                self._drain()
            except Exception:
                pass
            if self.abandon:
                return "abandoned", {}
            if self.want == "cancel":
                cancel_at = cancel_at or time.time()
                if time.time() - cancel_at > CANCEL_GRACE_S:
                    return "cancelled", {"where": "(workers killed)"}
        r0 = results.get(0, {})
        stopped = r0.get("stopped")
        if stopped == "cancel":
            return "cancelled", {}
        if stopped == "pause":
            if self.want == "pause" or not self.pending_joins:
                return "paused", {"where": f"at step {r0.get('steps')}"}
            return "regroup", {"steps": r0.get("steps")}
        times = r0.get("step_times") or []
        gaps = sorted(b - a for a, b in zip(times, times[1:]))
        summary = {k: r0.get(k) for k in ("steps", "final_loss", "eval", "seconds", "tokens_per_s",
                                          "trainable_params", "total_params", "adapter_artifact", "setup_s",
                                          "first_step_ts", "world", "cpu_step_s")}
        summary["median_step_s"] = gaps[len(gaps) // 2] if gaps else None
        summary["nodes"] = [results[r]["node"]["node_name"] for r in sorted(results)]
        return "completed", summary

    def _diagnose(self, group, rank: int, err: BaseException) -> dict:
        """Which rank failed, where, and which nodes no longer answer (set aside for the next round)."""
        import ray

        info = group.members[rank].info if rank < len(group.members) else {}
        lost = []
        checked = set()
        for m in group.members:
            nid = m.info.get("node_id")
            if not nid or nid in checked:
                continue
            checked.add(nid)
            try:
                ray.get(m.actor.info.remote(), timeout=3)
                continue  # the actor answers: its node is fine
            except Exception:
                pass
            if not self.mgr.probe_node(nid, timeout=4):
                self.mgr.suspects[nid] = time.time()
                lost.append(m.info.get("node_name") or nid[:12])
        return {"rank": rank, "node_name": info.get("node_name"), "node_id": info.get("node_id"),
                "error": _short(err), "lost": lost}


def ray_get(ref, timeout: float = 30):
    import ray

    try:
        return ray.get(ref, timeout=timeout)
    except Exception:
        return None
