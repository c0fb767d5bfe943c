"""The metric-sink seam (smolforge.telemetry.sinks) and the Prometheus families the coordinator builds
from the job store's series: fast, no cluster (the real job is tests/cluster/test_monitoring.py)."""

from __future__ import annotations

import json

from smolforge.telemetry.sinks import SeriesSinks, Sinks, run_name
from smolforge.telemetry.writers import MetricsWriter


class Recorder:
    def __init__(self):
        self.calls: list[tuple[str, int, dict]] = []
        self.closed = False

    def log(self, kind, step, values):
        self.calls.append((kind, step, dict(values)))

    def close(self):
        self.closed = True


def test_sinks_keep_plottable_numbers_and_the_first_pass_of_a_step():
    rec = Recorder()
    sinks = Sinks([rec])
    sinks.log("train", 1, {"loss": 2.5, "lr": 1e-3, "note": "x", "flag": True, "bad": float("nan"), "n": 3})
    sinks.log("comm", 1, {"comm_bytes_sent": 10})  # same step, another kind: fine
    sinks.log("train", 2, {"loss": 2.0})
    sinks.log("train", 1, {"loss": 9.9})  # a re-formed group repeating step 1: W&B would drop it, so all do
    sinks.log("train", 3, {"note": "only text"})  # nothing plottable: nothing logged
    sinks.close()
    assert rec.calls == [("train", 1, {"loss": 2.5, "lr": 1e-3, "n": 3.0}), ("comm", 1, {"comm_bytes_sent": 10.0}),
                         ("train", 2, {"loss": 2.0})]
    assert rec.closed


def test_run_name_is_the_seeds_format():
    assert run_name("ddp", "worker", 1, 2e-4, 8, host="w1") == "ddp-worker-w1_rank1_lr0.0002_bs8"


def test_series_sinks_open_one_tensorboard_run_per_series_lazily(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    off = SeriesSinks(tmp_path / "off", tensorboard=False, wandb=None, name_for=str)
    off.log("rank0", "train", 1, {"loss": 1.0})
    off.close()
    assert not (tmp_path / "off").exists()  # nothing asked for: nothing written

    sinks = SeriesSinks(tmp_path, tensorboard=True, wandb=None, name_for=str)
    for step in (1, 2):
        sinks.log("student0", "train", step, {"loss": 1.0 / step})
    sinks.log("student1", "train", 1, {"loss": 5.0})
    sinks.close()
    assert sorted(p.name for p in (tmp_path / "tensorboard").iterdir()) == ["student0", "student1"]
    acc = EventAccumulator(str(tmp_path / "tensorboard" / "student0"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 1.0), (2, 0.5)]


def test_metrics_writer_keeps_jsonl_and_mirrors_to_tensorboard(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=True)
    w.log("train", 1, loss=1.5, lr=0.1, text="kept in jsonl only")
    w.close()
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(line)["text"] == "kept in jsonl only"
    assert any((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_prometheus_families_per_job_and_per_rank_or_student(tmp_path):
    from smolforge.cluster.control.jobstore import JobStore
    from smolforge.cluster.metrics import training_families

    store = JobStore(tmp_path / "jobs.db")
    dp = store.create_job("data_parallel", {})
    store.upsert_task(f"{dp}-g1-r0", dp, "dp_rank", "running", rank=0, node_name="w1")
    store.upsert_task(f"{dp}-g1-r1", dp, "dp_rank", "running", rank=1, node_name="w2")
    store.add_metrics(dp, [(1, "loss", 3.0), (2, "loss", 2.0), (2, "loss.rank0", 2.0), (2, "loss.rank1", 2.2),
                           (2, "lr", 1e-3), (2, "comm_bytes_sent.rank1", 4096), (2, "staleness_mean.rank1", 1.5),
                           (2, "batch_rows.rank1", 2)])
    kd = store.create_job("distill", {})
    store.upsert_task(f"{kd}-student-0", kd, "student", "running", node_name="w3")
    store.add_metrics(kd, [(4, "loss.student0", 0.7), (4, "tokens_per_s.student0", 99.0)])
    jobs = [store.get_job(dp), store.get_job(kd)]
    got = {(f.name, tuple(sorted(s.labels.items()))): s.value for f in training_families(store, jobs)
           for s in f.samples}
    assert got[("smolforge_job_loss", (("job", dp), ("node", "w1")))] == 2.0  # the newest row
    assert got[("smolforge_job_step", (("job", dp), ("node", "w1")))] == 2
    assert got[("smolforge_job_learning_rate", (("job", dp), ("node", "w1")))] == 1e-3
    assert got[("smolforge_rank_loss", (("job", dp), ("node", "w2"), ("rank", "1")))] == 2.2
    assert got[("smolforge_rank_bytes_sent", (("job", dp), ("node", "w2"), ("rank", "1")))] == 4096
    assert got[("smolforge_rank_staleness", (("job", dp), ("node", "w2"), ("rank", "1")))] == 1.5
    assert got[("smolforge_rank_loss", (("job", kd), ("node", "w3"), ("rank", "student0")))] == 0.7
    assert got[("smolforge_rank_tokens_per_second", (("job", kd), ("node", "w3"), ("rank", "student0")))] == 99.0
    assert not any("batch_rows" in name for name, _ in got)  # only the exported names
