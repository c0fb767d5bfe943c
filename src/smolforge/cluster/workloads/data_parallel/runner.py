"""A data-parallel job's runner: rounds of one gang-scheduled worker group, from the last checkpoint.

One runner thread per active job, in the coordinator process (or in the CLI process for the
embedded cluster: same code). Each attempt (`start_attempt`) is a *round*: it places a worker
group, starts every rank from the newest checkpoint in the artifact store, and `poll` watches it.
What a round comes to is an `Outcome`; the base runner applies it (the job's FailurePolicy, its
state):

- completed      → the final adapter is already in the artifact store; the job completes.
- a rank failed  → the whole group is released at once (the others would block in all-reduce), the
                   failed node is probed and set aside if it does not answer, and, as the policy
                   decides, a new round starts on the remaining or replacement nodes from the last
                   checkpoint, with each worker's batch resized so the global batch is unchanged.
                   Each failure and recovery is an event.
- pause          → rank 0 checkpoints, every actor is released; resume is a new round.
- cancel         → actors are killed (processes gone within seconds).
- join           → a node lent with `job join` (`joining.py`): at the next checkpoint boundary the group
                   stops and re-forms with the new node (a `Regroup`); a join before the group is placed is in its first round, and one
                   the job outlives (it finished first) is an event, never silently lost.
- leave          → a lent node given back (`job leave`, `leaving.py`): at the next checkpoint the group
                   stops and re-forms without it (a `Regroup`); never a failure.

Elastic strategies (`elastic = True` on the strategy class: DiLoCo) change two of these: a rank
other than 0 that fails leaves the group (the control actor learns it, the others re-form their
group and go on, no restart), and a join places one more member at once, which the others take in
at their next outer step; a leave takes the node's members out at their next boundary, as if lost.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ray.exceptions import RayError

from smolforge.cluster.workloads.data_parallel.job_control import create_control
from smolforge.cluster.workloads.data_parallel.joining import NodeJoining
from smolforge.cluster.workloads.data_parallel.leaving import NodeLeaving
from smolforge.cluster.nodes import ray_glue
from smolforge.cluster.control.placement import COORDINATOR, requirements_for, round_plan
from smolforge.cluster.control.runner import (
    CANCEL_GRACE_S, POLL_S, Cancelled, Completed, Failed, JobRunner, Outcome, Paused, Regroup, RunnerContext,
    ray_get, short_error,
)
from smolforge.cluster.workloads.data_parallel.reports import comm_summary, jsonable, record_batch, sort_batch
from smolforge.cluster.control.specs import DataParallelJob
from smolforge.errors import SmolforgeError
from smolforge.parallel.strategies import strategy_class
from smolforge.parallel.summary import job_summary
from smolforge.cluster.workloads.data_parallel.worker_group import WorkerGroup, rank_task
from smolforge.parallel.rank_task import RankPlan, RankResult
from smolforge.telemetry.sinks import run_name


@dataclass
class Round:
    """One placed group being watched: its ranks' refs, the results back so far."""

    no: int
    gid: str  # its task id: `<job>-g<no>`
    group: WorkerGroup
    cfg: dict
    refs: list
    rank_of: dict = field(default_factory=dict)  # ref -> rank (or member id, for an elastic joiner)
    pending: list = field(default_factory=list)
    results: dict[int, RankResult] = field(default_factory=dict)
    cancel_at: float | None = None
    next_member: int = 0

    def __post_init__(self) -> None:
        self.rank_of = {ref: i for i, ref in enumerate(self.refs)}
        self.pending = list(self.refs)
        self.next_member = len(self.refs)


class DPRunner(NodeJoining, NodeLeaving, JobRunner):
    """Runs one data-parallel job until it is completed, failed, cancelled or paused."""

    retry_words = "re-forming the group"

    def __init__(self, ctx: RunnerContext, job_id: str, spec: DataParallelJob, reason: str):
        super().__init__(ctx, job_id, spec, reason)
        self.spec: DataParallelJob = spec
        self.elastic = strategy_class(spec.strategy).elastic  # the strategy lets members leave and join a running group
        self.pending_joins: list[str] = []
        self.control = None
        self.group = None
        self.round: Round | None = None
        self.world = 0
        self._comm: dict[int, dict] = {}  # each rank's latest communication report (this group)
        self._auto_plan: dict | None = None  # `--strategy auto`: the latest round's decision (its event's data)
        self.joiners: list[WorkerGroup] = []  # members placed to join the running (elastic) group
        self.server = None  # the round's parameter server (strategies that need one: ssp, sync-ps, async-ps)
        self.server_stats: dict | None = None
        self._server_polled = 0.0
        self._rank_nodes: dict[int, str] = {}
        self.lost_rank = False  # the last round lost a rank: the next may start on fewer after a grace
        self.training = False  # a placed group is running: a join now waits for its next checkpoint
        self._lock = threading.Lock()
        self.init_leaving()

    def max_retries(self) -> int:
        return self.spec.max_retries

    # -- requests from the API thread ---------------------------------------------------------

    def request(self, what: str) -> None:
        with self._lock:
            super().request(what)
            if self.want and self.control is not None:
                self.control.set_stop.remote(self.want)

    # -- one round ------------------------------------------------------------------------------

    def _begin(self) -> None:
        """What the job keeps across its rounds: the control actor and the metric sinks."""
        spec = self.spec
        self.control = create_control(self.job_id, str(self.ctx.artifacts.root.resolve()))
        with self._lock:
            if self.want:
                self.control.set_stop.remote(self.want)
        self.open_sinks(self.monitor_root(spec.output_dir), tensorboard=bool(spec.train.tensorboard),
                        wandb=spec.train.wandb, config=spec.model_dump(mode="json"),
                        name_for=lambda series: run_name(spec.strategy, "worker", int(series[4:]), spec.train.lr,
                                                         spec.train.batch_size,
                                                         host=self._rank_nodes.get(int(series[4:]), "node")))

    def _round_no(self) -> int:
        return sum(1 for t in self.store.tasks(self.job_id) if t["kind"] == "dp_group") + 1

    def start_attempt(self) -> Outcome | None:
        if self.control is None:
            self._begin()
        self._take_joins("before the group was placed")
        self.take_leaves("placement", None, "before the group was placed; it is placed without it")
        round_no = self._round_no()
        try:
            bundles, world, n_coord = self._plan(self.spec, quick=self.lost_rank)
        except SmolforgeError as err:
            if self.want:
                return Regroup("stopped while waiting for placement")  # the base sees the stop request
            self.store.add_event(self.job_id, "placement_failed", err.render())
            return Failed(f"no place to run: {err.what}", error=err.what)
        gid, brought = f"{self.job_id}-g{round_no}", []
        # the placed workers lacking the model fetch it while the ranks' processes start
        bring = ((lambda placed: brought.append(self._bring_model(placed, gid, world)))
                 if self._model_travels() else None)
        infos = self._place(round_no, bundles, world, bring)
        if not isinstance(infos, list):
            return infos
        moved = brought[0] if brought else None
        if moved is not None:
            self.store.upsert_task(gid, self.job_id, "dp_group", "released" if isinstance(moved, Regroup) else "failed",
                                   error=getattr(moved, "error", None))
            self._release()
            return moved
        # the lent coordinator's bundle is the last: its rank is world - 1
        self.members = {i["rank"]: COORDINATOR if n_coord and i["rank"] == world - 1 else i["node_name"]
                        for i in infos}
        resume, cfg = self._announce(round_no, gid, infos, world)
        self.lost_rank = False
        ray_get(self.control.start_members.remote(world))
        plan = rank_task(self.spec, world, self._model_travels())  # the round's, whole to its ranks and server
        if plan.strategy_class.needs_server:
            try:
                self._start_server(plan, infos, world, gid)
            except Exception as err:  # noqa: BLE001 - its node went away while it was placed: a new round
                self._release()
                self.store.upsert_task(gid, self.job_id, "dp_group", "failed", error=short_error(err))
                self.store.add_event(self.job_id, "placement_failed", f"parameter server: {short_error(err)}",
                                     task_id=gid)
                return Failed("could not start the parameter server", error=short_error(err))
        with self._lock:
            self.training = True
            if self.pending_joins and not self.elastic:  # asked for while this group was being placed
                self._ask_regroup()
            if self.pending_leaves:  # the same: it may hold a rank of this group, which re-forms without it
                self._ask_regroup()
        self.round = Round(round_no, gid, self.group, cfg, self._launch(self.group, plan, resume))
        return None

    def _place(self, round_no: int, bundles: list, world: int,
               meanwhile: Callable[[list[tuple[str, str]]], None] | None = None) -> list[dict] | Outcome:
        """The round's group placed (each rank's placement info), or what came of trying; `meanwhile`
        (`WorkerGroup.start`) runs while the ranks' processes start."""
        spec = self.spec
        group = WorkerGroup(self.job_id, round_no, bundles, self.control)
        self.group, self.world = group, world
        self._comm = {}
        gid = f"{self.job_id}-g{round_no}"
        self.store.upsert_task(gid, self.job_id, "dp_group", "placing", attempt=round_no,
                               max_retries=spec.max_retries,
                               requirements=requirements_for(spec, self.ctx.embedded).to_dict())
        try:
            infos = group.start(spec.placement_timeout_s, meanwhile)
        except Exception as err:  # noqa: BLE001 - Ray's placement errors and ours alike
            self._release()
            msg = err.render() if isinstance(err, SmolforgeError) else short_error(err)
            self.store.upsert_task(gid, self.job_id, "dp_group", "failed", error=msg)
            self.store.add_event(self.job_id, "placement_failed", msg, task_id=gid)
            time.sleep(1.0)  # what held the slots may be going: a moment before the next round
            return Failed("could not place the workers", error=msg)
        self.ctx.placed(self.job_id)  # Ray's table shows the group now: the queue's claim can go
        if self.want:  # paused or cancelled while the group was being placed
            self._release()
            self.store.upsert_task(gid, self.job_id, "dp_group", "released")
            return Regroup("stopped while placing")
        return infos

    def _announce(self, round_no: int, gid: str, infos: list[dict], world: int) -> tuple[str | None, dict]:
        """The placed group's task rows and `placed` event (and `recovered`, after a failure); returns
        the checkpoint it starts from and the ranks' config."""
        spec = self.spec
        for info in infos:
            self._rank_nodes[info["rank"]] = info["node_name"]
            self.store.upsert_task(f"{gid}-r{info['rank']}", self.job_id, "dp_rank", "running",
                                   rank=info["rank"], attempt=round_no, node_id=info["node_id"],
                                   node_name=info["node_name"], pid=info["pid"], max_retries=spec.max_retries)
        self.store.upsert_task(gid, self.job_id, "dp_group", "running")
        node_names = [i["node_name"] for i in infos]
        self.store.update_job(self.job_id, world_size=world, nodes=node_names)
        resume = self.ctx.artifacts.latest_checkpoint(self.job_id)
        cfg = self._cfg(spec, world)
        self.store.add_event(self.job_id, "placed",
                             f"round {round_no}: {world} ranks on {', '.join(node_names)}"
                             f" (batch {cfg['batch_size']} per rank, global {spec.global_batch})"
                             + (f", from {resume}" if resume else ""),
                             {"nodes": node_names, "world": world, "resume": resume}, task_id=gid)
        self.recovered(f"group re-formed on {', '.join(node_names)} from {resume or 'the start'}",
                       {"nodes": node_names, "resume": resume}, task_id=gid)
        return resume, cfg

    def _launch(self, group: WorkerGroup, plan: RankPlan, resume: str | None) -> list:
        """Every rank of the placed group started on the round's plan; one ref per rank."""
        return group.run(plan, resume, server=self.server)

    def _cfg(self, spec: DataParallelJob, world: int) -> dict:
        cfg = spec.train.model_dump(mode="json")
        cfg["batch_size"] = spec.global_batch // world
        return cfg

    # -- watching a round ----------------------------------------------------------------------

    def poll(self) -> Outcome | None:
        """One look at the running round: results and failures in, joiners placed, reports drained."""
        import ray

        r = self.round
        ready, r.pending = ray.wait(r.pending, num_returns=len(r.pending), timeout=POLL_S)
        failed = self._collect(r, ready)
        if failed is not None:  # (a coordinator shutting down takes the ranks with it: no failure then)
            return None if self.abandon else self._round_failed(r, failed)
        if r.pending and self._joiners_left_behind(r):
            r.pending = []
        elif r.pending and self.elastic and self.pending_joins and not self.want and 0 not in r.results:
            for member, ref in self._admit(self.spec, r.no, r.cfg, r.next_member, len(r.refs)):
                r.rank_of[ref] = member
                r.pending.append(ref)
                r.next_member = member + 1
        self._drain_quietly()
        self._poll_server()
        return self._cancel_due(r) if r.pending else self._round_done(r)

    def _collect(self, r: Round, ready: list) -> dict | None:
        """The ready ranks' results; the failure of one that failed (None: none did, or only an elastic
        member that the others go on without)."""
        import ray

        for ref in ready:
            rank = r.rank_of[ref]
            try:
                r.results[rank] = ray.get(ref, timeout=30)
                self.members.pop(rank, None)
            except RayError as err:  # the rank's task failed, or its process or node died
                self._drain_quietly()
                if rank in self.leaving:  # asked to leave (`job leave`): gone as asked, never a failure
                    self.member_gone(r, rank, err)
                    continue
                if self.elastic and rank != 0 and 0 not in r.results and r.pending:
                    self._member_left(r.group, r.no, rank, err)  # the others re-form and go on
                    continue
                return self._diagnose(r.group, rank, err)
        return None

    def _joiners_left_behind(self, r: Round) -> bool:
        """The group finished before taking in the joiners still pending: they would wait for nothing
        (an event says so). A joiner it did take in trains with it, and its result may come back after
        rank 0's; a parameter server's joiner needs no group: it trains from the moment it is placed."""
        waiting = [r.rank_of[ref] for ref in r.pending if r.rank_of[ref] >= len(r.refs)]
        if not (0 in r.results and len(waiting) == len(r.pending) and self.server is None):
            return False
        if set(waiting) & set(ray_get(self.control.taken_in.remote()) or []):
            return False
        self.store.add_event(self.job_id, "join_dropped",
                             f"the job finished before member(s) {', '.join(map(str, waiting))} could "
                             "join (joins take effect at the next outer step)", {"members": waiting})
        return True

    def _cancel_due(self, r: Round) -> Outcome | None:
        """A cancel the ranks have not acted on within CANCEL_GRACE_S: their actors are killed."""
        if self.want != "cancel":
            return None
        r.cancel_at = r.cancel_at or time.time()
        if time.time() - r.cancel_at > CANCEL_GRACE_S:
            return self._round_stopped(r, "cancel", "(workers killed)")
        return None

    def _round_done(self, r: Round) -> Outcome:
        """Every rank answered: stopped (cancel, pause, or a pause to take in a join or let a node go), or
        completed."""
        r0 = r.results.get(0)
        stopped = r0.stopped if r0 else None
        if stopped == "cancel":
            return self._round_stopped(r, "cancel", "")
        if stopped == "pause":
            if self.want == "pause" or not (self.pending_joins or self.pending_leaves):
                return self._round_stopped(r, "pause", f"at step {r0.steps}")
            self._end_round(r)
            self.store.upsert_task(r.gid, self.job_id, "dp_group", "released")
            ray_get(self.control.reset.remote())
            at = "checkpoint" if self.spec.train.save_every else "step"
            if self.take_leaves(at, r0.steps, f"at the {at} of step {r0.steps}; the group re-forms without it"):
                self.lost_rank = True  # it may have held one of the job's own ranks: fewer, after a grace
            self._take_joins(f"at step {r0.steps}; re-forming the group")
            return Regroup("a node joined or left")
        summary = job_summary(r.results)  # each key one meaning for every strategy (final_loss: merged from the ranks)
        if self.server is not None:
            self._poll_server(force=True)
            summary["server"] = jsonable(self.server_stats or {})
        self._end_round(r)
        self.store.upsert_task(r.gid, self.job_id, "dp_group", "completed")
        late = self._pop_joins()
        if late:
            self.store.add_event(self.job_id, "join_dropped",
                                 f"the job finished before {', '.join(late)} could join "
                                 f"(joins take effect at the next checkpoint)", {"nodes": late})
        self.take_leaves("end", r0.steps if r0 else None, "as the job finished, before its next boundary")
        return Completed(f"completed: {summary.get('steps')} steps", result=summary)

    def _round_stopped(self, r: Round, what: str, where: str) -> Outcome:
        self._end_round(r)
        self.store.upsert_task(r.gid, self.job_id, "dp_group", "released")
        return self.stopped(what, where)

    def _round_failed(self, r: Round, detail: dict) -> Outcome:
        """A rank failed: the group goes, and the failure (with the checkpoint a retry starts from) goes
        to the base, whose FailurePolicy decides."""
        self._end_round(r)
        self.store.upsert_task(r.gid, self.job_id, "dp_group", "failed", error=detail.get("error"))
        self.lost_rank = True
        rank = detail.get("rank")
        ckpt = self.ctx.artifacts.latest_checkpoint(self.job_id)
        self.store.upsert_task(f"{r.gid}-r{rank}", self.job_id, "dp_rank", "failed", error=detail.get("error"))
        self.store.add_event(self.job_id, "worker_failed",
                             f"rank {rank} on {detail.get('node_name')} failed: {detail.get('error')}"
                             + (f"; nodes set aside: {', '.join(detail['lost'])}" if detail.get("lost") else ""),
                             detail, task_id=f"{r.gid}-r{rank}")
        return Failed(f"rank {rank} failed on {detail.get('node_name')}", checkpoint=ckpt, error=detail.get("error"))

    def _end_round(self, r: Round) -> None:
        """Release the round's group (and its server, its joiners)."""
        with self._lock:
            self.training = False
            self.members = {}
        self._release()
        self.round = None

    def stopped(self, what: str, where: str = "") -> Outcome:
        if what != "pause":
            return Cancelled("cancelled; workers released")
        # a join asked for before the pause is kept: the resumed job places it
        self._take_joins("while the job paused; placed when it resumes")
        self.take_leaves("pause", None, "as the job paused; it resumes without it")
        ckpt = self.ctx.artifacts.latest_checkpoint(self.job_id)
        return Paused(f"paused{' ' + where if where else ''}" + (f" at {ckpt}" if ckpt else ""))

    # -- releasing ------------------------------------------------------------------------------

    def end_attempt(self) -> None:
        with self._lock:
            self.training = False
        self._release()
        self.round = None

    def _cleanup(self) -> None:
        control, self.control = self.control, None
        if control is not None:
            import ray

            try:
                ray.kill(control, no_restart=True)
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
        for g in [*joiners, *([self.group] if self.group is not None else [])]:
            members = list(g.members)
            g.release()
            for m in members:
                self.store.upsert_task(f"{self.job_id}-g{g.attempt}-r{m.rank}", self.job_id, "dp_rank", "released")
        self.group = None

    # -- the parameter server, placement, reports ----------------------------------------------

    def _start_server(self, plan: RankPlan, infos: list[dict], world: int, gid: str) -> None:
        """The round's parameter server, on a rank's node (not the coordinator's unless it was lent)."""
        from smolforge.cluster.workloads.data_parallel.param_server import server_node, start_server

        coordinators = {n.node_id for n in self.ctx.healthy_nodes() if n.role == "coordinator"}
        where = server_node(infos, coordinators)
        self.server = start_server(plan, world, where["node_id"])
        self.store.upsert_task(f"{gid}-ps", self.job_id, "param_server", "running", node_id=where["node_id"],
                               node_name=where["node_name"], attempt=self._round_no() - 1)
        self.store.add_event(self.job_id, "param_server",
                             f"parameter server ({plan.strategy}) on {where['node_name']}",
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

    def _plan(self, spec: DataParallelJob, quick: bool) -> tuple[list[tuple[dict, dict]], int, int]:
        """Bundles for this round: the workers asked for, plus lent nodes (the lent coordinator's bundle
        last); returns (bundles, world, 1 if the coordinator takes a rank else 0). Worker nodes given
        back with `job leave` are kept off.

        The manager's queue started the job when that much was free, so a first round (or one after
        a pause or a join) waits for all of it, never starting on fewer. Only a round that recovers
        from a lost node (`quick`) takes fewer after a short grace: it re-forms on the nodes left,
        with the same global batch, instead of waiting for a replacement that may never come. The
        choice is `placement.round_plan`'s; this loop waits and asks again."""
        base = requirements_for(spec, self.ctx.embedded)
        grace = 5.0
        t0 = time.time()
        while True:
            if self.want:
                raise SmolforgeError("stopped while waiting for placement", fix="resume the job")
            nodes = self.ctx.healthy_nodes()
            waited = time.time() - t0
            plan = round_plan(spec, nodes, self.without_left(base, nodes), self.ctx.embedded, quick, waited, grace)
            if plan is not None:
                if not plan.full:
                    self.store.add_event(self.job_id, "degraded",
                                         f"only {plan.world} of {plan.asked} workers available; "
                                         f"continuing with {plan.world} (same global batch)")
                return plan.bundles, plan.world, plan.n_coord
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
        record_batch(self.store, self.job_id, batch, self.log_series)
        plan = [data for kind, _, data, _ in batch.events if kind == "strategy_plan"]  # `auto`'s choice, this round
        self._auto_plan = plan[-1] if plan else self._auto_plan
        if batch.comm or plan:
            self._comm.update(batch.comm)
            self.store.update_job(self.job_id, comm={**(comm_summary(self._comm, self.server_stats) if self._comm else {}),
                                                     **({"plan": self._auto_plan} if self._auto_plan else {})})

    def _drain_quietly(self) -> None:
        """Drain the control actor's reports; a lost control actor costs the progress rows, nothing else."""
        try:
            self._drain()
        except RayError as err:
            self.store.add_event(self.job_id, "log", f"progress reports lost: {short_error(err)}")

    def _member_left(self, group, round_no: int, rank: int, err: BaseException) -> None:
        """An elastic group's member died: the control actor lets the others re-form without it."""
        ray_get(self.control.member_left.remote(rank))
        self.members.pop(rank, None)
        if self.server is not None:
            self.server.member_left.remote(rank)  # its unfinished parts go to the others (fire and forget)
        info = next((m.info for g in [group, *self.joiners] for m in g.members if m.rank == rank), {})
        tid = f"{self.job_id}-g{round_no}-r{rank}"
        self.store.upsert_task(tid, self.job_id, "dp_rank", "failed", error=short_error(err))
        self.store.add_event(self.job_id, "member_left",
                             f"rank {rank} on {info.get('node_name')} left the group ({short_error(err)}); the "
                             "others re-form their group and carry on, no restart",
                             {"rank": rank, "node_name": info.get("node_name")}, task_id=tid)

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
            if not self.ctx.probe_node(nid, ray_glue.NODE_VERDICT_S):
                self.ctx.set_aside(nid)
                lost.append(m.info.get("node_name") or nid[:12])
        return {"rank": rank, "node_name": info.get("node_name"), "node_id": info.get("node_id"),
                "error": short_error(err), "lost": lost}

