"""One failure policy for every job kind: retry from the last checkpoint, or give up with a reason.

A runner reports each failure it sees (a rank that died, a student whose node was lost, a group
that could not be placed) to the job's `FailurePolicy`. The policy answers with a `Decision`:
retry (and from which checkpoint, and after how long) or give up, always with a sentence a user
can read in `smolforge job show`. Runners never count retries themselves, so "max_retries: 2"
means the same thing for a data-parallel group and for a distillation student.

Failures of the job's own making (bad data, a model that will not load: `retryable=False`) are
not retried: they would only repeat.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Decision:
    retry: bool
    reason: str
    attempt: int  # failures counted so far for this subject (1 for the first)
    resume_from: str | None = None  # the checkpoint the retry starts from (None: the start)
    delay_s: float = 0.0


@dataclass
class FailurePolicy:
    """Counts failures per subject ("job", "student-0", ...) against a shared budget.

    `max_retries` failures of one subject are survived; the next one gives up. `backoff_s` grows
    linearly with the attempt so a flapping node is not hammered.
    """

    max_retries: int = 2
    backoff_s: float = 1.0
    counts: dict[str, int] = field(default_factory=dict)

    def failures(self, subject: str = "job") -> int:
        return self.counts.get(subject, 0)

    def restore(self, subject: str, count: int) -> None:
        """Carry a count over from an earlier run of the job (the store keeps `attempts`)."""
        self.counts[subject] = max(self.counts.get(subject, 0), int(count))

    def on_failure(self, what: str, *, subject: str = "job", retryable: bool = True,
                   checkpoint: str | None = None) -> Decision:
        """Record one failure of `subject`; say whether to retry, from where, and why."""
        n = self.counts.get(subject, 0) + 1
        self.counts[subject] = n
        if not retryable:
            return Decision(False, f"{what} (not retried: the same input would fail again)", n)
        if n > self.max_retries:
            return Decision(False, f"{what}; gave up after {n} failures (max_retries {self.max_retries})", n)
        start = f"checkpoint {checkpoint}" if checkpoint else "the start"
        return Decision(True, f"{what}; retry {n} of {self.max_retries} from {start}", n,
                        resume_from=checkpoint, delay_s=self.backoff_s * (n - 1))
