"""Mixed speeds under DiLoCo (`inner_steps_by_speed`): a slow rank runs fewer inner steps per round.

Pure: the plan follows the rates (3:1 -> 6 and 2 of a round's 4 steps x 2 parts) and the slices of a round
go out once each, every rank ending the round at its last step. Two gloo ranks (spawned, the ones
tests/test_diloco_strategy.py starts: its (f), test_a_three_times_slower_rank_...), tiny-llama: the
step times are injected (rank 1's 3x rank 0's: no clock decides anything), so after the first, even round
rank 1 is planned a third of rank 0's inner steps, every row of every step is still trained exactly once,
and the round's average is weighted by each rank's loss tokens (the weights the ranks exchanged are the
tokens each one trained in the round).
"""

from __future__ import annotations

import pytest

from smolforge.parallel.strategies.diloco_speeds import assign
from smolforge.train.balance import plan_inner_steps

H = 4


def test_the_plan_follows_the_rates_and_every_slice_goes_out_once():
    assert plan_inner_steps([3.0, 1.0], H, 2) == [6, 2]
    assert plan_inner_steps(None, H, 2) == [H, H]  # nothing measured: plain DiLoCo's round
    assert plan_inner_steps([1.0, 1.0, 1000.0], 2, 3) == [1, 1, 4]  # each rank keeps one inner step
    for counts in ([6, 2], [4, 4], [1, 7], [3, 3, 6]):
        steps = sum(counts) // len(counts)
        got = assign(counts, 8, steps)
        flat = [s for mine in got for s in mine]
        assert sorted((s.step, s.part) for s in flat) == [(8 + i, p) for i in range(steps) for p in range(len(counts))]
        assert [len(mine) for mine in got] == counts
        assert all(mine[-1].step == 8 + steps - 1 for mine in got)  # every rank ends the round together
    assert assign([4, 4], 0, 4)[1] == [s for s in assign([4, 4], 0, 4)[1] if s.part == 1]  # even: own part
    with pytest.raises(ValueError):
        assign([5, 2], 0, 4)
