"""A data-parallel job's summary (`job show`, the dashboard, `launch --json`), derived from its ranks' results.

One function, so each key means one thing for every strategy. A rank's result is its `TrainResult`
(`smolforge.train.engine`), as the rank actor sends it back: `to_dict()`, plus where it ran (`node`), its
setup time and, on rank 0, its step timestamps (`cluster.workloads.data_parallel.rank`). Most keys are rank 0's (the job's
steps, eval, adapter) or one value per rank, rank order (`*_per_rank`); `final_loss` is merged from every
rank's part of the last global step (`train.step_loss`): the mean token loss of that step over all its
tokens, as DDP all-reduces it, whether the step was all-reduced, computed in parts through a parameter
server, or taken locally (DiLoCo's inner steps).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from smolforge.train.engine import TrainResult
from smolforge.train.step_loss import final_loss

FROM_RANK0 = ("eval", "seconds", "tokens_per_s", "trainable_params", "total_params", "adapter_artifact", "setup_s",
              "first_step_ts", "world", "cpu_step_s")
PER_RANK = ("comm_bytes_sent", "checkpoint_bytes_sent", "comm_wait_s", "peak_rss_mb", "optimizer_state_bytes")


def job_summary(results: Mapping[int, TrainResult | Mapping[str, Any]]) -> dict[str, Any]:
    """The summary of a completed job from each rank's result (rank -> result; a member that left has none)."""
    by_rank = {r: res.to_dict() if isinstance(res, TrainResult) else dict(res) for r, res in results.items()}
    ranks = sorted(by_rank)
    r0 = by_rank.get(0, {})
    summary: dict[str, Any] = {"steps": r0.get("steps"),
                               "final_loss": final_loss(by_rank[r].get("last_step_loss") for r in ranks)}
    summary.update({k: r0.get(k) for k in FROM_RANK0})
    summary.update(_step_times(r0.get("step_times") or []))
    summary["nodes"] = [(by_rank[r].get("node") or {}).get("node_name") for r in ranks]
    summary["strategy"] = r0.get("strategy")
    summary["workers"] = len(by_rank)
    summary["samples"] = r0.get("samples")
    summary["eval_loss"] = (r0.get("eval") or {}).get("eval_loss")
    summary["rounds"] = r0.get("rounds")  # outer steps (DiLoCo)
    summary["batch_rows_per_rank"] = r0.get("batch_rows")  # when balanced by speed (None: equal slices)
    for key in PER_RANK:  # one value per rank, rank order
        summary[f"{key}_per_rank"] = [by_rank[r].get(key) for r in ranks]
    for key in r0.get("strategy_metrics") or {}:  # the strategy's own: staleness, waits, dropped parts
        summary[f"{key}_per_rank"] = [(by_rank[r].get("strategy_metrics") or {}).get(key) for r in ranks]
    return summary


def _step_times(times: list[float]) -> dict[str, float | None]:
    """Rank 0's step timing: median and longest step (a pause shows there), first to last step."""
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    return {"median_step_s": gaps[len(gaps) // 2] if gaps else None, "max_step_s": gaps[-1] if gaps else None,
            "train_s": times[-1] - times[0] if len(times) > 1 else None}
