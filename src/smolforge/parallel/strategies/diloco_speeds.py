"""Mixed speeds under DiLoCo (`inner_steps_by_speed`): a round is a budget of work, not H steps for everyone.

A round covers H global steps; each step's rows are cut into `world` equal parts ("slices", one rank's
rows of a step in plain DiLoCo), so a round holds H x world slices, each one inner step of a rank. In
plain DiLoCo every rank takes H of them (its own part of every step); here rank r takes
`balance.plan_inner_steps(rates, H, world)[r]` of them, in proportion to its measured speed, so a rank
3x slower runs a third of the fast one's inner steps and the two reach the outer step together instead
of the fast one idling. The pseudo-gradients are weighted by each rank's loss tokens (`DiLoCo._average`),
so the fast rank's more steps count for more. Every rank's last slice is a part of the round's last step:
every rank ends the round at the same step, where the outer step, checkpoints and pauses land.

The rates are each rank's median rows per second of forward and backward since the last outer step
(`balance.RateMeter`, fed by `observe`), exchanged at the outer step with the round's token weights
(one small all-reduce), so every rank computes the same plan from the same numbers; the first round
(nothing measured yet: kept short, `balance.FIRST_AFTER` + 1 steps) and any round after a regroup split
evenly. Between outer steps the ranks share
no collective: a pause or cancel asked on rank 0 is agreed at the round's end, and evaluations are
rank 0's alone (on every eval row), as a parameter server's are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from smolforge.train import balance


@dataclass(frozen=True)
class Slice:
    """One inner step's rows: part `part` (of `world` equal parts) of global step `step`."""

    step: int
    part: int


def assign(counts: list[int], first: int, steps: int) -> list[list[Slice]]:
    """Each rank's slices of the round of `steps` global steps from `first`, rank r taking counts[r]
    (sum(counts) == steps x ranks, each >= 1). Equal counts: rank r takes part r of every step (plain
    DiLoCo). Otherwise the slices of every step but the last go out in order, rank after rank, and rank
    r takes part r of the last step last: every rank ends the round at step first + steps - 1.

    Raises ValueError when the counts do not add up to the round's slices."""
    world, last = len(counts), first + steps - 1
    if sum(counts) != steps * world or min(counts) < 1:
        raise ValueError(f"inner steps {counts} do not split {steps} steps x {world} parts")
    if len(set(counts)) == 1:
        return [[Slice(s, r) for s in range(first, first + steps)] for r in range(world)]
    rest = [Slice(s, p) for s in range(first, last) for p in range(world)]
    out, i = [], 0
    for r, n in enumerate(counts):
        out.append(rest[i:i + n - 1] + [Slice(last, r)])
        i += n - 1
    return out


class SpeedPlan:
    """The by-speed schedule of a `DiLoCo` (mixed in; active when `by_speed`): which slices this rank
    takes in the current round (`mine`), how far it is (`taken`), the rates the next plan follows."""

    by_speed: bool = False
    mine: list[Slice] | None = None  # this rank's slices of the current round; None: between rounds
    taken: int = 0
    rates: list[float] | None = None  # every rank's measured rows/s at the last outer step (None: even)

    def _plan_round(self, done: int, steps: int) -> int | None:
        """Plan the round that starts at step `done` (at most H steps, up to the job's `steps`; the job's
        first round at most `balance.FIRST_AFTER` + 1: split evenly, nothing measured yet, it runs at the
        slowest rank's pace, so it is kept short); returns the step of this rank's first slice, or None
        when no step is left."""
        first_round = self.rounds == 0 and self.rates is None
        length = min(min(self.inner_steps, balance.FIRST_AFTER + 1) if first_round else self.inner_steps, steps - done)
        if length <= 0:
            return None
        counts = balance.plan_inner_steps(self.rates, length, self.world)
        self.mine, self.taken = assign(counts, done, length)[self.rank], 0
        return self.mine[0].step

    def _speed_next(self, done: int, steps: int) -> int | None:
        if self.mine is None:
            if self.admit_next:  # joiners come in before the plan, so it counts them
                self.admit_next = False
                self._regroup("a member joins", admit=True)
            return self._plan_round(done, steps)
        return self.mine[self.taken].step

    def _speed_rows(self, total: int) -> tuple[int, int]:
        shares = balance.split_rows([1.0] * self.world, total)
        part = self.mine[self.taken].part
        return sum(shares[:part]), shares[part]

    def _speed_after(self, targets: float) -> bool:
        """Count the inner step; True when it was this rank's last slice of the round (the outer step is due)."""
        self.taken += 1
        return self.taken >= len(self.mine)

    @torch.no_grad()
    def _replan(self, weight: float) -> None:
        """After an outer step: every rank's measured rate and token weight of the round (one all-reduce);
        the next round follows the rates when they are uneven (`balance.uneven`)."""
        world = self.world
        t = torch.zeros(2 * world, dtype=torch.float64, device=self.device)
        t[self.rank] = self.meter.take() if self.meter.samples else 0.0
        t[world + self.rank] = weight
        self._count(t)
        dist.all_reduce(t)
        rates, weights = t[:world].tolist(), t[world:].tolist()
        if min(rates) > 0:
            self.rates = rates if balance.uneven(rates) else None
        self.mine = None
        if self.is_main:
            self.notes.append({"kind": "diloco_plan", "step": self.last_step, "rates": rates, "weights": weights,
                               "inner_steps": balance.plan_inner_steps(self.rates, self.inner_steps, world)})
