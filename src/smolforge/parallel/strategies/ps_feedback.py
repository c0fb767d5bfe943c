"""The workers' error-feedback residuals in a parameter server's checkpoints, so that a resume is exact.

With a lossy codec (fp16, int8, sparse: `parallel.codecs`) each worker keeps its own residual (what its
pushes could not carry, added to its next push): the worker-to-server link carries the compressed
gradient only, and the residual never travels, except into a checkpoint. A checkpoint is the server's
snapshot, taken by rank 0, and resumes at the step every part before which is applied (its
`resume_step`, s): the residual a worker must resume with is the one it held *before its first push for
a step >= s* (those parts are computed again after the resume). So each worker keeps, beside its
residual, the residual it held before each push not yet behind the server's resume step (`FeedbackMarks`,
pruned as each claim's reply says where the server is: one or two under ssp and sync-ps; at most
`MAX_MARKS`, the oldest dropped, under async-ps, whose resume is not exact anyway: parts past the resume
step may already be in the weights), and hands them over (its *table*) when the server asks:

1. rank 0's snapshot fixes s, hands over rank 0's own table and raises a request (a generation number);
2. every other worker that has pushed sees the request (and s) in the reply to its next claim (a claim
   that waits returns at once) and puts its residual at s (`put_feedback`); a worker told to pause puts
   its whole table unasked, as it pushes no more;
3. the snapshot waits, bounded (`WAIT_S`), for each such worker still in the job (not dead, not done: a
   worker that finished makes no claim to see the request), resolves each table at s and keeps the
   residuals with the codec's settings (`Codec.settings`) and the world size in the checkpoint's strategy
   state (`optim.pt`, checksummed by the checkpoint's manifest with the rest).
On resume, rank 0 hands that state to the new server, which gives each member its residual with the reply
to its first claim, when the codec's settings and the world size are those of the checkpoint; otherwise the
residuals start at zero and the server says why (a note in the job's events), as it does for a member the
checkpoint lacks (dead, done, or past the wait).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from smolforge.parallel.codecs import Codec, ErrorFeedback

WAIT_S = 120.0  # a snapshot waits this long at most for the workers' tables (then: zeros for the missing)
MAX_MARKS = 4  # residuals a worker keeps beside its own (each the size of the trainable weights, fp32)


class FeedbackMarks:
    """A worker's side: its stream's residual before each push not yet behind the server's resume step."""

    def __init__(self, stream: ErrorFeedback):
        self.stream = stream
        self.marks: list[tuple[int, torch.Tensor | None]] = []  # (step pushed, the residual before it)

    @property
    def active(self) -> bool:
        """Whether the stream keeps a residual at all (a lossless codec has nothing to keep)."""
        return self.stream.coder.lossy

    def before_push(self, step: int) -> None:
        """Called before a part of `step` is encoded: what the residual was."""
        if self.active:
            res = self.stream.residual
            self.marks = [*self.marks, (int(step), None if res is None else res.clone())][-MAX_MARKS:]

    def prune(self, resume: int) -> None:
        """The server resumes at `resume` or later from now on: marks of earlier steps can never be asked for."""
        self.marks = [(s, r) for s, r in self.marks if s >= resume]

    def table(self, step: int | None = None) -> dict[str, Any]:
        """What the server resolves at a resume step: {"marks": [(step, residual before)], "current": residual}
        (numpy, flat fp32; None: no residual yet); given the `step`, only the residual at it (as "current")."""
        arr = lambda t: None if t is None else t.numpy()  # noqa: E731
        whole = {"marks": [(s, arr(r)) for s, r in self.marks], "current": arr(self.stream.residual)}
        return whole if step is None else {"marks": [], "current": resolve(whole, int(step))}

    def load(self, residual: Any) -> None:
        """Continue from a checkpoint's residual (handed back by the server with the first claim)."""
        self.stream.load(None if residual is None else torch.from_numpy(np.array(residual, dtype=np.float32)))
        self.marks = []


def resolve(table: dict[str, Any], step: int) -> Any:
    """The residual a table's worker held before its first push for a step >= `step` (else its current one)."""
    for s, residual in table["marks"]:
        if int(s) >= step:
            return residual
    return table["current"]


class FeedbackKeeper:
    """The server's side, under the server's lock: who has pushed, the open request, the tables put, and the
    residuals a resumed server hands back. `coder`: the job's codec; `world`: the members it started with."""

    def __init__(self, coder: Codec, world: int):
        self.coder, self.world = coder, world
        self.gen, self.step = 0, 0  # the last request's number, and the step it resumes from
        self.tables: dict[int, tuple[int, bool, dict]] = {}  # member -> (request answered, final, table)
        self.pushers: set[int] = set()  # members with a residual stream (they pushed)
        self.finished: set[int] = set()  # members told every step is done (they claim no more)
        self.handback: dict[int, Any] = {}  # member -> the residual it resumes with

    @property
    def active(self) -> bool:
        return self.coder.lossy

    def _answered(self, member: int, gen: int) -> bool:
        got = self.tables.get(member)
        return got is not None and (got[1] or got[0] >= gen)

    def wants(self, member: int) -> int | None:
        """The open request this member has not answered (None: none)."""
        if not self.active or self.gen == 0 or member not in self.pushers or self._answered(member, self.gen):
            return None
        return self.gen

    def put(self, member: int, gen: int | None, table: dict[str, Any], final: bool) -> None:
        """A worker's table, in answer to request `gen` (None: unasked), `final` when it pushes no more."""
        self.tables[member] = (self.gen if gen is None else int(gen), bool(final), table)

    def request(self, member: int, table: dict[str, Any] | None, step: int) -> int:
        """A new request (rank 0's snapshot, resuming at `step`), answered at once for `member` (rank 0)
        with its own table."""
        self.gen, self.step = self.gen + 1, int(step)
        if table is not None:
            self.tables[member] = (self.gen, False, table)
        return self.gen

    def missing(self, gen: int, gone: set[int]) -> set[int]:
        """Members still in the job whose table for request `gen` has not come."""
        return {m for m in self.pushers - gone - self.finished if not self._answered(m, gen)}

    def collect(self, step: int, gen: int, gone: set[int]) -> tuple[dict[str, Any], list[int]]:
        """(the checkpoint's entries: every member's residual at `step`, None where none came; the codec's
        settings and the world size), and the members whose residual did not come."""
        members = sorted(self.pushers | set(self.tables))
        got = {m: resolve(self.tables[m][2], step) if self._answered(m, gen) else None for m in members}
        lacking = [m for m in members if not self._answered(m, gen)]
        return {"error_feedback": got, "error_feedback_codec": self.coder.settings(),
                "error_feedback_world": self.world, "error_feedback_step": step}, lacking

    def restore(self, state: dict[str, Any]) -> str | None:
        """A resumed server's residuals from a checkpoint's `state`; why they start at zero, if they do."""
        saved = state.get("error_feedback")
        if not self.active or not saved:
            return None
        codec, world = state.get("error_feedback_codec"), state.get("error_feedback_world")
        if codec != self.coder.settings() or world != self.world:
            return (f"the checkpoint's error-feedback residuals were kept with {codec} and {world} members; "
                    f"this run has {self.coder.settings()} and {self.world}: they start at zero")
        self.handback = {int(m): r for m, r in saved.items()}
        return None

    def hand(self, member: int) -> tuple[bool, Any]:
        """(whether this member has a residual to resume with, that residual: None for a zero one)."""
        if member not in self.handback:
            return False, None
        return True, self.handback.pop(member)
