"""Which node: the cluster's placement decisions, as pure functions over the node table (`ray_glue.NodeInfo`
rows, no Ray calls) that the kinds' runners call. Whether a model must be on a node already or travels
to it (`model_need`, `model_travels`), where it is sent from (`lacking`, `transfer_source`) and what that
costs (`transfer_seconds`); a data-parallel job's ranks (`requirements_for`, `slots`, `round_world`,
`round_plan`, `joiner_requirements`); a split job's trunk and client (`trunk_plan`, `client_plan`);
an export task whose model travels (`travel_node`); a distillation's students (`pick_student_node`,
`pick_group_nodes`). The queue's admission is `queue.py`; a model's stages, `stage_plan.py`."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smolforge.cluster.nodes import ray_glue
from smolforge.errors import SmolforgeError
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
    from smolforge.models.stage_costs import DEFAULT_LINK_BYTES_PER_S

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


def may_travel(model: str, require_model: bool | None, embedded: bool) -> bool:
    """Could a job's model be sent to a placed node that lacks it: not when every node can build or
    read it (`holds_anywhere`) or the tasks download it themselves (`require_model: false`). Whether it
    does is the node table's answer (`model_travels`)."""
    return not (require_model is False or holds_anywhere(model, embedded))


# -- a data-parallel job: its round, its joiners ------------------------------------------------

@dataclass(frozen=True)
class RoundPlan:
    """A data-parallel round that may start now: a bundle per rank (the workers', holders of the model
    first, then the lent coordinator's), the world, whether the lent coordinator takes a rank, how
    many ranks were asked for, and whether it has them all (else it runs `degraded`)."""

    bundles: list[tuple[dict, dict]]
    world: int
    n_coord: int
    asked: int
    full: bool


def round_plan(spec: DataParallelJob, nodes: list[ray_glue.NodeInfo], req: ray_glue.Requirements, embedded: bool,
               quick: bool = False, waited_s: float = 0.0, grace_s: float = 5.0) -> RoundPlan | None:
    """The round to start on `nodes` now, or None: wait. A round starts with every rank asked for
    (`round_world`: the workers cut until the global batch divides evenly); with fewer only when it
    recovers from a lost node (`quick`) and has waited past `grace_s`, and only on a world the global
    batch divides. `req`: each worker's requirements, less the nodes given back (`job leave`)."""
    lent_coord = COORDINATOR in spec.lent_nodes
    want, n_workers, n_coord = round_world(spec, nodes, req, embedded)
    world = n_workers + n_coord
    full = n_workers == want and n_coord == int(lent_coord)
    if world < 1 or spec.global_batch % world or not (full or (quick and waited_s > grace_s)):
        return None
    bundles = worker_bundles(spec, req, nodes, n_workers, embedded)  # holders first
    if n_coord:
        bundles.append(coordinator_requirements(spec, embedded).bundle(nodes))
    return RoundPlan(bundles, world, n_coord, want + int(lent_coord), full)


def joiner_requirements(spec: DataParallelJob, node: str, embedded: bool, worker: ray_glue.Requirements,
                        only_there: bool = False) -> ray_glue.Requirements:
    """What a node lent to a running job (`job join NODE`) needs: the coordinator's rank
    (`coordinator_requirements`) for `@coordinator`, else a worker's rank, `worker` (the job's
    `requirements_for`); `only_there`: on that named node alone, with the worker's model, CPUs and GPU
    only (what `join` checks at once)."""
    if node == COORDINATOR:
        return coordinator_requirements(spec, embedded)
    if only_there:
        return ray_glue.Requirements(model=worker.model, cpus=worker.cpus, gpu=worker.gpu, allowed_nodes=[node])
    return worker


# -- one task's node: a split job's trunk and client, an export task whose model travels ----------------

@dataclass
class TrunkPlan:
    """Where a split job's trunk goes and why (the `trunk_placed` event says it), and the Ray options
    its actor takes there (the runner pins it to `node`)."""

    node: ray_glue.NodeInfo
    why: str
    options: dict[str, Any]


def trunk_plan(req: ray_glue.Requirements, nodes: list[ray_glue.NodeInfo], avoid: set[str]) -> TrunkPlan:
    """A split job's trunk node among those that can run `req` (`Requirements.candidates`: with gpu
    preferred, the GPU nodes when there are any): one with room first, then the most GPUs and free
    CPUs, then by name; a node id in `avoid` (a trunk of this job was lost there) only when no other
    can. SmolforgeError, listing every node and why not, when none can."""
    options = req.ray_options(nodes)  # raises when no node can run it, saying why for each
    cands = req.candidates(nodes)
    fresh = [n for n in cands if n.node_id not in avoid] or cands
    node = max(fresh, key=lambda n: (slots(req, n, n.available) > 0, n.gpus, n.available.get("CPU", 0.0), n.name))
    options.pop("label_selector", None)  # the runner pins the actor to the node instead
    gpu = "a GPU node" if options.get("num_gpus") else ("no GPU node can run it, so a CPU node"
                                                       if req.gpu == "preferred" else "a CPU node")
    held = f"holds {req.model}" if req.model else "every node can build the model"
    again = "; not where the trunk was lost" if avoid and node.node_id not in avoid else ""
    return TrunkPlan(node, f"{gpu}, {held}{again}", options)


def client_requirements(model: str, client_node: str, cpus: float, embedded: bool) -> ray_glue.Requirements:
    """A split job's client: on the coordinator's node (`@coordinator`: outside the worker pool; the
    embedded cluster's one node) or the worker `client_node` names. It reads the model's bottom and
    top from the checkpoint, so the node must hold it, unless every node can build or read it
    (`holds_anywhere`)."""
    need = None if holds_anywhere(model, embedded) else model
    if client_node == COORDINATOR:
        return ray_glue.Requirements(model=need, cpus=cpus, on_coordinator=True)
    return ray_glue.Requirements(model=need, cpus=cpus, allowed_nodes=[client_node])


@dataclass
class ClientPlan:
    """Where a split job's client goes, and why (the `client_placed` event says it): `req` pins it
    (the coordinator's node, or one worker by name); `again` when it is not where `client_node` says."""

    req: ray_glue.Requirements
    node: str
    why: str
    again: bool = False


def client_plan(model: str, client_node: str, cpus: float, embedded: bool, nodes: list[ray_glue.NodeInfo],
                avoid: set[str]) -> ClientPlan:
    """A split job's client node. Where `client_node` says (`client_requirements`) unless a client of
    this job was lost on every node that can run it there (node ids in `avoid`); then placed again:
    the coordinator's node when it can run it (it holds the uploaded data), else the worker with the
    most free CPUs (by name on a tie), never a node in `avoid`. SmolforgeError, listing every node and
    why not, when none can (as `Requirements.ray_options` says it)."""
    wanted = client_requirements(model, client_node, cpus, embedded)
    here = [n for n in wanted.candidates(nodes) if n.node_id not in avoid]
    if here or not avoid:
        wanted.ray_options(nodes)  # raises, saying why for each node, when none can run it
        return ClientPlan(wanted, here[0].name if len(here) == 1 else client_node, f"client_node {client_node}")
    need = wanted.model
    for req in (ray_glue.Requirements(model=need, cpus=cpus, on_coordinator=True),
                ray_glue.Requirements(model=need, cpus=cpus)):
        cands = [n for n in req.candidates(nodes) if n.node_id not in avoid]
        if cands:
            node = max(cands, key=lambda n: (n.available.get("CPU", 0.0), n.name))
            pinned = req if req.on_coordinator else dataclasses.replace(req, allowed_nodes=[node.name])
            return ClientPlan(pinned, node.name, f"placed again: the client was lost on {client_node}; "
                              f"{'the coordinator holds the data' if req.on_coordinator else 'a worker that can run it'}",
                              again=True)
    left = [n for n in nodes if n.node_id not in avoid]
    ray_glue.Requirements(model=need, cpus=cpus).ray_options(left)  # raises: every node and why not
    raise SmolforgeError("no node can run the split client", fix="add a node that holds the model")


def travel_node(req: ray_glue.Requirements, model: str, nodes: list[ray_glue.NodeInfo]
                ) -> tuple[ray_glue.Requirements | None, ray_glue.NodeInfo | None]:
    """Where one task whose model travels runs (an export): (`req` asking for the model, when a node
    that holds it can run the task: nothing is sent; None, else); the node the model is sent to first,
    the candidate with the most free CPUs (None when a holder runs it, or no candidate is in the table:
    Ray places the task by `req`, or says why not)."""
    held = dataclasses.replace(req, model=model)
    if held.candidates(nodes):
        return held, None
    cands = req.candidates(nodes)
    return None, (max(cands, key=lambda n: n.available.get("CPU", 0.0)) if cands else None)


# -- where a model is sent from ---------------------------------------------------------------------

def lacking(model: str, placed: list[tuple[str, str]], nodes: list[ray_glue.NodeInfo]
            ) -> tuple[list[str], list[tuple[str, str]]]:
    """(names of the placed nodes, given as (node id, name), that advertise the model; (node id, name)
    of those that must fetch it). A placed node missing from the table `nodes` must fetch it."""
    by_id = {n.node_id: n for n in nodes}
    have, need = [], []
    for node_id, name in dict(placed).items():
        node = by_id.get(node_id)
        if node is not None and ray_glue.model_resource(model) in node.resources:
            have.append(name)
        else:
            need.append((node_id, name))
    return have, need


def transfer_source(model: str, need: list[tuple[str, str]], nodes: list[ray_glue.NodeInfo]
                    ) -> ray_glue.NodeInfo | None:
    """The node a model is sent from to the nodes `need` ((node id, name) each): a live holder that is
    not one of them, the coordinator's first (`model_holders`); None when none holds it any more."""
    going = {node_id for node_id, _ in need}
    return next((n for n in model_holders(model, nodes) if n.node_id not in going), None)


# -- a distillation's students (the distill runner's session asks) ------------------------------------

def pick_student_node(candidates: list[tuple[float, ray_glue.NodeInfo]], cpus: float, teacher_node_ids: set[str],
                      hybrid: bool = False) -> ray_glue.NodeInfo | None:
    """The node a student starts on, from (free CPUs, node) pairs; None: queue it.

    teacher_student mode: the freest node with `cpus` free, GPU nodes first, then by name; a node whose
    teacher left room takes a student too. hybrid mode: teachers and students keep to separate nodes,
    so a node running a teacher (`teacher_node_ids`) is never chosen (it takes a student once its
    teacher finishes, through rotation)."""
    fits = [(f, n) for f, n in candidates if f >= cpus - 1e-9]
    if hybrid:
        fits = [(f, n) for f, n in fits if n.node_id not in teacher_node_ids]
    if not fits:
        return None
    return min(fits, key=lambda fn: (-(fn[1].gpus >= 1), -fn[0], fn[1].name))[1]


def pick_group_nodes(members: list[tuple[float, list[ray_glue.NodeInfo]]], busy: dict[str, float],
                     teacher_node_ids: set[str], hybrid: bool = False) -> list[ray_glue.NodeInfo] | None:
    """A node per member of a student group (a lone student is a group of one), each member given as
    (its CPUs, its eligible nodes): each picked as `pick_student_node` picks, from each node's CPUs less
    `busy` (node id -> CPUs taken) and less what the members before it took; None when a member has no
    node, for a group starts whole or not at all (a group half started waits in its first collective)."""
    taken = dict(busy)
    picks: list[ray_glue.NodeInfo] = []
    for cpus, eligible in members:
        pick = pick_student_node([(n.cpus - taken.get(n.node_id, 0.0), n) for n in eligible], cpus,
                                 teacher_node_ids, hybrid)
        if pick is None:
            return None
        taken[pick.node_id] = taken.get(pick.node_id, 0.0) + cpus
        picks.append(pick)
    return picks


def busy_cpus(own: dict[str, float], nodes: list[ray_glue.NodeInfo]) -> dict[str, float]:
    """CPUs taken per node id when other jobs share the nodes: the larger of what this run's own tasks
    hold (`own`) and what Ray holds there (its resources less its available)."""
    busy = dict(own)
    for n in nodes:
        held = n.resources.get("CPU", n.cpus) - n.available.get("CPU", n.cpus)
        busy[n.node_id] = max(busy.get(n.node_id, 0.0), held)
    return busy
