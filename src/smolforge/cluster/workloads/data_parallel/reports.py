"""What a data-parallel group's ranks report, sorted into what the job store and the sinks keep.

The ranks send their reports (steps, evals, communication counters, events, output lines) through the
job's control actor; the runner drains them in batches. Turning one batch into store rows is plain
data work with no Ray and no store, so it lives here, apart from the runner's placement and watching.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# What each rank reports per step: the job's series (`loss`, ...) from rank 0, `<name>.rank<R>` from all
STEP_SERIES = ("loss", "lr", "grad_norm", "tokens_per_s")


@dataclass
class Batch:
    """One drained batch, sorted: everything the runner writes, in the order the ranks reported it."""

    rows: list[tuple[int, str, float]] = field(default_factory=list)  # metrics rows (step, name, value)
    lines: list[dict] = field(default_factory=list)  # what the ranks printed and logged (telemetry.tasklog)
    events: list[tuple[str, str, Any, Any]] = field(default_factory=list)  # (kind, message, data, ts)
    series: list[tuple[str, str, int, dict]] = field(default_factory=list)  # sinks: (series, kind, step, values)
    comm: dict[int, dict] = field(default_factory=dict)  # the latest communication report of each rank
    last_step: dict | None = None  # rank 0's newest step report: the job's progress


def sort_batch(items: list[dict]) -> Batch:
    """The batch's reports in time order, each turned into rows, events, sink values and lines."""
    out = Batch()
    for it in sorted(items, key=lambda i: (i.get("ts", 0), i.get("step", 0))):
        kind = it.get("type")
        rank = int(it.get("rank", 0))
        if kind == "step":  # every rank's: `<name>.rank<R>`; rank 0's also the job's own series
            values = {name: it[name] for name in STEP_SERIES if it.get(name) is not None}
            out.rows.extend((it["step"], f"{name}.rank{rank}", v) for name, v in values.items())
            if rank == 0:
                out.last_step = it
                out.rows.extend((it["step"], name, v) for name, v in values.items())
            out.series.append((f"rank{rank}", "train", it["step"], values))
        elif kind == "eval":
            step = int(it.get("step", 0))
            values = {k: float(v) for k, v in it.items()
                      if k not in ("type", "step", "ts", "rank") and isinstance(v, (int, float))}
            out.rows.extend((step, k, v) for k, v in values.items())
            out.series.append((f"rank{rank}", "eval", step, values))
            out.events.append(("eval", "eval: " + ", ".join(
                f"{k} {v:.4f}" for k, v in it.items() if k not in ("type", "ts", "rank", "step")
                and isinstance(v, (int, float))), {k: v for k, v in it.items() if k != "type"}, it.get("ts")))
        elif kind == "comm":
            out.comm[rank] = it
            for name in ("comm_bytes_sent", "comm_wait_s", "batch_rows"):
                if it.get(name) is not None:
                    out.rows.append((it["step"], f"{name}.rank{rank}", it[name]))
            if it.get("rounds") is not None and it.get("rank") == 0:
                out.rows.append((it["step"], "rounds", it["rounds"]))
            own = {name: value for name, value in (it.get("metrics") or {}).items()  # staleness...
                   if isinstance(value, (int, float))}
            out.rows.extend((it["step"], f"{name}.rank{rank}", value) for name, value in own.items())
            out.series.append((f"rank{rank}", "comm", it["step"],
                               {**{n: it[n] for n in ("comm_bytes_sent", "comm_wait_s") if it.get(n) is not None},
                                **own}))
        elif kind == "event":
            out.events.append((it.get("kind", "log"), it.get("message", ""), it.get("data"), it.get("ts")))
        elif kind == "log":
            out.lines.append(it)
    return out


def record_batch(store: Any, job_id: str, batch: Batch, log_series: Any) -> None:
    """Keep a sorted batch: series to the sinks (`log_series`), events, metric rows and log lines to the
    job store, and the newest step's progress in the job's row. (Communication totals need the
    runner's running view of every rank: the runner keeps those.)"""
    for series, kind, step, values in batch.series:
        log_series(series, kind, step, values)
    for kind, message, data, ts in batch.events:
        store.add_event(job_id, kind, message, data, ts=ts)
    store.add_metrics(job_id, batch.rows)
    store.add_logs(job_id, batch.lines)
    last = batch.last_step
    if last is not None:
        store.update_job(job_id, step=last["step"], max_steps=last["max_steps"], samples_done=last["samples_done"],
                         samples_total=last["samples_total"], loss=last["loss"], eta_s=last.get("eta_s"))


def comm_summary(latest: dict[int, dict], server_stats: dict | None) -> dict:
    """The job's `comm` field from each rank's latest communication report (and its server's stats)."""
    ranks = sorted(latest)
    return {
        "bytes_sent_per_rank": [latest[r].get("comm_bytes_sent") for r in ranks],
        "wait_s_per_rank": [round(latest[r].get("comm_wait_s") or 0.0, 3) for r in ranks],
        "batch_rows_per_rank": [latest[r].get("batch_rows") for r in ranks],
        "rounds": latest[ranks[0]].get("rounds"), "step": max(c["step"] for c in latest.values()),
        **({"metrics_per_rank": [latest[r].get("metrics") for r in ranks]}
           if any(latest[r].get("metrics") for r in ranks) else {}),
        **({"server": jsonable(server_stats)} if server_stats else {})}


def jsonable(value):
    """A server's stats for the job store (JSON: member ids as string keys)."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value
