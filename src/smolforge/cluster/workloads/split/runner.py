"""A `split` job: split learning with the trunk placed by the coordinator and kept alive by it.

An attempt is a job control actor (the artifact store's door for the actors), the client
(`client_side.ClientActor`, where `client_node` says: by default the coordinator's own node, which
holds the uploaded data; on the embedded cluster, this machine) and the trunk
(`trunk.TrunkActor`, on the node `trunk.choose_trunk_node` picks by the kind's requirements: a GPU
node first, one holding the model). The client starts training once the trunk listens, and ships the
trunk's half of every checkpoint to the coordinator before training on.

When the trunk's node dies (its status call fails, or goes unanswered and the node does not answer a
probe), the runner counts the loss against the job's `max_retries` (a `FailurePolicy` of its own,
subject `trunk`, as a distillation run counts its students' restarts), places the trunk again on
another node that can run it, which fetches the stored checkpoints first, and tells the client where
it is: the client reconnects, rolls back to the newest checkpoint both sides hold and goes on, in the
same attempt. The events say it: `trunk_placed`, `trunk_lost`, `trunk_placed` again, `recovered`.
With no node for the trunk during `replace_timeout_s`, the job fails saying why. A client that fails
(or a trunk that cannot start: its own making) ends the attempt; the base runner's FailurePolicy
decides on another, which resumes from the client's checkpoints and the stored trunk ones.

When the client's node dies (its status call fails and the node does not answer a probe:
`_client_lost`), the attempt ends as `Failed` from the newest stored client checkpoint, under the
same base FailurePolicy (the job's `attempts`); the next attempt places the client by
`placement.client_plan`: not on a node where a client of this job was lost, the coordinator's node
first (it holds the uploaded data), said in a `client_placed` event. The client ships its half of
every checkpoint to the coordinator after the trunk's (`client_side.CLIENT_CHECKPOINTS`); the new
client fetches them, the new trunk the trunk's, and both resume from the newest step they share.

The job's step, loss and samples are the client's (its loss is the only one: the labels never leave
it); each side is a task row with its node and state, and `trunk_step` (the step the trunk's session
stands at) is charted beside `loss`. Pause asks the client to checkpoint both sides and stop; cancel
stops both at once.

On a `--tls` cluster (Ray runs with the cluster's CA) the trunk's gRPC is TLS as well: the trunk
serves with its node's certificate and the client trusts only the cluster's CA, keeping the job's
token check (`trunk.serve_config`, `client_side.FollowingTrunkClient`); `trunk_placed` says which.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

from smolforge.cluster.control.kinds import TRUNK_CHECKPOINTS, split_trunk_requirements
from smolforge.cluster.control.placement import ClientPlan, client_plan
from smolforge.cluster.control.policy import FailurePolicy
from smolforge.cluster.control.runner import (
    POLL_S, Cancelled, Completed, Failed, JobRunner, Outcome, Paused, RunnerContext, own_making, short_error,
)
from smolforge.cluster.control.specs import SplitJob
from smolforge.cluster.nodes import ray_glue, ray_tls
from smolforge.cluster.workloads.split.client_side import CLIENT_CHECKPOINTS, ClientActor
from smolforge.cluster.workloads.split.trunk import TrunkActor, choose_trunk_node
from smolforge.errors import SmolforgeError

STATUS_EVERY_S = 1.0  # how often each side is asked how it stands
STATUS_TIMEOUT_S = 5.0  # a trunk this long without answering: is its node still there?
PLACE_EVERY_S = 1.0  # a trunk waiting for a node looks again this often


@dataclass
class Trunk:
    """One placement of the trunk."""

    actor: Any
    starting: Any  # its `start` call, until it answers
    plan: Any  # trunk.TrunkPlan
    number: int  # 1 for the first placement of the job's run, 2 for the next...
    deadline: float
    info: dict | None = None  # where it listens, once it does

    @property
    def task_id(self) -> str:
        return f"trunk-{self.number}"


class SplitRunner(JobRunner):
    """Runs one split job: the client trains against a trunk the runner keeps placed."""

    retry_words = "starting both sides again"

    def __init__(self, ctx: RunnerContext, job_id: str, spec: SplitJob, reason: str):
        super().__init__(ctx, job_id, spec, reason)
        self.spec: SplitJob = spec
        self.token = secrets.token_urlsafe(24)  # the trunk's: travels to both sides over Ray's authenticated channel
        self.tls = ray_tls.node_files_from_env() is not None  # a `--tls` cluster: the trunk's gRPC is TLS too
        self.trunk_failures = FailurePolicy(spec.max_retries)  # trunk losses inside a run (subject "trunk")
        self.placements = 0
        self.lost_on: set[str] = set()  # nodes where a trunk of this job was lost
        self.client_lost_on: set[str] = set()  # nodes where a client of this job was lost
        self._reset()

    def _reset(self) -> None:
        self.control: Any = None
        self.client: Any = None
        self.client_node = ""
        self.client_node_id = ""
        self.client_task = f"{self.job_id}-client"  # `client-2`... once it was placed again
        self.client_failed = False  # its node was lost: its task row says failed
        self.training: Any = None  # the client's `train` call
        self.trunk: Trunk | None = None
        self.status_ref: Any = None
        self.status_sent = 0.0
        self.mirrored = 0.0
        self.unplaced_since: float | None = None
        self.tried_at = 0.0
        self.pausing = False
        self.started = False  # a trunk of this attempt has listened
        self.done_ok = False  # the client's run completed: its task rows say so
        self.trunk_step: int | None = None
        self.step = 0
        self.since: tuple[float, int] | None = None  # (time, step) the ETA counts from

    def max_retries(self) -> int:
        return self.spec.max_retries

    def running_message(self) -> str:
        s = self.spec.split
        return (f"split learning {s.model}: trunk layers [{s.split_point_1}, {s.split_point_2}) on a worker, client "
                f"on {self.spec.client_node} ({self.reason})")

    # -- an attempt ---------------------------------------------------------------------------------

    def start_attempt(self) -> Outcome | None:
        import ray

        from smolforge.cluster.workloads.data_parallel.job_control import create_control

        ray_glue.connect()
        try:
            plan = self._client_plan()
            options = plan.req.ray_options(self.ctx.healthy_nodes())
        except SmolforgeError as err:
            return Failed(f"the client cannot run on {self.spec.client_node}", retryable=False, error=err.render())
        stored = self.ctx.artifacts.list(self.job_id, CLIENT_CHECKPOINTS)
        if plan.again:
            self.client_task = f"{self.job_id}-client-{len(self.client_lost_on) + 1}"
            self.store.add_event(self.job_id, "client_placed", f"the client placed again on {plan.node} ({plan.why}), "
                                 f"from the stored checkpoints {stored}", {"node": plan.node, "stored": stored})
        self.control = create_control(self.job_id, str(self.ctx.artifacts.root.resolve()))
        self.client = ray.remote(ClientActor).options(**options, max_concurrency=4, max_restarts=0,
                                                       max_task_retries=0).remote(self.job_id, self.spec, self.control,
                                                                                  self.token, self.tls)
        outcome = self._place_trunk()  # both actors start at once
        try:
            st = ray.get(self.client.status.remote(), timeout=self.spec.start_timeout_s)
        except Exception as err:  # noqa: BLE001 - its node went away, or no room there in time
            return Failed(f"the client did not start on {self.spec.client_node}: {short_error(err)}",
                          error=short_error(err))
        self.client_node = st["node"]
        self.client_node_id = next((n.node_id for n in self.ctx.healthy_nodes() if n.name == st["node"]), "")
        self.store.upsert_task(self.client_task, self.job_id, "split_client", "running", node_name=st["node"],
                               pid=st["pid"], attempt=int(self.store.get_job(self.job_id).get("attempts") or 0))
        self.training = self.client.train.remote(self.job_id, stored)  # it loads while the trunk does, then waits
        return outcome

    def _client_plan(self) -> ClientPlan:
        """The client's node (`placement.client_plan`): the coordinator's (outside the worker pool; the
        embedded cluster's one node) or the worker `client_node` names, holding the model; after a
        client of this job was lost there, another node (the coordinator's first), from the stored
        checkpoints."""
        return client_plan(self.spec.split.model, self.spec.client_node, self.spec.cpus, self.ctx.embedded,
                           self.ctx.healthy_nodes(), self.client_lost_on)

    def poll(self) -> Outcome | None:
        import ray

        if self.want == "cancel" or (self.want == "pause" and not self.started):
            return self.stopped(self.want)
        if self.want == "pause" and not self.pausing:
            self.client.request_stop.remote("pause")  # it checkpoints both sides, then its `train` returns
            self.pausing = True
        outcome = self._watch_trunk()
        if outcome is not None:
            return outcome
        if time.monotonic() - self.mirrored >= STATUS_EVERY_S:
            lost = self._mirror_client()
            if lost is not None:
                return lost
        ready, _ = ray.wait([self.training], timeout=POLL_S)
        return self._finish() if ready else None

    def stopped(self, what: str, where: str = "") -> Outcome:
        if what == "pause":
            return Paused(f"paused{' ' + where if where else ''}: both sides stopped; the client's checkpoints stay on "
                          f"its node, the trunk's on the coordinator")
        return Cancelled("cancelled; the client and the trunk stopped")

    def end_attempt(self) -> None:
        import ray

        if self.trunk is not None:
            self.store.upsert_task(f"{self.job_id}-{self.trunk.task_id}", self.job_id, "split_trunk",
                                   "completed" if self.done_ok else "stopped")
        for actor, stop in ((self.trunk.actor if self.trunk else None, True), (self.client, False),
                            (self.control, False)):
            if actor is None:
                continue
            try:
                if stop:
                    ray.get(actor.stop.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - gone already: the kill below is a no-op
                pass
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        if self.client is not None:
            self.store.upsert_task(self.client_task, self.job_id, "split_client",
                                   "completed" if self.done_ok else "failed" if self.client_failed else "stopped")
        self._reset()

    # -- the trunk ----------------------------------------------------------------------------------

    def _place_trunk(self) -> Outcome | None:
        """Place the trunk (it fetches the stored checkpoints, then loads); with no node for it now, try
        again later, failing the job after `replace_timeout_s` without one."""
        import ray

        self.tried_at = time.monotonic()
        req = split_trunk_requirements(self.spec, self.ctx.embedded)
        try:
            plan = choose_trunk_node(req, self.ctx.healthy_nodes(), self.lost_on)
        except SmolforgeError as err:
            if self.unplaced_since is None:
                self.unplaced_since = time.monotonic()
                self.store.add_event(self.job_id, "trunk_waiting", f"no node can run the trunk now; waiting up to "
                                     f"{self.spec.replace_timeout_s:g} s for one: {err.what}")
            if time.monotonic() - self.unplaced_since > self.spec.replace_timeout_s:
                return Failed(f"no node could run the trunk for {self.spec.replace_timeout_s:g}s", retryable=False,
                              error=err.render())
            return None
        self.unplaced_since = None
        self.placements += 1
        stored = self.ctx.artifacts.list(self.job_id, TRUNK_CHECKPOINTS)
        actor = ray.remote(TrunkActor).options(**plan.options, max_concurrency=4, max_restarts=0,
                                               max_task_retries=0).remote(self.job_id, self.placements, self.control)
        self.trunk = Trunk(actor, actor.start.remote(self.spec, self.token, self.job_id, stored, self.tls), plan,
                           self.placements, time.monotonic() + self.spec.start_timeout_s)
        self.store.upsert_task(f"{self.job_id}-{self.trunk.task_id}", self.job_id, "split_trunk", "placing",
                               node_name=plan.node.name, attempt=self.placements)
        return None

    def _watch_trunk(self) -> Outcome | None:
        """The trunk's placement, start and health, one look each poll (never blocking)."""
        t = self.trunk
        if t is None:
            return self._place_trunk() if time.monotonic() - self.tried_at >= PLACE_EVERY_S else None
        if t.info is None:
            return self._watch_start(t)
        return self._watch_health(t)

    def _watch_start(self, t: Trunk) -> Outcome | None:
        import ray

        ready, _ = ray.wait([t.starting], timeout=0)
        if not ready:
            return self._trunk_lost(t, "it did not start in time") if time.monotonic() > t.deadline else None
        try:
            t.info = ray.get(t.starting, timeout=30)
        except Exception as err:  # noqa: BLE001 - its process or node died as it started, or the model will not load
            if own_making(err):
                return Failed(f"the trunk did not start: {short_error(err)}", retryable=False, error=short_error(err))
            return self._trunk_lost(t, f"it did not start: {short_error(err)}")
        info = t.info
        again = f" again, from the stored checkpoints {info['stored']}" if t.number > 1 else ""
        self.store.add_event(self.job_id, "trunk_placed", f"trunk {t.number} placed{again} on {t.plan.node.name} "
                             f"({t.plan.why}), listening at {info['host']}:{info['port']} ({'TLS' if info['tls'] else 'plaintext'}) on {info['device']}",
                             {"node": t.plan.node.name, "placement": t.number, "address": f"{info['host']}:{info['port']}",
                              "pid": info["pid"], "stored": info["stored"], "device": info["device"], "tls": info["tls"]})
        self.store.upsert_task(f"{self.job_id}-{t.task_id}", self.job_id, "split_trunk", "running", pid=info["pid"])
        self.client.set_trunk.remote(info["host"], info["port"], t.actor)
        self.store.update_job(self.job_id, nodes=[self.client_node, t.plan.node.name], world_size=2)
        if not self.started:  # the attempt's first trunk: both sides hold their nodes now
            self.started = True
            self.ctx.placed(self.job_id)
            self.recovered(f"the trunk on {t.plan.node.name}; the client resumes from its checkpoints")
        return None

    def _watch_health(self, t: Trunk) -> Outcome | None:
        """Ask the trunk how it stands; one that fails to answer, or whose node stopped answering, is lost."""
        import ray

        if self.status_ref is None:
            if time.monotonic() - self.status_sent >= STATUS_EVERY_S:
                self.status_ref, self.status_sent = t.actor.status.remote(), time.monotonic()
            return None
        ready, _ = ray.wait([self.status_ref], timeout=0)
        if ready:
            ref, self.status_ref = self.status_ref, None
            try:
                st = ray.get(ref, timeout=10)
            except Exception as err:  # noqa: BLE001 - the trunk's process (or node) died
                return self._trunk_lost(t, short_error(err))
            self.store.add_logs(self.job_id, st.get("lines") or [])
            if st.get("step") is not None and st["step"] != self.trunk_step:
                self.trunk_step = st["step"]
                self.store.add_metrics(self.job_id, [(self.step, "trunk_step", float(st["step"]))])
            return None
        if time.monotonic() - self.status_sent > STATUS_TIMEOUT_S:
            if not self.ctx.probe_node(t.plan.node.node_id, ray_glue.NODE_VERDICT_S):
                self.ctx.set_aside(t.plan.node.node_id)
                return self._trunk_lost(t, f"its node {t.plan.node.name} stopped answering")
            self.status_ref = None  # slow, not gone: ask again
        return None

    def _trunk_lost(self, t: Trunk, why: str) -> Outcome | None:
        """Count the loss (subject `trunk`); place it again, or fail the job with the policy's reason."""
        import ray

        self.trunk, self.status_ref = None, None
        try:
            ray.kill(t.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - gone with its node
            pass
        self.store.upsert_task(f"{self.job_id}-{t.task_id}", self.job_id, "split_trunk", "failed", error=why)
        self.lost_on.add(t.plan.node.node_id)
        stored = self.ctx.artifacts.list(self.job_id, TRUNK_CHECKPOINTS)
        decision = self.trunk_failures.on_failure(f"the trunk on {t.plan.node.name} was lost ({why})", subject="trunk",
                                                  checkpoint=stored[-1] if stored else None)
        self.store.add_event(self.job_id, "trunk_lost", decision.reason,
                             {"node": t.plan.node.name, "placement": t.number, "checkpoint": decision.resume_from,
                              "client_step": self.step})
        if not decision.retry:
            return Failed(decision.reason, retryable=False)
        self.recovering = decision.reason  # the base's `recovered` says when the client has resumed
        return self._place_trunk()

    # -- the client ---------------------------------------------------------------------------------

    def _mirror_client(self) -> Outcome | None:
        """What the client did since the last look: progress, loss curve, checkpoints, resumes, its lines.
        A client that does not answer on a node that does not either is lost (`_client_lost`)."""
        import ray

        self.mirrored = time.monotonic()
        try:
            st = ray.get(self.client.status.remote(), timeout=STATUS_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - its process died, or its node: a dead client ends `train` too
            return self._client_lost(short_error(err))
        self.store.add_logs(self.job_id, st.get("lines") or [])
        metrics: list[tuple[int, str, float]] = []
        last: dict[str, Any] | None = None
        for item in st["items"]:
            if item["type"] == "step":
                last = item
                metrics += [(item["step"], k, float(item[k])) for k in ("loss", "lr", "grad_norm")]
            else:
                self._client_event(item)
        self.store.add_metrics(self.job_id, metrics)
        if last is not None:
            self.step = last["step"]
            if self.since is None or last["step"] <= self.since[1]:  # the first step seen, or after a roll back
                self.since = (last["ts"], last["step"])
            done = last["step"] - self.since[1]
            eta = (last["max_steps"] - last["step"]) * (last["ts"] - self.since[0]) / done if done > 0 else None
            self.store.update_job(self.job_id, step=last["step"], max_steps=last["max_steps"], loss=last["loss"],
                                  samples_done=last["samples_done"], samples_total=last["samples_total"], eta_s=eta)
        return None

    def _client_lost(self, why: str) -> Outcome | None:
        """The client's node stopped answering (or left the node table): a `Failed` outcome for the base
        runner's FailurePolicy, from the newest stored client checkpoint; the next attempt places the
        client elsewhere (`placement.client_plan`) and both sides resume from the newest checkpoint they
        share. None while the node still answers (a slow client, or one whose `train` ended: `_finish`)."""
        node = self.client_node_id
        listed = any(n.node_id == node for n in self.ctx.healthy_nodes())
        if not node or (listed and self.ctx.probe_node(node, ray_glue.NODE_VERDICT_S)):
            return None
        self.ctx.set_aside(node)
        self.client_lost_on.add(node)
        stored = self.ctx.artifacts.list(self.job_id, CLIENT_CHECKPOINTS)
        self.store.upsert_task(self.client_task, self.job_id, "split_client", "failed", error=why)
        self.client_failed = True
        return Failed(f"the client on {self.client_node} was lost ({why})", checkpoint=stored[-1] if stored else None)

    def _client_event(self, item: dict[str, Any]) -> None:
        kind, step = item["type"], item.get("step")
        if kind == "checkpoint":
            self.store.add_event(self.job_id, "checkpoint", f"shared checkpoint at step {step}: the client's on "
                                 f"{self.client_node}, both halves stored on the coordinator", {"step": step})
        elif kind == "checkpoint_not_shipped":
            self.store.add_event(self.job_id, "checkpoint_not_shipped", f"the trunk's checkpoint of step {step} did "
                                 f"not reach the coordinator: {item['error']}", {"step": step})
        elif kind == "resumed":
            self.store.add_event(self.job_id, "client_resumed", f"the client rolled back from step "
                                 f"{item['from_step']} to the shared checkpoint of step {step} and goes on",
                                 {"step": step, "from_step": item["from_step"]})
            trunk = self.trunk.plan.node.name if self.trunk else "?"
            self.recovered(f"the trunk on {trunk}; the client resumed from the shared checkpoint of step {step}",
                           {"step": step, "node": trunk})
        elif kind == "held":
            self.store.add_event(self.job_id, "held", item["message"], {"step": step, "task_id": "client"})

    def _finish(self) -> Outcome:
        """The client's `train` returned (or failed): the attempt's outcome."""
        import ray

        ref, self.training = self.training, None
        try:
            result = ray.get(ref, timeout=60)
        except Exception as err:  # noqa: BLE001 - the client failed, or its process or node died
            lost = self._mirror_client()
            if lost is not None:
                return lost
            return Failed(f"the client failed: {short_error(err)}", retryable=not own_making(err),
                          error=short_error(err))
        self._mirror_client()
        if result.get("stopped") == "pause":
            return self.stopped("pause", f"at step {result['steps']}")
        self.store.update_job(self.job_id, step=result["steps"], max_steps=result["steps"])
        self.done_ok = True
        keep = ("steps", "final_loss", "eval", "best_eval_loss", "rollbacks", "retries", "trunk_moves", "resumed_from",
                "bytes_sent", "bytes_received", "bytes_per_step", "trainable_params", "trunk_trainable_params",
                "total_params", "codec", "seconds")
        summary = {k: result.get(k) for k in keep} | {"trunk_placements": self.placements, "client_node": self.client_node}
        loss = result.get("final_loss")
        return Completed(f"completed: {result['steps']} steps" + (f", final loss {loss:.4f}" if loss is not None else "")
                         + f"; the trunk was placed {self.placements} time{'s' * (self.placements != 1)}",
                         result=summary)
