"""Where a data-parallel job's ranks may go: its requirements, and how many ranks fit on a node."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from smolforge.cluster.nodes import ray_glue
from smolforge.cluster.control.specs import DataParallelJob
from smolforge.models.names import built_from_code

COORDINATOR = "@coordinator"
LINK_ENV = "SMOLFORGE_LINK_MBPS"  # the link rate (Mbit/s) a model's transfer is estimated at, where none was measured


def holds_anywhere(model: str, embedded: bool) -> bool:
    """Every node can load this model: a preset or a twin (built from code), or, on an embedded cluster
    (one machine), a local directory or file (a llamacpp teacher's GGUF). Elsewhere a model is held by
    the nodes that advertise it."""
    return built_from_code(model) or (embedded and Path(model).expanduser().exists())


def model_holders(model: str, nodes: list[ray_glue.NodeInfo]) -> list[ray_glue.NodeInfo]:
    """The live nodes that advertise `model` as weights, the coordinator's first (it runs no ranks):
    where a worker that lacks the model fetches it from (`workloads.model_transfer`)."""
    res = ray_glue.model_resource(model)
    return sorted((n for n in nodes if n.alive and res in n.resources),
                  key=lambda n: n.role not in ("coordinator", "embedded"))


def model_travels(model: str, require_model: bool | None, embedded: bool,
                  nodes: list[ray_glue.NodeInfo] | None = None) -> bool:
    """A job's model is sent to the nodes placed for it that lack it (`workloads.model_transfer`), for
    every kind that runs a model on a worker: `require_model` is unset and some live node holds the
    model (its workers' models dirs, the coordinator's). `nodes` None: the live node table when this
    process is connected to a cluster, else none (no holder known)."""
    if require_model is not None or holds_anywhere(model, embedded):
        return False
    if nodes is None:
        import ray

        nodes = ray_glue.nodes() if ray.is_initialized() else []
    return bool(model_holders(model, nodes))


def link_bytes_per_s(measured: float | None = None) -> float:
    """The rate a model is estimated to reach a node at: the node's measured link (the stage planner's
    probe), else the configured $SMOLFORGE_LINK_MBPS, else the stage planner's default (100 Mbit/s)."""
    from smolforge.models.placement import DEFAULT_LINK_BYTES_PER_S

    if measured:
        return float(measured)
    try:
        configured = float(os.environ.get(LINK_ENV) or 0)
    except ValueError:
        configured = 0.0
    return configured * 1e6 / 8 if configured > 0 else DEFAULT_LINK_BYTES_PER_S


def transfer_seconds(nbytes: float, measured: float | None = None) -> float:
    """Estimated seconds to send `nbytes` of a model to a node (`link_bytes_per_s`): what choosing a
    node that lacks the model adds before its work starts (nothing for a node that holds it)."""
    return max(0.0, float(nbytes)) / link_bytes_per_s(measured)


def transfer_note(sends: list[tuple[str, float, float | None]]) -> tuple[str, dict[str, float]]:
    """(a line for a plan's description, seconds per node) for the transfers a plan implies, each
    (node, bytes, its measured link or None); ("", {}) when nothing travels."""
    if not sends:
        return "", {}
    est = {node: round(transfer_seconds(nbytes, rate), 3) for node, nbytes, rate in sends}
    parts = [f"{nbytes / 1e6:.1f} MB to {node} (est. {est[node]:.1f} s at "
             f"{link_bytes_per_s(rate) * 8 / 1e6:.0f} Mbit/s)" for node, nbytes, rate in sends]
    return f"model transfer before the start: {'; '.join(parts)}; est. {max(est.values()):.1f} s in all", est


def fewest_transfer_seconds(nodes: list[ray_glue.NodeInfo], model: str, nbytes: float,
                            rates: dict[str, float] | None = None) -> list[ray_glue.NodeInfo]:
    """`nodes` ordered by the transfer a stage or task placed there needs first: the nodes that hold
    `model` (0 s) before those it must be sent to (`transfer_seconds` at each one's measured rate in
    `rates`, by node id), the order otherwise kept."""
    res = ray_glue.model_resource(model)
    cost = {n.node_id: 0.0 if res in n.resources else transfer_seconds(nbytes, (rates or {}).get(n.node_id))
            for n in nodes}
    return sorted(nodes, key=lambda n: cost[n.node_id])


def travels(spec: DataParallelJob, embedded: bool, nodes: list[ray_glue.NodeInfo] | None = None) -> bool:
    """A data-parallel job's model travels (`model_travels`)."""
    return model_travels(spec.train.model, spec.require_model, embedded, nodes)


def model_need(model: str, require_model: bool | None, embedded: bool,
               nodes: list[ray_glue.NodeInfo] | None = None) -> str | None:
    """The model a task's node must advertise already, or None: none when every node can build or
    read it, or it travels; else the model (`require_model`, or no node holds it: placement then
    refuses with what to do, `ray_glue.check_placeable`)."""
    if require_model is not None:
        return model if require_model else None
    return None if holds_anywhere(model, embedded) or model_travels(model, None, embedded, nodes) else model


def requirements_for(spec: DataParallelJob, embedded: bool = False,
                     nodes: list[ray_glue.NodeInfo] | None = None) -> ray_glue.Requirements:
    """What each rank needs of its node; the model only when it must be there already (require_model,
    or no node holds it: the submit is refused with what to do), not when it travels (`travels`)."""
    return ray_glue.Requirements(model=model_need(spec.train.model, spec.require_model, embedded, nodes),
                                 min_ram_gb=spec.min_ram_gb,
                                 reserve_ram_gb=spec.min_ram_gb, cpus=spec.cpus_per_worker, gpu=spec.gpu,
                                 allowed_nodes=spec.allowed_nodes, gpus=float(len(spec.gpu_ids or []) or 1),
                                 gpu_memory_gb=spec.gpu_memory_gb, gpu_ids=spec.gpu_ids)


def worker_bundles(spec: DataParallelJob, req: ray_glue.Requirements, nodes: list[ray_glue.NodeInfo], n: int,
                   embedded: bool) -> list[tuple[dict, dict]]:
    """`n` bundles for a round's workers. When the model travels, as many as fit ask for nodes that
    hold it already (first, so Ray places them first), and only the rest may land where it is fetched."""
    if req.model is not None or not travels(spec, embedded, nodes):
        return [req.bundle(nodes) for _ in range(n)]
    held = dataclasses.replace(req, model=spec.train.model)
    cands = held.candidates(nodes)
    k = min(n, sum(slots_on(c, held, use_available=True) for c in cands)) if cands else 0
    return [held.bundle(nodes) for _ in range(k)] + [req.bundle(nodes) for _ in range(n - k)]


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
