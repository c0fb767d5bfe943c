"""Prometheus metrics for the coordinator, computed at scrape time from the live state.

A private registry (not the process-global one) so several coordinators in one test process do not
collide, and a custom collector so nothing has to be kept in sync: every scrape reads the node
snapshot and the job store.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST


class _Collector:
    def __init__(self, core: Any):
        self.core = core

    def collect(self):
        nodes = self.core.monitor.snapshot()
        by_state = GaugeMetricFamily("smolforge_nodes", "Nodes by state", labels=["state"])
        counts: dict[str, int] = {}
        for n in nodes:
            counts[n["state"]] = counts.get(n["state"], 0) + 1
        for state in ("online", "stale", "joining", "dead"):
            by_state.add_metric([state], counts.get(state, 0))
        yield by_state
        cpu = GaugeMetricFamily("smolforge_node_cpu_percent", "CPU use per node", labels=["node"])
        ram = GaugeMetricFamily("smolforge_node_ram_percent", "RAM use per node", labels=["node"])
        cpus = GaugeMetricFamily("smolforge_node_cpus", "CPUs per node", labels=["node", "role"])
        for n in nodes:
            if n["state"] == "dead":
                continue
            cpus.add_metric([n["name"], n["role"]], n["cpus"])
            u = n.get("usage") or {}
            if u.get("cpu_percent") is not None:
                cpu.add_metric([n["name"]], u["cpu_percent"])
            if u.get("ram_percent") is not None:
                ram.add_metric([n["name"]], u["ram_percent"])
        yield cpus
        yield cpu
        yield ram
        jobs = self.core.store.list_jobs(limit=1000)
        js = GaugeMetricFamily("smolforge_jobs", "Jobs by state", labels=["state"])
        jc: dict[str, int] = {}
        for j in jobs:
            jc[j["state"]] = jc.get(j["state"], 0) + 1
        for state in ("pending", "running", "paused", "completed", "failed", "cancelled"):
            js.add_metric([state], jc.get(state, 0))
        yield js
        prog = GaugeMetricFamily("smolforge_job_progress", "Fraction of steps done", labels=["job"])
        world = GaugeMetricFamily("smolforge_job_workers", "Ranks in the job's group", labels=["job"])
        active = [j for j in jobs if j["state"] in ("running", "paused", "pending")]
        for j in active:
            prog.add_metric([j["id"]], j["progress"])
            world.add_metric([j["id"]], j["world_size"] or 0)
        yield prog
        yield world
        yield from training_families(self.core.store, active)
        # Communication per rank of data-parallel jobs (latest report; counters of the current group)
        sent = GaugeMetricFamily("smolforge_job_comm_bytes_sent", "Bytes a rank handed to collectives",
                                 labels=["job", "rank"])
        wait = GaugeMetricFamily("smolforge_job_comm_wait_seconds", "Time a rank waited in collectives",
                                 labels=["job", "rank"])
        rounds = GaugeMetricFamily("smolforge_job_rounds", "Outer steps taken (DiLoCo)", labels=["job"])
        own = GaugeMetricFamily("smolforge_job_strategy_metric",
                                "A strategy's own numbers per rank (parameter servers: parts_done, claim_waits, "
                                "staleness_mean, staleness_max, dropped...)", labels=["job", "rank", "name"])
        for j in jobs:
            comm = j.get("comm") or {}
            for rank, value in enumerate(comm.get("bytes_sent_per_rank") or []):
                if value is not None:
                    sent.add_metric([j["id"], str(rank)], value)
            for rank, value in enumerate(comm.get("wait_s_per_rank") or []):
                if value is not None:
                    wait.add_metric([j["id"], str(rank)], value)
            if comm.get("rounds") is not None:
                rounds.add_metric([j["id"]], comm["rounds"])
            for rank, values in enumerate(comm.get("metrics_per_rank") or []):
                for name, value in (values or {}).items():
                    if isinstance(value, (int, float)):
                        own.add_metric([j["id"], str(rank), name], value)
        yield sent
        yield wait
        yield rounds
        yield own


# The job store's series (the runners: `loss`, `lr`... for the job, `<name>.rank<R>` per
# rank, `<name>.student<N>` per student) -> the exported gauge (prefix smolforge_job_ or smolforge_rank_)
EXPORTED = {"loss": "loss", "lr": "learning_rate", "grad_norm": "grad_norm", "tokens_per_s": "tokens_per_second",
            "comm_bytes_sent": "bytes_sent", "staleness_mean": "staleness", "staleness_max": "staleness_max"}
HELP = {"loss": "Latest training loss", "learning_rate": "Current learning rate", "grad_norm": "Gradient norm "
        "(before clipping)", "tokens_per_second": "Training throughput", "bytes_sent": "Bytes handed to "
        "collectives / servers", "staleness": "Mean staleness of applied updates (parameter servers)",
        "staleness_max": "Largest staleness of an applied update (parameter servers)", "step": "Optimizer steps done"}


def _split_series(name: str) -> tuple[str, str | None]:
    """`loss.rank1` -> ("loss", "1"); `loss.student0` -> ("loss", "student0"); `loss` -> ("loss", None)."""
    base, _, tail = name.rpartition(".")
    if base and tail.startswith("rank") and tail[4:].isdigit():
        return base, tail[4:]
    if base and tail.startswith("student") and tail[7:].isdigit():
        return base, tail
    return name, None


def _nodes_of(tasks: list[dict]) -> dict[str, str]:
    """rank ("0", "1") or student ("student0") -> the node that runs it now (the newest task row wins)."""
    out: dict[str, str] = {}
    for t in tasks:
        if not t.get("node_name"):
            continue
        if t["kind"] == "dp_rank" and t.get("rank") is not None:
            out[str(t["rank"])] = t["node_name"]
        elif t["kind"] == "student":
            out["student" + t["id"].rsplit("-", 1)[-1]] = t["node_name"]  # <job>-student-<N>
    return out


def training_families(store: Any, jobs: list[dict]):
    """Per-job gauges (labels job, node: rank 0's node) and per-rank/student gauges (job, rank, node)
    from each job's newest metric rows; `step` is the step of the newest loss."""
    job_fams = {n: GaugeMetricFamily(f"smolforge_job_{n}", HELP[n], labels=["job", "node"])
                for n in [*EXPORTED.values(), "step"]}
    rank_fams = {n: GaugeMetricFamily(f"smolforge_rank_{n}", HELP[n] + " per rank or student",
                                      labels=["job", "rank", "node"]) for n in [*EXPORTED.values(), "step"]}
    for j in jobs:
        nodes = _nodes_of(store.tasks(j["id"]))
        job_node = nodes.get("0") or ",".join(j.get("nodes") or []) or "-"
        latest = store.latest_metrics(j["id"])
        if "loss" not in latest and j.get("loss") is not None:  # a job whose runner keeps no job-level rows
            latest["loss"] = (int(j.get("step") or 0), j["loss"])
        for name, (step, value) in latest.items():
            base, who = _split_series(name)
            exported = EXPORTED.get(base)
            if exported is None:
                continue
            if who is None:
                job_fams[exported].add_metric([j["id"], job_node], value)
                if base == "loss":
                    job_fams["step"].add_metric([j["id"], job_node], step)
            else:
                labels = [j["id"], who, nodes.get(who, "-")]
                rank_fams[exported].add_metric(labels, value)
                if base == "loss":
                    rank_fams["step"].add_metric(labels, step)
    yield from job_fams.values()
    yield from rank_fams.values()


def render(core: Any) -> tuple[bytes, str]:
    reg = getattr(core, "_metrics_registry", None)
    if reg is None:
        reg = CollectorRegistry(auto_describe=False)
        reg.register(_Collector(core))
        core._metrics_registry = reg
    return generate_latest(reg), CONTENT_TYPE_LATEST
