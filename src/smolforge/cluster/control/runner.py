"""What every job runner shares: one thread per job, pause/cancel requests, crash recording."""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ray.exceptions import RayError

from smolforge.cluster.control.policy import Decision, FailurePolicy
from smolforge.cluster.control.states import FINAL
from smolforge.errors import SmolforgeError
from smolforge.telemetry.sinks import SeriesSinks

if TYPE_CHECKING:
    from smolforge.cluster.control.manager import JobManager

POLL_S = 0.25
CANCEL_GRACE_S = 3.0


def short_error(err: BaseException) -> str:
    cause = getattr(err, "cause", None)  # RayTaskError wraps the worker's own exception
    if isinstance(cause, BaseException) and cause is not err:
        err = cause
    if isinstance(err, SmolforgeError):
        return err.render().replace("\n", " ")[:400]
    text = str(err).strip().splitlines()
    first = next((t for t in text if t.strip()), "")
    return f"{type(err).__name__}: {first[:300]}"



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
        self.sinks: SeriesSinks | None = None  # TensorBoard / W&B, one run per rank or student

    def monitor_root(self, output_dir: str | None) -> Path:
        """Where a job's TensorBoard and W&B files go: the job's `output_dir` on the embedded cluster
        (this machine) when it names one, else `<state dir>/runs/<job>/` next to the artifacts."""
        if output_dir and self.mgr.embedded:
            return Path(output_dir)
        return self.mgr.artifacts.root.parent / "runs" / self.job_id

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

    def request(self, what: str, node: str | None = None) -> None:
        """A pause or cancel asked for (a cancel is never downgraded to a pause); kinds that take
        other requests (a data-parallel job's `join`) extend this."""
        if what in ("pause", "cancel") and self.want != "cancel":
            self.want = what

    def _spec_to_run(self, spec_type: type) -> Any:
        """The job's validated spec, or None when there is nothing to run: it is already final, or a
        pause/cancel came before it started (then the kind's `_finish_stopped(what)` records it)."""
        job = self.store.get_job(self.job_id)
        if job["state"] in FINAL:
            return None
        spec = spec_type.model_validate(job["spec"])
        if self.want:
            self._finish_stopped(self.want)
            return None
        return spec

    def failure_policy(self, max_retries: int) -> FailurePolicy:
        """This job's FailurePolicy, counting the failures earlier runs of it recorded (`attempts`)."""
        policy = FailurePolicy(max_retries)
        policy.restore("job", int(self.store.get_job(self.job_id).get("attempts") or 0))
        return policy

    def record_failure(self, policy: FailurePolicy, what: str, *, subject: str = "job",
                       checkpoint: str | None = None, retryable: bool = True) -> Decision:
        """One failure through the policy; the job's `attempts` shows the count."""
        decision = policy.on_failure(what, subject=subject, checkpoint=checkpoint, retryable=retryable)
        if subject == "job":
            self.store.update_job(self.job_id, attempts=decision.attempt)
        return decision

    def _run(self) -> None:
        raise NotImplementedError

    def _cleanup(self) -> None:
        """Release whatever the job still holds; runs after `_run`, however it ended."""

    def run(self) -> None:
        try:
            self._run()
        except Exception as err:  # a bug or an unexpected Ray failure: record it, never die silently
            if not self.abandon:
                self.store.add_event(self.job_id, "error", f"job runner failed: {short_error(err)}",
                                     {"traceback": traceback.format_exc()[-4000:]})
                self.store.set_state(self.job_id, "failed", f"failed: {short_error(err)}", error=short_error(err),
                                     force=True)  # a final state (a cancel) stands: see JobState.settle
        finally:
            self._cleanup()
            self.close_sinks()
            self.finished.set()
            self.mgr._runner_done(self.job_id, self)



def ray_get(ref, timeout: float = 30):
    """ray.get, or None when the actor is gone or slow (callers treat the answer as optional)."""
    import ray

    try:
        return ray.get(ref, timeout=timeout)
    except RayError:
        return None
