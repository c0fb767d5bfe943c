"""The base of every job runner: one thread per job that owns the job's lifecycle.

A kind's runner is a controller, as Ray Train's is: it says what happened, the base decides what
that means for the job. A kind implements `start_attempt()` (place and start what one attempt
runs) and `poll()` (watch it; None while it runs, else an `Outcome`), plus `end_attempt()` to
release what an attempt held. The base runs attempts until one ends the job, and it alone

- applies the job's `FailurePolicy` to a `Failed` outcome (retry from its checkpoint, or give up
  with the reason), for every kind alike: the count is the job's `attempts`;
- moves the job's `JobState` (the store's `set_state`): running, then completed, paused,
  cancelled or failed. No kind runner names a state.

A runner sees the control plane only through its `RunnerContext` (the store, the artifacts, the
node view, the queue's `placed` and the manager's `done`), never the `JobManager` itself, and it
is handed the job's spec already validated (at submit, or once on load after a restart).
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from ray.exceptions import RayError

from smolforge.cluster.control.artifacts import ArtifactStore
from smolforge.cluster.control.jobstore import JobStore
from smolforge.cluster.control.policy import Decision, FailurePolicy
from smolforge.cluster.control.states import JobState
from smolforge.cluster.nodes.ray_glue import NodeInfo
from smolforge.errors import SmolforgeError
from smolforge.telemetry.sinks import SeriesSinks

POLL_S = 0.25
CANCEL_GRACE_S = 3.0


def short_error(err: BaseException) -> str:
    cause = getattr(err, "cause", None)  # RayTaskError wraps the worker's own exception
    if isinstance(cause, BaseException) and cause is not err:
        err = cause
    if isinstance(err, SmolforgeError):  # whole: a planner's refusal on capped nodes runs ~600 characters, its fix last
        return err.render().replace("\n", " ")[:1200]
    text = str(err).strip().splitlines()
    first = next((t for t in text if t.strip()), "")
    return f"{type(err).__name__}: {first[:300]}"


def own_making(err: BaseException) -> bool:
    """Whether a failure is the job's own making (a SmolforgeError, raised here or in a task): the same
    input would fail again, so it is not retried. A lost node, process or actor is not."""
    cause = getattr(err, "cause", None)
    return isinstance(err, SmolforgeError) or isinstance(cause, SmolforgeError)


# -- what an attempt came to (a kind's `poll` says; the base decides) ----------------------------------

@dataclass(frozen=True)
class Completed:
    message: str  # the `state` event's text: "completed: 40 steps"
    result: dict[str, Any] | None = None  # the job's `result`


@dataclass(frozen=True)
class Paused:
    message: str


@dataclass(frozen=True)
class Cancelled:
    message: str


@dataclass(frozen=True)
class Regroup:
    """Start another attempt at once, with no failure counted (a data-parallel group re-forming to
    take in a node that joined, or a placement a stop request interrupted)."""

    why: str = ""


@dataclass(frozen=True)
class Failed:
    reason: str  # what failed, as a sentence: "rank 1 on w2 failed"
    retryable: bool = True  # False: the job's own making (bad input), never retried
    checkpoint: str | None = None  # where a retry starts from (None: the start)
    error: str | None = None  # the job's `error` if it gives up (default: the reason)


Outcome = Union[Completed, Paused, Cancelled, Regroup, Failed]


@dataclass(frozen=True)
class RunnerContext:
    """What a runner may use of the control plane, and nothing more (never the JobManager)."""

    store: JobStore
    artifacts: ArtifactStore
    embedded: bool  # one machine: a local model directory is held by every node
    healthy_nodes: Callable[[], list[NodeInfo]]  # Ray's live nodes less the ones set aside
    probe_node: Callable[[str, float], bool]  # (node id, timeout) -> does it answer
    set_aside: Callable[[str], None]  # a node that stopped answering: kept out of placements
    placed: Callable[[str], None]  # the job's tasks are placed: the queue's claim can go
    keep_spec: Callable[[str, Any], None]  # (job id, typed spec): a spec the runner changed, kept for resume
    done: Callable[[str, "JobRunner"], None]  # the runner ended (its thread is about to)
    serve_token_file: Callable[[], str | None] = field(default=lambda: None)  # embedded `serve`'s own token


class JobRunner(threading.Thread):
    """One job's thread: attempts until the job is completed, failed, cancelled or paused.

    What every kind shares: pause/cancel requests land in `want`, `abandon` means the coordinator
    is shutting down (the job stays running in the store and resumes on the next start), a failure
    goes through the job's FailurePolicy, and a crash of the runner itself is recorded on the job
    instead of dying silently.
    """

    retry_words = "starting again"  # what a retry does, in its `recovering` event

    def __init__(self, ctx: RunnerContext, job_id: str, spec: Any, reason: str):
        super().__init__(daemon=True, name=f"job-{job_id}")
        self.ctx, self.job_id, self.spec, self.reason = ctx, job_id, spec, reason
        self.store = ctx.store
        self.want: str | None = None  # pause | cancel
        self.abandon = False
        self.recovering: str | None = None  # the failure the current attempt recovers from
        self.finished = threading.Event()
        self.sinks: SeriesSinks | None = None  # TensorBoard / W&B, one run per rank or student

    # -- what a kind implements -------------------------------------------------------------------

    def start_attempt(self) -> Outcome | None:
        """Place and start one attempt; None once it runs, or the Outcome when it could not start."""
        raise NotImplementedError

    def poll(self) -> Outcome | None:
        """Watch the running attempt for about POLL_S (longer where the kind blocks, always minding
        `want` and `abandon`): None while it runs, else what it came to."""
        raise NotImplementedError

    def end_attempt(self) -> None:
        """Release what the attempt holds (actors, tasks): before a retry, and before a final state."""

    def stopped(self, what: str, where: str = "") -> Outcome:
        """The Outcome of a pause or cancel request (`what`), `where` the job stood."""
        at = f" {where}" if where else ""
        return Paused(f"paused{at}") if what == "pause" else Cancelled(f"cancelled{at}")

    def max_retries(self) -> int:
        """Failures survived before the job fails (a kind whose spec sets it overrides this)."""
        return FailurePolicy().max_retries

    def running_message(self) -> str:
        return f"running ({self.reason})"

    def _cleanup(self) -> None:
        """Release whatever the job still holds; runs after the last attempt, however it ended."""

    # -- requests from the API thread -------------------------------------------------------------

    def request(self, what: str) -> None:
        """A pause or cancel asked for (a cancel is never downgraded to a pause)."""
        if what in ("pause", "cancel") and self.want != "cancel":
            self.want = what

    def take_in(self, node: str) -> str:
        """Take `node` into the running job; returns when that happens (`job join`). Only kinds the
        registry marks `joinable` are asked. Not named `join`: that is `Thread.join`, which the manager
        calls on its runners (a `join(node)` here once broke `shutdown` and `resume`)."""
        raise SmolforgeError(f"job {self.job_id} takes no nodes while it runs", fix="nothing to join")

    def leave(self, node: str) -> str:
        """Give back `node`, lent with `join`; returns when it leaves (`job leave`). Only kinds the
        registry marks `joinable` are asked."""
        raise SmolforgeError(f"job {self.job_id} has no lent nodes to give back", fix="nothing to leave")

    # -- metric sinks ---------------------------------------------------------------------------

    def monitor_root(self, output_dir: str | None) -> Path:
        """Where a job's TensorBoard and W&B files go: the job's `output_dir` on the embedded cluster
        (this machine) when it names one, else `<state dir>/runs/<job>/` next to the artifacts."""
        if output_dir and self.ctx.embedded:
            return Path(output_dir)
        return self.ctx.artifacts.root.parent / "runs" / self.job_id

    def open_sinks(self, root: Path, *, tensorboard: bool, wandb: str | None, name_for: Callable[[str], str],
                   config: Mapping[str, Any]) -> None:
        """This job's metric sinks (nothing is opened until a series logs, nor at all when both are off)."""
        self.close_sinks()
        self.sinks = SeriesSinks(root, tensorboard=tensorboard, wandb=wandb, name_for=name_for, config=config)
        if self.sinks.enabled:
            self.store.add_event(self.job_id, "monitoring",
                                 "metrics also go to " + " and ".join(
                                     ([f"TensorBoard ({root / 'tensorboard'})"] if tensorboard else [])
                                     + ([f"W&B project {wandb}, offline ({root / 'wandb'})"] if wandb else [])),
                                 {"root": str(root), "tensorboard": tensorboard, "wandb": wandb})

    def log_series(self, series: str, kind: str, step: int, values: Mapping[str, Any]) -> None:
        """One rank's or student's numbers to its TensorBoard run and W&B run; a sink that fails costs
        the monitoring (an event says so), never the job."""
        if self.sinks is None or not self.sinks.enabled:
            return
        try:
            self.sinks.log(series, kind, step, values)
        except Exception as err:  # noqa: BLE001 (wandb raises its own types): monitoring is optional
            self.store.add_event(self.job_id, "monitoring_failed", f"TensorBoard/W&B logging stopped: "
                                 f"{short_error(err)}")
            self.sinks = None

    def close_sinks(self) -> None:
        """Flush and close every sink (before the job is marked done, so its files are complete then)."""
        sinks, self.sinks = self.sinks, None
        if sinks is not None:
            try:
                sinks.close()
            except Exception as err:  # noqa: BLE001
                self.store.add_event(self.job_id, "monitoring_failed", f"closing TensorBoard/W&B: {short_error(err)}")


    # -- the lifecycle (the base alone moves the job's state) --------------------------------------

    def run(self) -> None:
        try:
            self._lifecycle()
        except Exception as err:  # a bug or an unexpected Ray failure: record it, never die silently
            if not self.abandon:
                self.store.add_event(self.job_id, "error", f"job runner failed: {short_error(err)}",
                                     {"traceback": traceback.format_exc()[-4000:]})
                # force: a final state (a cancel) stands, see JobState.settle
                self._move(JobState.FAILED, f"failed: {short_error(err)}", error=short_error(err), force=True)
        finally:
            try:
                self.end_attempt()
                self._cleanup()
            finally:
                self.close_sinks()
                self.finished.set()
                self.ctx.done(self.job_id, self)

    def _lifecycle(self) -> None:
        if JobState(self.store.get_job(self.job_id)["state"]).final:
            return
        if self.want:  # a pause or cancel came before it started
            self._settle(self.stopped(self.want, "before it started"))
            return
        self._move(JobState.RUNNING, self.running_message())
        policy = self.failure_policy()
        while not self.abandon:
            outcome = self._attempt()
            if outcome is None or self.abandon:
                return  # the coordinator is shutting down: the job stays running, and resumes
            self.end_attempt()
            if isinstance(outcome, Regroup):
                continue
            if isinstance(outcome, Failed):
                if self._retry(policy, outcome):
                    continue
                return
            self._settle(outcome)
            return

    def _attempt(self) -> Outcome | None:
        """One attempt, from its start to its Outcome (None: abandoned)."""
        if self.want:
            return self.stopped(self.want, "before it started")
        outcome = self.start_attempt()
        while outcome is None:
            if self.abandon:
                return None
            outcome = self.poll()
        return outcome

    def _retry(self, policy: FailurePolicy, failed: Failed) -> bool:
        """The policy's decision on one failure: True to start another attempt (after its delay), or
        the job fails with the policy's reason."""
        decision = self.record_failure(policy, failed.reason, checkpoint=failed.checkpoint,
                                       retryable=failed.retryable)
        if not decision.retry:
            self._move(JobState.FAILED, f"failed: {decision.reason}", error=failed.error or failed.reason)
            return False
        self.store.add_event(self.job_id, "recovering", f"{self.retry_words}: {decision.reason}",
                             {"checkpoint": failed.checkpoint, "attempt": decision.attempt})
        self.recovering = failed.reason
        deadline = time.monotonic() + decision.delay_s
        while time.monotonic() < deadline and not (self.want or self.abandon):
            time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
        return True

    def _settle(self, outcome: Outcome) -> None:
        """A final or paused outcome onto the job's state."""
        if isinstance(outcome, Completed):
            self.close_sinks()  # complete TensorBoard/W&B files before anyone sees "completed"
            self._move(JobState.COMPLETED, outcome.message, result=outcome.result)
        elif isinstance(outcome, Paused):
            self._move(JobState.PAUSED, outcome.message)
        elif isinstance(outcome, Cancelled):
            self._move(JobState.CANCELLED, outcome.message, force=True)
        else:
            raise TypeError(f"not a final outcome: {outcome!r}")

    def _move(self, state: JobState, message: str, **fields: Any) -> None:
        """The one place a runner moves its job's state."""
        self.store.set_state(self.job_id, state.value, message, **fields)

    def recovered(self, detail: str, data: dict[str, Any] | None = None, task_id: str | None = None) -> None:
        """Say, once, that the attempt after a failure is up (`recovered` event)."""
        if self.recovering:
            self.store.add_event(self.job_id, "recovered", f"recovered after {self.recovering}: {detail}", data,
                                 task_id=task_id)
            self.recovering = None

    def failure_policy(self) -> FailurePolicy:
        """This job's FailurePolicy, counting the failures earlier runs of it recorded (`attempts`)."""
        policy = FailurePolicy(self.max_retries())
        policy.restore("job", int(self.store.get_job(self.job_id).get("attempts") or 0))
        return policy

    def record_failure(self, policy: FailurePolicy, what: str, *, checkpoint: str | None = None,
                       retryable: bool = True) -> Decision:
        """One failure through the policy; the job's `attempts` shows the count."""
        decision = policy.on_failure(what, subject="job", checkpoint=checkpoint, retryable=retryable)
        self.store.update_job(self.job_id, attempts=decision.attempt)
        return decision


def ray_get(ref, timeout: float = 30):
    """ray.get, or None when the actor is gone or slow (callers treat the answer as optional)."""
    import ray

    try:
        return ray.get(ref, timeout=timeout)
    except RayError:
        return None
