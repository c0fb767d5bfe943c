"""Speed-balanced batches: the split of a step's rows between ranks of different speeds."""

from __future__ import annotations

import pytest

from smolforge.train.balance import EVERY, FIRST_AFTER, RateMeter, split_rows, uneven


def test_rows_follow_the_rates_and_sum_to_the_global_batch():
    assert split_rows([3.0, 1.0], 8) == [6, 2]
    assert split_rows([1.0, 1.0, 1.0], 9) == [3, 3, 3]
    assert split_rows([1.0, 1.0], 7) == [4, 3]  # ties go to the lower rank, the same on every rank
    assert split_rows([1000.0, 1.0], 8) == [7, 1]  # a very slow rank keeps one row (DDP needs a backward)
    for rates in ([2.5, 1.0, 0.7], [1.0, 9.0], [0.1, 0.2, 0.3, 0.4]):
        for total in range(len(rates), 40):
            rows = split_rows(rates, total)
            assert sum(rows) == total and min(rows) >= 1


def test_too_few_rows_for_the_ranks_is_an_error():
    with pytest.raises(ValueError):
        split_rows([1.0, 1.0, 1.0], 2)


def test_auto_balances_only_beyond_twenty_percent():
    assert not uneven([1.0, 1.19])
    assert uneven([1.0, 1.25])
    assert not uneven([0.0, 1.0])  # a rank that measured nothing: keep equal slices


def test_the_meter_skips_the_warm_up_step_and_takes_the_median():
    m = RateMeter()
    m.add(4, 10.0)  # the first step (compilation, caches): ignored
    for seconds in (1.0, 2.0, 100.0):  # one step slowed by a checkpoint: the median ignores it
        m.add(4, seconds)
    assert m.due(balanced_before=False) and FIRST_AFTER == 3
    assert m.take() == 2.0
    assert not m.due(balanced_before=True)
    for _ in range(EVERY):
        m.add(1, 1.0)
    assert m.due(balanced_before=True)


def test_the_split_is_not_tilted_toward_the_slow_rank():
    assert split_rows([44.7, 127.5], 16) == [4, 12]  # measured in bench/balance.py; 5/11 before
    assert split_rows([1.0, 0.001, 0.001], 4) == [2, 1, 1]  # floors of one row come from the big share
