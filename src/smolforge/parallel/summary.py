"""A data-parallel job's summary (`job show`, the dashboard, `launch --json`), derived from its ranks' results.

One function, so each key means one thing for every strategy. A rank's result is a `RankResult`
(`parallel.rank_task`): its `TrainResult` as the engine made it, with where it ran, its setup time
and, on rank 0, its step timestamps. Most keys are rank 0's (the job's steps, eval, adapter) or one
value per rank, rank order (`*_per_rank`); `final_loss` is merged from every rank's part of the last
global step (`train.step_loss`): the mean token loss of that step over all its tokens, as DDP
all-reduces it, whether the step was all-reduced, computed in parts through a parameter server, or
taken locally (DiLoCo's inner steps).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from smolforge.parallel.rank_task import RankResult
from smolforge.train.step_loss import final_loss

FROM_RESULT0 = ("eval", "seconds", "tokens_per_s", "trainable_params", "total_params", "strategy", "samples",
                "rounds")  # rank 0's TrainResult (rounds: DiLoCo's outer steps)
FROM_RANK0 = ("adapter_artifact", "setup_s", "first_step_ts", "world", "cpu_step_s")  # where and how rank 0 ran
PER_RANK = ("comm_bytes_sent", "checkpoint_bytes_sent", "comm_wait_s", "peak_rss_mb", "optimizer_state_bytes")


def job_summary(results: Mapping[int, RankResult]) -> dict[str, Any]:
    """The summary of a completed job from each rank's result (rank -> result; a member that left has none;
    rank 0 always has one: the job completes with it)."""
    ranks = sorted(results)
    r0 = results[0]
    summary: dict[str, Any] = {"steps": r0.train.steps,
                               "final_loss": final_loss(results[r].train.last_step_loss for r in ranks)}
    summary.update({k: getattr(r0.train, k) for k in FROM_RESULT0})
    summary.update({k: getattr(r0, k) for k in FROM_RANK0})
    summary.update(_step_times(r0.step_times or []))
    summary["nodes"] = [results[r].node_name for r in ranks]
    summary["workers"] = len(results)
    summary["eval_loss"] = r0.train.eval.get("eval_loss")
    summary["batch_rows_per_rank"] = r0.train.batch_rows  # when balanced by speed (None: equal slices)
    for key in PER_RANK:  # one value per rank, rank order
        summary[f"{key}_per_rank"] = [getattr(results[r].train, key) for r in ranks]
    for key in r0.train.strategy_metrics:  # the strategy's own: staleness, waits, dropped parts
        summary[f"{key}_per_rank"] = [results[r].train.strategy_metrics.get(key) for r in ranks]
    return summary


def _step_times(times: list[float]) -> dict[str, float | None]:
    """Rank 0's step timing: median and longest step (a pause shows there), first to last step."""
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    return {"median_step_s": gaps[len(gaps) // 2] if gaps else None, "max_step_s": gaps[-1] if gaps else None,
            "train_s": times[-1] - times[0] if len(times) > 1 else None}
