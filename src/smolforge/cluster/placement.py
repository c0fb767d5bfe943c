"""Where a data-parallel job's ranks may go: its requirements, and how many ranks fit on a node."""

from __future__ import annotations

import math
from pathlib import Path

from smolforge.cluster import ray_glue
from smolforge.cluster.specs import DataParallelJob
from smolforge.models.tiny import is_preset

COORDINATOR = "@coordinator"


def holds_anywhere(model: str, embedded: bool) -> bool:
    """Every node can load this model: a preset (built from config), or, on an embedded cluster (one
    machine), a local directory. Elsewhere a model is held by the nodes that advertise it."""
    return is_preset(model) or (embedded and Path(model).expanduser().is_dir())


def requirements_for(spec: DataParallelJob, embedded: bool = False) -> ray_glue.Requirements:
    need_model = spec.require_model if spec.require_model is not None else \
        not holds_anywhere(spec.train.model, embedded)
    return ray_glue.Requirements(model=spec.train.model if need_model else None, min_ram_gb=spec.min_ram_gb,
                                 cpus=spec.cpus_per_worker, gpu=spec.gpu, allowed_nodes=spec.allowed_nodes)


def coordinator_requirements(spec: DataParallelJob, embedded: bool = False) -> ray_glue.Requirements:
    base = requirements_for(spec, embedded)
    return ray_glue.Requirements(model=base.model, cpus=spec.cpus_per_worker, gpu="no", on_coordinator=True)


def slots_on(node: ray_glue.NodeInfo, req: ray_glue.Requirements, use_available: bool) -> int:
    src = node.available if use_available else node.resources
    cpu = src.get("CPU", 0.0)
    k = math.floor((cpu + 1e-6) / req.cpus) if req.cpus > 0 else 64
    if not req.on_coordinator:
        w = src.get(ray_glue.WORKER_RESOURCE, 0.0)
        k = min(k, math.floor((w + 1e-6) / max(req.cpus, 0.001)))
    if req.gpu == "required" or (req.gpu == "preferred" and node.gpus >= 1):
        k = min(k, int(src.get("GPU", 0.0) + 1e-6))
    return max(0, k)


