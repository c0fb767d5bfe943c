"""A job's state and the moves it may make: one place owns them, so no runner invents its own.

    pending ──► running ──► completed
       │  ▲        │ ▲
       ▼  │        ▼ │ (re-queued after a coordinator restart)
      paused ◄─────┘
    any non-final state ──► failed | cancelled

Final states never change again, with one deliberate rule: a cancel wins over everything that
races it. A runner that sees its workers die *because* they were cancelled must not record
`failed`; `JobState.settle` says which of two outcomes stands.
"""

from __future__ import annotations

from enum import Enum

from smolforge.errors import SmolforgeError


class JobState(str, Enum):
    PENDING = "pending"
    RUNNING = "running"
    PAUSED = "paused"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    def __str__(self) -> str:  # stored and printed as the plain word
        return self.value

    @property
    def final(self) -> bool:
        return self in FINAL_STATES

    def can_become(self, other: "JobState | str") -> bool:
        return JobState(other) in TRANSITIONS[self]

    @staticmethod
    def settle(current: "JobState | str", wanted: "JobState | str") -> "JobState":
        """The state that stands when `wanted` arrives while the job is `current`.

        A final state stays; a cancelled job never ends as failed (nor completed after the cancel).
        """
        current, wanted = JobState(current), JobState(wanted)
        if current.final:
            return current
        return wanted


FINAL_STATES = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED})
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.RUNNING, JobState.PAUSED, JobState.FAILED, JobState.CANCELLED}),
    # running -> pending: re-queued after a coordinator (or embedded CLI) restart
    JobState.RUNNING: frozenset({JobState.PAUSED, JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED,
                                 JobState.PENDING}),
    JobState.PAUSED: frozenset({JobState.PENDING, JobState.RUNNING, JobState.CANCELLED, JobState.FAILED}),
    JobState.COMPLETED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}

STATES = tuple(s.value for s in JobState)
FINAL = tuple(s.value for s in JobState if s.final)


def succeeded(state: str) -> bool:
    """Another job, read by a kind that depends on it (a seeds' student stage on its teacher job), has
    completed. Kinds ask this rather than name a job state (only control moves and names them)."""
    return JobState(state) is JobState.COMPLETED


def ended_unsuccessfully(state: str) -> bool:
    """Another job ended without completing (failed or cancelled): what depends on it cannot run."""
    return JobState(state).final and not succeeded(state)


def parse_states(text: str | None) -> tuple[str, ...] | None:
    """A `--state` / `?state=` filter, `running,paused` -> ('running', 'paused'); None for none. An
    unknown state is refused (it matched nothing, silently)."""
    states = tuple(s.strip() for s in (text or "").split(",") if s.strip()) or None
    unknown = sorted(set(states or ()) - set(STATES))
    if unknown:
        raise SmolforgeError(f"unknown job state {unknown[0][:40]!r}", where="state",
                             fix=f"use states among {', '.join(STATES)}, comma-separated")
    return states
