"""Speed-balanced batches: how many of a step's rows each rank takes, from how fast each one is.

In a synchronous group every rank waits for the slowest at the gradient all-reduce. With equal
slices a machine 3x slower than its peer makes the peer idle two thirds of each step. Giving each
rank rows in proportion to its measured rate (rows per second of forward and backward) makes them
finish together. The global batch stays the same, and the loss is normalised by the step's target
tokens over every rank (`smolforge.train.loop`), so the gradient is exactly that of the whole batch
however the rows are split.

Pure functions here; the exchange of rates between ranks is the strategy's (`parallel/strategies`).
"""

from __future__ import annotations

import statistics

UNEVEN = 1.2  # `auto` balances when the fastest rank is more than 20% faster than the slowest
FIRST_AFTER = 3  # measured steps (after the first, which warms up) before the first balance
EVERY = 25  # measured steps between re-balances


def uneven(rates: list[float], threshold: float = UNEVEN) -> bool:
    """Whether the rates differ enough to be worth balancing."""
    return min(rates) > 0 and max(rates) / min(rates) > threshold


def split_rows(rates: list[float], total: int) -> list[int]:
    """`total` rows split in proportion to `rates`, at least one per rank, summing to `total` exactly.

    Each rank's exact share rounded down (at least one row), then the rows left over to the largest
    remainders, ties to the lower rank: every rank computes the same split from the same rates, so
    no second exchange is needed. (Reserving one row per rank first and sharing out the rest would
    tilt every split toward the slow rank: 16 rows at 3:1 became 5/11 instead of 4/12.)"""
    n = len(rates)
    if total < n:
        raise ValueError(f"{total} rows cannot give each of {n} ranks one")
    weight = sum(rates)
    ideal = [total * r / weight for r in rates] if weight > 0 else [total / n] * n
    out = [max(1, int(x)) for x in ideal]
    by_remainder = sorted(range(n), key=lambda i: (-(ideal[i] - int(ideal[i])), i))
    for i in by_remainder[:max(0, total - sum(out))]:
        out[i] += 1
    while sum(out) > total:  # the one-row floor took rows the big shares must give back
        i = max((j for j in range(n) if out[j] > 1), key=lambda j: (out[j] - ideal[j], -j))
        out[i] -= 1
    return out


class RateMeter:
    """This rank's rows per second over the steps since the last balance (the median: robust to a
    step that a checkpoint or an eval slowed)."""

    def __init__(self):
        self.samples: list[float] = []
        self.seen = 0  # steps observed in this process, the first (warm-up) included

    def add(self, rows: int, seconds: float) -> None:
        self.seen += 1
        if self.seen > 1 and seconds > 0:
            self.samples.append(rows / seconds)

    def due(self, balanced_before: bool) -> bool:
        """Every rank observes every step, so every rank reaches the same answer at the same step."""
        return len(self.samples) >= (EVERY if balanced_before else FIRST_AFTER)

    def take(self) -> float:
        rate = statistics.median(self.samples)
        self.samples = []
        return rate


def plan_inner_steps(rates: list[float] | None, steps: int, world: int) -> list[int]:
    """Inner steps per rank for a DiLoCo round of `steps` global steps under mixed speeds: the round's
    steps x world slices (a slice: one rank's rows of a step in plain DiLoCo, one inner step) split in
    proportion to the ranks' measured rates (rows/s), at least one each (`split_rows`); `rates` None:
    `steps` each, plain DiLoCo's round. Rates 3:1 over a round of 4 steps on 2 ranks: [6, 2].

    Pure: every rank computes the same plan from the same exchanged rates."""
    if not rates:
        return [steps] * world
    if len(rates) != world:
        raise ValueError(f"{len(rates)} rates for {world} ranks")
    return split_rows(rates, steps * world)
