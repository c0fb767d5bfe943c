"""The job queue's decisions: which waiting jobs start now, and why the others wait.

Pure functions over the node table (no Ray calls), so the manager's scheduler stays a thin loop
and the rules are tested without a cluster. A job kind says what it needs through its registry
entry (`JobKind.demand`: spec -> `Demand`, N tasks of one `Requirements`); nothing here knows kinds.

Order: priority (high, normal, low), then submission time (FIFO within a priority).

Backfill, decided: a later job may start while an earlier one waits, but only on what the earlier
one cannot use. Each waiting job, in order, *holds* the free slots it could take (up to its ask),
so slots freed by finishing jobs pile up for the head of the queue until it fits: a big
high-priority job is never starved by a stream of small ones. What it cannot use (nodes without
its model, outside its allowed nodes, short of its RAM, or slots beyond its ask) stays open to the
jobs behind it, so the cluster is not left idle either. We do not know how long jobs run, so the
classic "backfill if it ends before the head job could start" has nothing to stand on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from smolforge.cluster.control.placement import per_task, slots
from smolforge.cluster.nodes.ray_glue import NodeInfo, Requirements
from smolforge.cluster.control.specs import PRIORITIES

Free = dict[str, dict[str, float]]  # node_id -> resources still free (Ray's available, less what is claimed)


@dataclass(frozen=True)
class Demand:
    """What a job holds while it runs: `tasks` tasks, each needing `req` on some node."""

    tasks: int
    req: Requirements
    noun: str = "worker"  # how messages name a task: "2 workers", "3 stages"

    def describe(self) -> str:
        parts = [f"{self.req.cpus:g} CPU{'s' if self.req.cpus != 1 else ''}"]
        if self.req.reserve_ram_gb:
            parts.append(f"{self.req.reserve_ram_gb:g} GB RAM")
        if self.req.gpu == "required":
            parts.append(f"{self.req.gpus:g} GPU{'s' if self.req.gpus != 1 else ''}")
        return f"{self.tasks} {self.noun}{'s' if self.tasks != 1 else ''} with {', '.join(parts)}"


@dataclass
class Waiting:
    job_id: str
    priority: str
    created: float
    demand: Demand


@dataclass
class Decision:
    start: list[str] = field(default_factory=list)  # job ids to start now, in queue order
    claims: dict[str, Free] = field(default_factory=dict)  # job id -> what it takes where (until placed)
    reasons: dict[str, str] = field(default_factory=dict)  # job id -> why it waits


def order(jobs: list[Waiting]) -> list[Waiting]:
    """High before normal before low; within one priority, first submitted first."""
    rank = {p: i for i, p in enumerate(PRIORITIES)}
    return sorted(jobs, key=lambda w: (rank.get(w.priority, len(PRIORITIES)), w.created, w.job_id))


def free_now(nodes: list[NodeInfo], claims: dict[str, Free]) -> Free:
    """Ray's available resources per node, less what admitted jobs that are not placed yet will take."""
    free = {n.node_id: dict(n.available) for n in nodes}
    for claim in claims.values():
        _take(free, claim)
    return free


def _take(free: Free, what: Free) -> None:
    for node_id, res in what.items():
        have = free.setdefault(node_id, {})
        for k, v in res.items():
            have[k] = have.get(k, 0.0) - v


def allocate(demand: Demand, nodes: list[NodeInfo], free: Free) -> tuple[int, Free]:
    """Up to `demand.tasks` tasks on the candidate nodes' free resources, most free node first:
    (tasks placed, what they take per node)."""
    placed, taken = 0, {}
    cands = sorted(demand.req.candidates(nodes), key=lambda n: -slots(demand.req, n, free.get(n.node_id, {})))
    for node in cands:
        k = min(demand.tasks - placed, slots(demand.req, node, free.get(node.node_id, {})))
        if k <= 0:
            continue
        need = per_task(demand.req, node)
        taken[node.node_id] = {r: v * k for r, v in need.items()}
        placed += k
        if placed == demand.tasks:
            break
    return placed, taken


def decide(waiting: list[Waiting], nodes: list[NodeInfo], claims: dict[str, Free],
           busy: dict[str, list[str]]) -> Decision:
    """Which waiting jobs start now (see the module docstring for the rules) and why the others wait.

    `claims`: admitted jobs not yet placed (their resources are not in Ray's table yet);
    `busy`: node name -> ids of the running jobs with tasks there (for the reasons).
    """
    free = free_now(nodes, claims)
    held: dict[str, str] = {}  # node_id -> the waiting job holding slots on it
    out = Decision()
    for w in order(waiting):
        placed, taken = allocate(w.demand, nodes, free)
        _take(free, taken)
        if placed == w.demand.tasks:
            out.start.append(w.job_id)
            out.claims[w.job_id] = taken
            continue
        for node_id in taken:
            held.setdefault(node_id, w.job_id)
        out.reasons[w.job_id] = reason(w, nodes, free, {**claims, **out.claims}, busy, held)
    return out


def reason(w: Waiting, nodes: list[NodeInfo], free: Free, claims: dict[str, Free], busy: dict[str, list[str]],
           held: dict[str, str]) -> str:
    """'waiting for 2 workers with 1 CPU: w1 busy with job-ab12, w2 busy with job-cd34'."""
    why = []
    cands = w.demand.req.candidates(nodes)
    if not cands:
        return (f"waiting for {w.demand.describe()}: no live node can run it now (it waits for one to join; "
                "`smolforge nodes` lists them)")
    for node in cands:
        if slots(w.demand.req, node, free.get(node.node_id, {})) > 0 or held.get(node.node_id) == w.job_id:
            continue  # room here, or the room it holds: not what it waits for
        short = _short_of(w.demand.req, node, free.get(node.node_id, {}))
        if held.get(node.node_id):
            why.append(f"{node.name} held for {held[node.node_id]} (ahead in the queue)")
        elif busy.get(node.name):
            # what it is short of, where that is not the obvious (a node with CPUs free but its RAM reserved)
            extra = f" ({short})" if short and not short.endswith("CPUs free") else ""
            why.append(f"{node.name} busy with {', '.join(sorted(set(busy[node.name])))}{extra}")
        elif any(node.node_id in c for c in claims.values()):
            starting = sorted(j for j, c in claims.items() if node.node_id in c)
            why.append(f"{node.name} taken by {', '.join(starting)} (starting)")
        else:
            why.append(f"{node.name} has {short}" if short else f"{node.name} is busy")
    return f"waiting for {w.demand.describe()}" + (": " + ", ".join(why) if why else "")


def _short_of(req: Requirements, node: NodeInfo, free: dict[str, float]) -> str:
    need = per_task(req, node)
    for key, label, scale in (("memory", "GB RAM", 1e9), ("CPU", "CPUs", 1.0), ("GPU", "GPUs", 1.0)):
        if key in need and free.get(key, 0.0) + 1e-6 < need[key]:
            return f"{max(0.0, free.get(key, 0.0)) / scale:g} {label} free"
    return ""
