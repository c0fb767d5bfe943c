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

Elastic strategies (`elastic = True` on the strategy class: DiLoCo) change two of these: a rank
other than 0 that fails leaves the group (the control actor learns it, the others re-form their
group and go on, no restart), and a join places one more member at once, which the others take in
at their next outer step.

Submitting checks placement at once: a job that no node (or not enough nodes) can run fails with a
message that lists what each node has, instead of waiting forever as Ray alone would.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from ray.exceptions import RayError

from smolforge.cluster.workloads.data_parallel.job_control import create_control
from smolforge.cluster.control.jobstore import FINAL
from smolforge.cluster.control.placement import COORDINATOR, coordinator_requirements, requirements_for, slots_on
from smolforge.cluster.control.runner import CANCEL_GRACE_S, POLL_S, JobRunner, ray_get, short_error
from smolforge.cluster.workloads.data_parallel.reports import comm_summary, jsonable, sort_batch
from smolforge.cluster.control.specs import DataParallelJob
from smolforge.errors import SmolforgeError
from smolforge.parallel.strategies import STRATEGIES
from smolforge.parallel.summary import job_summary
from smolforge.cluster.workloads.data_parallel.worker_group import WorkerGroup
from smolforge.telemetry.sinks import run_name

if TYPE_CHECKING:
    from smolforge.cluster.control.manager import JobManager


class DPRunner(JobRunner):
    """Runs one data-parallel job until it is completed, failed, cancelled or paused."""

    def __init__(self, mgr: JobManager, job_id: str, reason: str):
        super().__init__(mgr, job_id, reason)
        self.pending_joins: list[str] = []
        self.control = None
        self.group = None
        self.world = 0
        self._comm: dict[int, dict] = {}  # each rank's latest communication report (this group)
        self.elastic = False  # the strategy lets members leave and join a running group
        self.joiners: list[WorkerGroup] = []  # members placed to join the running (elastic) group
        self.server = None  # the round's parameter server (strategies that need one: ssp, sync-ps, async-ps)
        self._server_polled = 0.0
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
                if self.training and not self.elastic:  # an elastic group takes it in where it runs
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
            except (RayError, ValueError):
                pass  # already gone

    def _release(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            import ray

            self._poll_server(server, force=True)
            try:
                ray.kill(server, no_restart=True)
            except (RayError, ValueError):
                pass  # already gone (its node died)
        joiners, self.joiners = self.joiners, []
        for g in joiners:
            members = list(g.members)
            g.release()
            for m in members:
                self.store.upsert_task(f"{self.job_id}-g{g.attempt}-r{m.rank}", self.job_id, "dp_rank", "released")
        group, self.group = self.group, None
        if group is None:
            return
        members = list(group.members)
        group.release()
        for m in members:
            tid = f"{self.job_id}-g{group.attempt}-r{m.rank}"
            self.store.upsert_task(tid, self.job_id, "dp_rank", "released")

    def _round_no(self) -> int:
        return sum(1 for t in self.store.tasks(self.job_id) if t["kind"] == "dp_group") + 1

    def _run(self) -> None:
        job = self.store.get_job(self.job_id)
        if job["state"] in FINAL:
            return
        spec = DataParallelJob.model_validate(job["spec"])
        self.elastic = STRATEGIES[spec.strategy].elastic
        if job["state"] != "running":
            self.store.set_state(self.job_id, "running", f"running ({self.reason})")
        self.control = create_control(self.job_id, str(self.mgr.artifacts.root.resolve()))
        with self._lock:
            if self.want:
                self.control.set_stop.remote(self.want)
        policy = self.failure_policy(spec.max_retries)
        recovering: str | None = None
        self._rank_nodes: dict[int, str] = {}
        self.open_sinks(self.monitor_root(spec.output_dir), tensorboard=bool(spec.train.tensorboard),
                        wandb=spec.train.wandb, config=spec.model_dump(mode="json"),
                        name_for=lambda series: run_name(spec.strategy, "worker", int(series[4:]), spec.train.lr,
                                                         spec.train.batch_size,
                                                         host=self._rank_nodes.get(int(series[4:]), "node")))
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
                decision = self.record_failure(policy, f"no place to run: {err.what}")
                self.store.add_event(self.job_id, "placement_failed", err.render())
                if not decision.retry:
                    self.store.set_state(self.job_id, "failed", f"failed: {decision.reason}", error=err.what)
                    return
                continue

            group = WorkerGroup(self.job_id, round_no, bundles, self.control)
            self.group, self.world = group, world
            self._comm = {}
            gid = f"{self.job_id}-g{round_no}"
            self.store.upsert_task(gid, self.job_id, "dp_group", "placing", attempt=round_no,
                                   max_retries=spec.max_retries,
                                   requirements=requirements_for(spec, self.mgr.embedded).to_dict())
            try:
                infos = group.start(spec.placement_timeout_s)
            except Exception as err:
                self._release()
                msg = err.render() if isinstance(err, SmolforgeError) else short_error(err)
                decision = self.record_failure(policy, "could not place the workers")
                self.store.upsert_task(gid, self.job_id, "dp_group", "failed", error=msg)
                self.store.add_event(self.job_id, "placement_failed", msg, task_id=gid)
                if not decision.retry:
                    self.store.set_state(self.job_id, "failed", f"failed: {decision.reason}", error=msg)
                    return
                time.sleep(max(1.0, decision.delay_s))
                continue
            self.mgr.placed(self.job_id)  # Ray's table shows the group now: the queue's claim can go
            if self.want:  # paused or cancelled while the group was being placed
                self._release()
                self.store.upsert_task(gid, self.job_id, "dp_group", "released")
                continue
            for info in infos:
                self._rank_nodes[info["rank"]] = info["node_name"]
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
            ray_get(self.control.start_members.remote(world))
            if STRATEGIES[spec.strategy].needs_server:
                try:
                    self._start_server(spec, infos, world, gid)
                except Exception as err:  # its node went away while it was placed: a new round
                    self._release()
                    msg = short_error(err)
                    decision = self.record_failure(policy, "could not start the parameter server")
                    self.store.upsert_task(gid, self.job_id, "dp_group", "failed", error=msg)
                    self.store.add_event(self.job_id, "placement_failed", f"parameter server: {msg}", task_id=gid)
                    if not decision.retry:
                        self.store.set_state(self.job_id, "failed", f"failed: {decision.reason}", error=msg)
                        return
                    continue
            with self._lock:
                self.training = True
                if self.pending_joins and not self.elastic:  # asked for while this group was being placed
                    self._ask_regroup()
            refs = group.run(cfg, resume, spec.backend, spec.dist_timeout_s, spec.train.keep_last, spec.strategy,
                             spec.strategy_config, upload_timeout_s=spec.checkpoint_upload_timeout_s,
                             balance=spec.balance, server=self.server)
            outcome, detail = self._watch(group, refs, spec, round_no, cfg)
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
                self.close_sinks()  # complete TensorBoard/W&B files before anyone sees "completed"
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
            rank = detail.get("rank")
            ckpt = self.mgr.artifacts.latest_checkpoint(self.job_id)
            decision = self.record_failure(policy, f"rank {rank} on {detail.get('node_name')} failed",
                                           checkpoint=ckpt)
            self.store.upsert_task(gid, self.job_id, "dp_group", "failed", error=detail.get("error"))
            self.store.upsert_task(f"{gid}-r{rank}", self.job_id, "dp_rank", "failed", error=detail.get("error"))
            self.store.add_event(self.job_id, "worker_failed",
                                 f"rank {rank} on {detail.get('node_name')} failed: {detail.get('error')}"
                                 + (f"; nodes set aside: {', '.join(detail['lost'])}" if detail.get("lost") else ""),
                                 detail, task_id=f"{gid}-r{rank}")
            if not decision.retry:
                self.store.set_state(self.job_id, "failed", f"failed: {decision.reason}", error=detail.get("error"))
                return
            self.store.add_event(self.job_id, "recovering", f"re-forming the group: {decision.reason}",
                                 {"checkpoint": ckpt})
            recovering = f"rank {rank} failed on {detail.get('node_name')}"

    def _start_server(self, spec: DataParallelJob, infos: list[dict], world: int, gid: str) -> None:
        """The round's parameter server, on a rank's node (not the coordinator's unless it was lent)."""
        from smolforge.cluster.workloads.data_parallel.param_server import server_node, start_server

        coordinators = {n.node_id for n in self.mgr.healthy_nodes() if n.role == "coordinator"}
        where = server_node(infos, coordinators)
        self.server = start_server(self.job_id, spec.strategy, spec.strategy_config, world, where["node_id"])
        self.store.upsert_task(f"{gid}-ps", self.job_id, "param_server", "running", node_id=where["node_id"],
                               node_name=where["node_name"], attempt=self._round_no() - 1)
        self.store.add_event(self.job_id, "param_server",
                             f"parameter server ({spec.strategy}) on {where['node_name']}",
                             {"node_name": where["node_name"], "node_id": where["node_id"]}, task_id=f"{gid}-ps")

    def _poll_server(self, server=None, force: bool = False) -> None:
        """The server's decisions (a straggler left the barrier) as events, its counters in the job's row."""
        server = server or self.server
        if server is None or (not force and time.time() - self._server_polled < 2.0):
            return
        self._server_polled = time.time()
        try:
            stats = ray_get(server.stats.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - a dead server fails the ranks; the runner handles it there
            return
        if not stats:  # no answer in time (its node is going): the ranks' calls fail and tell
            return
        self.store.add_logs(self.job_id, stats.pop("lines", []))
        for note in stats.pop("notes", []):
            self.store.add_event(self.job_id, note.get("kind", "param_server"), note.get("message", ""), note)
        self.server_stats = stats
        self.store.update_job(self.job_id, comm={**(self.store.get_job(self.job_id).get("comm") or {}),
                                                 "server": jsonable(stats)})

    def _finish_stopped(self, what: str, where: str) -> None:
        if what == "pause":  # a join asked for before the pause is kept: the resumed job places it
            self._take_joins(DataParallelJob.model_validate(self.store.get_job(self.job_id)["spec"]),
                             "while the job paused; placed when it resumes")
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
        """Bundles for this round: the workers asked for, plus lent nodes.

        The manager's queue started the job when that much was free, so a first round (or one after
        a pause or a join) waits for all of it, never starting on fewer. Only a round that recovers
        from a lost node (`quick`) takes fewer after a short grace: it re-forms on the nodes left,
        with the same global batch, instead of waiting for a replacement that may never come."""
        req = requirements_for(spec, self.mgr.embedded)
        grace = 5.0
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
                creq = coordinator_requirements(spec, self.mgr.embedded)
                if creq.candidates(nodes) and sum(slots_on(n, creq, True) for n in creq.candidates(nodes)) >= 1:
                    n_coord = 1
            while n_workers > 0 and spec.global_batch % (n_workers + n_coord):
                n_workers -= 1
            world = n_workers + n_coord
            full = n_workers == want and n_coord == int(lent_coord)
            waited = time.time() - t0
            if world >= 1 and spec.global_batch % world == 0 and (full or (quick and waited > grace)):
                bundles = [req.bundle(nodes) for _ in range(n_workers)]
                if n_coord:
                    bundles.append(coordinator_requirements(spec, self.mgr.embedded).bundle(nodes))
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
        batch = sort_batch(items)
        for series, kind, step, values in batch.series:
            self.log_series(series, kind, step, values)
        for kind, message, data, ts in batch.events:
            self.store.add_event(self.job_id, kind, message, data, ts=ts)
        self.store.add_metrics(self.job_id, batch.rows)
        self.store.add_logs(self.job_id, batch.lines)
        if batch.comm:
            self._comm.update(batch.comm)
            self.store.update_job(self.job_id, comm=comm_summary(self._comm, getattr(self, "server_stats", None)))
        last = batch.last_step
        if last is not None:
            self.store.update_job(self.job_id, step=last["step"], max_steps=last["max_steps"],
                                  samples_done=last["samples_done"], samples_total=last["samples_total"],
                                  loss=last["loss"], eta_s=last.get("eta_s"))

    def _drain_quietly(self) -> None:
        """Drain the control actor's reports; a lost control actor costs the progress rows, nothing else."""
        try:
            self._drain()
        except RayError as err:
            self.store.add_event(self.job_id, "log", f"progress reports lost: {short_error(err)}")

    def _watch(self, group, refs: list, spec: DataParallelJob, round_no: int, cfg: dict) -> tuple[str, dict]:
        import ray

        rank_of = {ref: i for i, ref in enumerate(refs)}
        pending = list(refs)
        results: dict[int, dict] = {}
        cancel_at = None
        next_member = len(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
            for ref in ready:
                rank = rank_of[ref]
                try:
                    results[rank] = ray.get(ref, timeout=30)
                except RayError as err:  # the rank's task failed, or its process or node died
                    self._drain_quietly()
                    if self.elastic and rank != 0 and 0 not in results and pending:
                        self._member_left(group, round_no, rank, err)  # the others re-form and go on
                        continue
                    return "failed", self._diagnose(group, rank, err)
            waiting = [rank_of[r] for r in pending if rank_of[r] >= len(refs)]
            if (0 in results and pending and len(waiting) == len(pending) and self.server is None
                    and not set(waiting) & set(ray_get(self.control.taken_in.remote()))):
                # (a parameter server's joiner needs no group: it trains from the moment it is placed)
                # the group finished before taking these joiners in: they would wait for nothing (a joiner
                # it did take in is training with it, and its result may come back after rank 0's)
                self.store.add_event(self.job_id, "join_dropped",
                                     f"the job finished before member(s) {', '.join(map(str, waiting))} could "
                                     "join (joins take effect at the next outer step)", {"members": waiting})
                break
            if self.elastic and self.pending_joins and not self.want and 0 not in results:
                for member, ref in self._admit(spec, round_no, cfg, next_member, len(refs)):
                    rank_of[ref] = member
                    pending.append(ref)
                    next_member = member + 1
            self._drain_quietly()
            self._poll_server()
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
        summary = job_summary(results)  # each key one meaning for every strategy (final_loss: merged from the ranks)
        if self.server is not None:
            self._poll_server(force=True)
            summary["server"] = jsonable(getattr(self, "server_stats", {}))
        return "completed", summary

    def _member_left(self, group, round_no: int, rank: int, err: BaseException) -> None:
        """An elastic group's member died: the control actor lets the others re-form without it."""
        ray_get(self.control.member_left.remote(rank))
        if self.server is not None:
            self.server.member_left.remote(rank)  # its unfinished parts go to the others (fire and forget)
        info = next((m.info for g in [group, *self.joiners] for m in g.members if m.rank == rank), {})
        tid = f"{self.job_id}-g{round_no}-r{rank}"
        self.store.upsert_task(tid, self.job_id, "dp_rank", "failed", error=short_error(err))
        self.store.add_event(self.job_id, "member_left",
                             f"rank {rank} on {info.get('node_name')} left the group ({short_error(err)}); the "
                             "others re-form their group and carry on, no restart",
                             {"rank": rank, "node_name": info.get("node_name")}, task_id=tid)

    def _admit(self, spec: DataParallelJob, round_no: int, cfg: dict, first: int, world: int) -> list[tuple[int, object]]:
        """Place each node that asked to join as a new member of the running elastic group; returns
        (member id, ref) per member started. The group takes each in at its next outer step."""
        out = []
        for node in self._pop_joins():
            member = first + len(out)
            req = (coordinator_requirements(spec, self.mgr.embedded) if node == COORDINATOR
                   else requirements_for(spec, self.mgr.embedded))
            joiner = WorkerGroup(self.job_id, round_no, [req.bundle(self.mgr.healthy_nodes())], self.control,
                                 first_rank=member)
            try:
                info = joiner.start(min(60.0, spec.placement_timeout_s))[0]
            except Exception as err:
                joiner.release()
                msg = err.render() if isinstance(err, SmolforgeError) else short_error(err)
                self.store.add_event(self.job_id, "join_failed", f"{node} could not be placed to join: {msg}",
                                     {"node": node})
                continue
            self.joiners.append(joiner)
            self.store.upsert_task(f"{self.job_id}-g{round_no}-r{member}", self.job_id, "dp_rank", "running",
                                   rank=member, attempt=round_no, node_id=info["node_id"],
                                   node_name=info["node_name"], pid=info["pid"], max_retries=spec.max_retries)
            # kept in the spec: a resumed job places it from the start
            spec = spec.model_copy(update={"lent_nodes": spec.lent_nodes + [node]})
            self.store.update_job(self.job_id, spec=spec.model_dump(mode="json"))
            self.store.add_event(self.job_id, "member_joining",
                                 f"{node} placed as member {member} on {info['node_name']}; the group takes it in at "
                                 "its next outer step", {"node": node, "member": member})
            ref = joiner.run(cfg, None, spec.backend, spec.dist_timeout_s, spec.train.keep_last, spec.strategy,
                             spec.strategy_config, upload_timeout_s=spec.checkpoint_upload_timeout_s,
                             balance=spec.balance, join_world=world, server=self.server)[0]
            out.append((member, ref))
        return out

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
            except RayError:
                pass  # no answer: probe the node itself
            if not self.mgr.probe_node(nid, timeout=4):
                self.mgr.suspects[nid] = time.time()
                lost.append(m.info.get("node_name") or nid[:12])
        return {"rank": rank, "node_name": info.get("node_name"), "node_id": info.get("node_id"),
                "error": short_error(err), "lost": lost}

