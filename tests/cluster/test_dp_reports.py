"""A drained batch of rank reports, sorted into store rows without Ray (cluster/workloads/data_parallel/reports.py)."""

from smolforge.cluster.workloads.data_parallel.reports import comm_summary, sort_batch


def test_a_batch_becomes_job_and_rank_series_events_and_lines_in_time_order():
    items = [
        {"type": "step", "rank": 1, "step": 1, "ts": 2.0, "loss": 2.5, "lr": 0.1},
        {"type": "step", "rank": 0, "step": 1, "ts": 1.0, "loss": 3.0, "lr": 0.1, "max_steps": 4,
         "samples_done": 8, "samples_total": 32},
        {"type": "eval", "rank": 0, "step": 1, "ts": 3.0, "eval_loss": 2.0},
        {"type": "comm", "rank": 1, "step": 1, "ts": 4.0, "comm_bytes_sent": 100, "comm_wait_s": 0.5,
         "metrics": {"staleness_mean": 1.5, "note": "x"}},
        {"type": "event", "kind": "balance", "message": "m", "ts": 5.0},
        {"type": "log", "task": "r1", "line": "hello", "ts": 6.0},
    ]
    batch = sort_batch(items)
    assert batch.rows[:4] == [(1, "loss.rank0", 3.0), (1, "lr.rank0", 0.1), (1, "loss", 3.0), (1, "lr", 0.1)]
    assert (1, "loss.rank1", 2.5) in batch.rows and (1, "eval_loss", 2.0) in batch.rows
    assert (1, "comm_bytes_sent.rank1", 100) in batch.rows and (1, "staleness_mean.rank1", 1.5) in batch.rows
    assert not any(name.startswith("note") for _, name, _ in batch.rows)  # only numbers become series
    assert batch.last_step["rank"] == 0  # the job's progress is rank 0's
    assert [e[0] for e in batch.events] == ["eval", "balance"]
    assert [s[:2] for s in batch.series] == [("rank0", "train"), ("rank1", "train"), ("rank0", "eval"),
                                              ("rank1", "comm")]
    assert batch.lines == [items[-1]]
    summary = comm_summary(batch.comm, {3: {"parts": 2}})
    assert summary["bytes_sent_per_rank"] == [100] and summary["server"] == {"3": {"parts": 2}}
