"""Mixed speeds under DiLoCo (`inner_steps_by_speed`): a slow rank runs fewer inner steps per round.

Pure: the plan follows the rates (3:1 -> 6 and 2 of a round's 4 steps x 2 parts) and the slices of a round
go out once each, every rank ending the round at its last step. Two gloo ranks (spawned), tiny-llama: the
step times are injected (rank 1's 3x rank 0's: no clock decides anything), so after the first, even round
rank 1 is planned a third of rank 0's inner steps, every row of every step is still trained exactly once,
and the round's average is weighted by each rank's loss tokens (the weights the ranks exchanged are the
tokens each one trained in the round).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_gloo_ranks, tiny_train_cfg, train_dict

from smolforge.parallel.strategies.diloco_speeds import assign
from smolforge.train.balance import plan_inner_steps

pytestmark = pytest.mark.timeout(400)

H, STEPS = 4, 12
SECONDS = [1.0, 3.0]  # injected seconds per inner step: rank 1 three times slower


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


def _run(rank: int, root: Path) -> dict:
    from smolforge.parallel.strategies import make_strategy

    s = make_strategy("diloco", {"inner_steps": H, "outer_lr": 1.0, "outer_momentum": 0.5,
                                 "inner_steps_by_speed": True})
    s.observe = lambda rows, started, ended, targets=0.0: s.meter.add(rows, SECONDS[rank])  # injected
    taken, weights = [], []
    rows_for, replan = s.rows_for, s._replan
    s.rows_for = lambda step, total: taken.append((step, *rows_for(step, total))) or taken[-1][1:]
    s._replan = lambda weight: weights.append(weight) or replan(weight)
    cfg = tiny_train_cfg(root, "speeds", STEPS, eval_every=0, eval_accuracy=False, save_every=0, max_new_tokens=1)
    result, seen = train_dict(cfg, s)
    return {"result": result.to_dict(), "taken": taken, "weights": weights, "notes": s.notes,
            "inner_steps": len(seen["steps"])}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict:
    from smolforge.data.synthetic import generate
    from smolforge.models.tiny import preset_dir

    root = tmp_path_factory.mktemp("diloco-speeds")
    preset_dir("tiny-llama")
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in generate(40, seed=7)))
    return run_gloo_ranks(_run, 2, root)[0]


def test_a_three_times_slower_rank_runs_a_third_of_the_inner_steps_weighted_by_tokens(ranks):
    plans = [n for n in ranks[0]["notes"] if n["kind"] == "diloco_plan"]
    assert [n["step"] for n in plans] == [4, 8, 12]  # one outer step per round, both ranks at the same step
    assert plans[0]["rates"][0] == pytest.approx(3 * plans[0]["rates"][1])
    assert [n["inner_steps"] for n in plans] == [[6, 2]] * 3  # decided at each outer step, from the rates
    # round 1 even (nothing measured yet), then 6 and 2: rank 1 a third of rank 0's inner steps
    assert ranks[0]["inner_steps"] == 4 + 6 + 6 and ranks[1]["inner_steps"] == 4 + 2 + 2
    # every part of every global step trained once, by one rank: the global batch is the same
    rows = sorted((step, first) for r in (0, 1) for step, first, _count in ranks[r]["taken"])
    assert rows == sorted((step, first) for step in range(STEPS) for first in (0, 2))
    # the average is token-weighted: the weights exchanged are the tokens each rank trained in the round
    for i, note in enumerate(plans):
        assert note["weights"] == [ranks[0]["weights"][i], ranks[1]["weights"][i]]
    assert all(n["weights"][0] > 2 * n["weights"][1] for n in plans[1:])
    for r in (0, 1):
        assert ranks[r]["result"]["steps"] == STEPS and ranks[r]["result"]["rounds"] == 3
