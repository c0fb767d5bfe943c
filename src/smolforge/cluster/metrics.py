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
        loss = GaugeMetricFamily("smolforge_job_loss", "Latest training loss", labels=["job"])
        world = GaugeMetricFamily("smolforge_job_workers", "Ranks in the job's group", labels=["job"])
        for j in jobs:
            if j["state"] in ("running", "paused", "pending"):
                prog.add_metric([j["id"]], j["progress"])
                world.add_metric([j["id"]], j["world_size"] or 0)
                if j["loss"] is not None:
                    loss.add_metric([j["id"]], j["loss"])
        yield prog
        yield loss
        yield world
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


def render(core: Any) -> tuple[bytes, str]:
    reg = getattr(core, "_metrics_registry", None)
    if reg is None:
        reg = CollectorRegistry(auto_describe=False)
        reg.register(_Collector(core))
        core._metrics_registry = reg
    return generate_latest(reg), CONTENT_TYPE_LATEST
