"""What every job runner shares: one thread per job, pause/cancel requests, crash recording."""

from __future__ import annotations

import threading
import traceback
from typing import TYPE_CHECKING

from ray.exceptions import RayError

from smolforge.cluster.policy import Decision, FailurePolicy
from smolforge.errors import SmolforgeError

if TYPE_CHECKING:
    from smolforge.cluster.manager import JobManager

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
            self.finished.set()
            self.mgr._runner_done(self.job_id, self)



def ray_get(ref, timeout: float = 30):
    """ray.get, or None when the actor is gone or slow (callers treat the answer as optional)."""
    import ray

    try:
        return ray.get(ref, timeout=timeout)
    except RayError:
        return None
