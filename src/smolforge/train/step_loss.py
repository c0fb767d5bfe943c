"""A rank's own part of a global step's loss, and the job's `final_loss` merged from every rank's part.

Why not each rank's logged loss: what a rank can see of the last step differs by strategy. A DDP rank
all-reduces the step's loss; a parameter server's worker computes parts of steps on its own (possibly
several parts of one step, some dropped as late); a DiLoCo rank's inner steps are local. So each rank
keeps its raw part of the latest global step it counted in (`StepLoss`: summed token loss and loss
tokens of its rows, only the parts the step actually used), and `final_loss` merges them the one way
that means the same for every strategy: the mean token loss of the last global step over all its
tokens (DDP's all-reduced step loss, whatever the strategy).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class StepLoss:
    """This rank's rows of global step `step` (0-based): their summed token loss and their loss tokens."""

    step: int
    loss_sum: float
    tokens: float

    def then(self, step: int, loss_sum: float, tokens: float) -> "StepLoss":
        """The latest step's part after another part of this rank's: a later step replaces it, another part
        of the same step (a fast parameter-server worker takes several) adds to it, an earlier one is kept out.
        A rank's first part is `NONE.then(...)`: one way to add a part."""
        if step > self.step:
            return StepLoss(step, loss_sum, tokens)
        if step == self.step:
            return StepLoss(step, self.loss_sum + loss_sum, self.tokens + tokens)
        return self


NONE = StepLoss(-1, 0.0, 0.0)
"""Before every step: the first part of a rank's is `NONE.then(...)`."""


def final_loss(parts: Iterable[StepLoss | None]) -> float | None:
    """The mean token loss of the last global step any rank counted in, over the parts of that step (every
    rank's `StepLoss`; None for a rank that counted none); None when no rank has one."""
    got = [p for p in parts if p is not None]
    if not got:
        return None
    last = max(p.step for p in got)
    loss_sum = sum(p.loss_sum for p in got if p.step == last)
    tokens = sum(p.tokens for p in got if p.step == last)
    return loss_sum / tokens if tokens > 0 else None
