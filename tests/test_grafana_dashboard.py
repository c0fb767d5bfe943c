"""Issue 46 item 8: the shipped Grafana dashboard (deploy/grafana/smolforge.json) asks only for metrics
that the coordinator's /metrics really exports. Grafana cannot be installed here, so the check is on the
JSON: every panel query and template variable names metrics; each must be a family that
`cluster.metrics.render` (what /metrics returns) writes with samples, for a store and node table that
hold one running job with every series the runners write, job-level and per rank."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "smolforge.json"
METRIC = re.compile(r"\b(smolforge_[a-zA-Z0-9_]+)\b")


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, query text) of every panel target (rows' nested panels too) and template variable."""
    out = []
    panels = list(dashboard.get("panels", []))
    while panels:
        panel = panels.pop(0)
        panels.extend(panel.get("panels", []))
        for target in panel.get("targets", []):
            out.append((f"panel {panel.get('title')!r}", str(target.get("expr", ""))))
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        if var.get("type") == "query":
            out.append((f"variable {var.get('name')!r}", str(query.get("query") if isinstance(query, dict) else query)))
    return out


def exported(tmp_path) -> set[str]:
    """The metric names /metrics writes with at least one sample: `render` over a real job store."""
    from prometheus_client.parser import text_string_to_metric_families

    from smolforge.cluster.control.jobstore import JobStore
    from smolforge.cluster.metrics import EXPORTED, render

    store = JobStore(tmp_path / "jobs.db")
    job = store.create_job("data_parallel", {})
    store.set_state(job, "running")
    store.upsert_task(f"{job}-g1-r0", job, "dp_rank", "running", rank=0, node_name="w1")
    store.add_metrics(job, [(2, name, 1.0) for name in EXPORTED] + [(2, f"{name}.rank0", 1.0) for name in EXPORTED])
    node = {"name": "w1", "state": "online", "role": "worker", "cpus": 2, "usage": {"cpu_percent": 5.0, "ram_percent": 9.0}}
    core = SimpleNamespace(monitor=SimpleNamespace(snapshot=lambda: [node]), store=store)
    body, _ = render(core)
    return {family.name for family in text_string_to_metric_families(body.decode()) if family.samples}


def test_every_dashboard_query_names_a_metric_that_metrics_exports(tmp_path):
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    asked = queries(dashboard)
    assert len(asked) >= 10  # the panels were found
    have = exported(tmp_path)
    missing = [(where, name) for where, text in asked for name in METRIC.findall(text) if name not in have]
    assert not missing, f"the dashboard asks for metrics /metrics does not export: {missing}; exported: {sorted(have)}"
    assert all(METRIC.search(text) for _, text in asked), [q for q in asked if not METRIC.search(q[1])]
