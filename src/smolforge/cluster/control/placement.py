"""Where a data-parallel job's ranks may go: its requirements, and how many ranks fit on a node."""

from __future__ import annotations

import math
from pathlib import Path

from smolforge.cluster.nodes import ray_glue
from smolforge.cluster.control.specs import DataParallelJob
from smolforge.models.names import built_from_code

COORDINATOR = "@coordinator"


def holds_anywhere(model: str, embedded: bool) -> bool:
    """Every node can load this model: a preset or a twin (built from code), or, on an embedded cluster
    (one machine), a local directory or file (a llamacpp teacher's GGUF). Elsewhere a model is held by
    the nodes that advertise it."""
    return built_from_code(model) or (embedded and Path(model).expanduser().exists())


def requirements_for(spec: DataParallelJob, embedded: bool = False) -> ray_glue.Requirements:
    need_model = spec.require_model if spec.require_model is not None else \
        not holds_anywhere(spec.train.model, embedded)
    return ray_glue.Requirements(model=spec.train.model if need_model else None, min_ram_gb=spec.min_ram_gb,
                                 reserve_ram_gb=spec.min_ram_gb, cpus=spec.cpus_per_worker, gpu=spec.gpu,
                                 allowed_nodes=spec.allowed_nodes, gpus=float(len(spec.gpu_ids or []) or 1),
                                 gpu_memory_gb=spec.gpu_memory_gb, gpu_ids=spec.gpu_ids)


def coordinator_requirements(spec: DataParallelJob, embedded: bool = False) -> ray_glue.Requirements:
    base = requirements_for(spec, embedded)
    return ray_glue.Requirements(model=base.model, cpus=spec.cpus_per_worker, gpu="no", on_coordinator=True)


def per_task(req: ray_glue.Requirements, node: ray_glue.NodeInfo) -> dict[str, float]:
    """The resources one task of `req` takes on `node` (a GPU only where it gets one there)."""
    return req.per_task(req.gpu == "required" or (req.gpu == "preferred" and node.gpus >= 1))


def slots(req: ray_glue.Requirements, node: ray_glue.NodeInfo, free: dict[str, float]) -> int:
    """How many tasks of `req` fit in the resources `free` of `node`."""
    need = per_task(req, node)
    return max(0, min((math.floor((free.get(k, 0.0) + 1e-6) / v) for k, v in need.items() if v > 0), default=64))


def slots_on(node: ray_glue.NodeInfo, req: ray_glue.Requirements, use_available: bool) -> int:
    return slots(req, node, node.available if use_available else node.resources)


def round_world(spec: DataParallelJob, nodes: list[ray_glue.NodeInfo], req: ray_glue.Requirements,
                embedded: bool) -> tuple[int, int, int]:
    """How big a data-parallel group fits now: (workers wanted, workers that fit, 1 if the lent
    coordinator takes a rank else 0). The workers are cut down until the global batch divides
    evenly among all ranks, so every round keeps the job's global batch."""
    want = spec.num_workers + len([n for n in spec.lent_nodes if n != COORDINATOR])
    candidates = req.candidates(nodes)
    n_workers = min(want, sum(slots_on(n, req, use_available=True) for n in candidates) if candidates else 0)
    n_coord = 0
    if COORDINATOR in spec.lent_nodes:
        creq = coordinator_requirements(spec, embedded)
        if creq.candidates(nodes) and sum(slots_on(n, creq, True) for n in creq.candidates(nodes)) >= 1:
            n_coord = 1
    while n_workers > 0 and spec.global_batch % (n_workers + n_coord):
        n_workers -= 1
    return want, n_workers, n_coord
