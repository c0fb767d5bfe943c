"""How a node reads to a script: the dict `/api/v1/nodes`, `Client.list_nodes()` and the Orchestrator's
`discover_nodes()` return.

Today's flat keys (`cpus`, `gpus`, `ram_gb`, `models`, `ollama_models`, `state`, `usage`, ...) sit beside
the seeds' nested `resources` block, so code written for either reads it:
    n["resources"]["cpu"]["cores"], n["resources"]["memory"]["total_gb"], n["resources"]["gpu"]["count"],
    n["resources"]["ollama_models"] (a list of {"name": ...}), n["ollama_models"] (the names).
Ray's own accounting (`CPU`, `GPU`, `memory` in bytes, `model:<name>`, ...) is `ray_resources` (what
the node has) and `available` (what is free now).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from smolforge.cluster.nodes.ray_glue import GPU_MEM_LABEL, NodeInfo


def node_view(node: NodeInfo, **extra: Any) -> dict[str, Any]:
    """The node as a JSON-ready dict; `extra` (state, usage, heartbeat_age_s) is added as is."""
    d = asdict(node)
    d["ray_resources"] = d.pop("resources")
    d.update(extra)
    usage = d.get("usage") or {}
    free_gb = None
    if usage.get("ram_total_gb") is not None and usage.get("ram_used_gb") is not None:
        free_gb = round(usage["ram_total_gb"] - usage["ram_used_gb"], 2)
    gpu_mem = float(node.labels.get(GPU_MEM_LABEL) or 0) or None
    d["resources"] = {
        "cpu": {"cores": node.cpus},
        "memory": {"total_gb": node.ram_gb, "available_gb": free_gb},
        "gpu": {"available": node.gpus >= 1, "count": int(node.gpus), "type": node.gpu_type,
                "memory_gb": gpu_mem},
        "ollama_models": [{"name": m} for m in node.ollama_models],
    }
    return d
