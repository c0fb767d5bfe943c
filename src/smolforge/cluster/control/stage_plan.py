"""Which nodes run a model's stages: `plan_stages` chooses how many stages, the node for each and their
layer ranges from the nodes' measured throughput and free memory, counting the transfer over each cut,
and keeps the model on one node when splitting would not pay (`Plan.reason` says why); `plan_serving`
is the same choice for a served model (`serve --stages`), stages sharing nodes when asked for more.

Pure functions over `models.stage_costs` (a `ModelInfo`, each node's measured `NodeCapacity`, the cost
model): no Ray, no cluster; the serve job (`cluster.workloads.serve.stages`) probes the nodes and calls
them, and the node choices around it (`stage_candidates`, `probe_plan`, `stage_node`) are here too:
which nodes may run a stage, which are probed, where a stage lost goes again. The layer ranges for nodes already chosen (a pipeline rank's, inside its process) are
`models.stage_costs.plan_in_order`: below the cluster, since a rank imports no cluster code.
"""

from __future__ import annotations

from itertools import combinations, permutations
from typing import Mapping, Sequence

from smolforge.cluster.control.placement import (
    fewest_transfer_seconds, holds_anywhere, model_holders, model_travels,
)
from smolforge.cluster.nodes import ray_glue
from smolforge.errors import SmolforgeError
from smolforge.models.stage_costs import (
    Costs, Fit, ModelInfo, NodeCapacity, Plan, as_plan, fit_order, fmt_ms, fmt_rate, fmt_size, no_fit, plan_in_order,
    usable,
)
from smolforge.models.stage_memory import Workload

MAX_ORDERS = 64  # node orders tried per stage count: exhaustive up to 5 nodes, then the fastest subsets


def _orders(costs: Costs, nodes: Sequence[NodeCapacity], k: int) -> list[tuple[NodeCapacity, ...]]:
    """Ordered choices of k nodes: subsets with enough memory in all, fastest first; every pair of ends.

    The ends matter (they hold the embeddings and the head, often the biggest pieces): roomiest
    first when the list must be cut short. The middle goes fastest first, which only changes which
    links the cuts cross.
    """
    # A necessary condition only; split apart, a tied head is stored twice (once per end).
    need = costs.stage_bytes(0, costs.n, True, True) + costs.info.tied_bytes * costs.workload.headroom * (k > 1)
    subsets = [c for c in combinations(nodes, k) if sum(n.free_memory_bytes for n in c) >= need]
    subsets.sort(key=lambda c: -sum(n.throughput for n in c))
    orders: list[tuple[NodeCapacity, ...]] = []
    for subset in subsets:
        if k == 1:
            orders.append(subset)
        ends = sorted(permutations(subset, 2) if k > 1 else (),
                      key=lambda e: (-e[0].free_memory_bytes - e[1].free_memory_bytes, e[0].name, e[1].name))
        for first, last in ends:
            middle = sorted((n for n in subset if n is not first and n is not last),
                            key=lambda n: (-n.throughput, n.name))
            orders.append((first, *middle, last))
        if len(orders) >= MAX_ORDERS:
            break
    return orders[:MAX_ORDERS]


def _best(costs: Costs, nodes: Sequence[NodeCapacity], k: int, every_stage_works: bool = False) -> Fit | None:
    fits = [f for f in (fit_order(costs, order, every_stage_works) for order in _orders(costs, nodes, k)) if f is not None]
    return min(fits, key=lambda f: f.key) if fits else None


def plan_stages(info: ModelInfo, nodes: Sequence[NodeCapacity], stages: int | None = None, *,
                workload: Workload = Workload(), links: Mapping[tuple[str, str], float] | None = None,
                min_gain: float = 0.1) -> Plan:
    """Choose stage bounds and a node per stage from measured throughput and free memory.

    Per-token time of a stage = its FLOPs / its node's FLOP/s + sending its output over the cut
    (bytes / bandwidth + latency shared by a message's tokens). A plan's time is its slowest
    stage's when the pipeline is kept full (the default workload), and at least the sum over the
    stages divided by `workload.in_flight` when it is not. Ranges are sized to minimise that,
    within each node's memory: on a full pipeline, in proportion to throughput.

    With `stages` None: keep the model on the fastest node that holds it unless a split is faster
    by more than `min_gain` once the cuts' transfer time is counted (each further stage must gain
    that much again); if no node holds it alone, use the fewest stages that fit. `links` maps
    (node, node) to a measured bandwidth in bytes/s.
    """
    nodes = usable(nodes)
    costs = Costs(info, workload, links)
    if stages is not None:
        return _plan_fixed(costs, nodes, stages)
    single = _best(costs, nodes, 1)
    if single is None:
        return _plan_fewest(costs, nodes)
    split = _best_split(costs, nodes, single, min_gain)
    if split is not None:
        reason = (f"split into {len(split.order)} stages: est. {fmt_ms(split.per_token_s)}/token vs "
                  f"{fmt_ms(single.per_token_s)}/token on {single.order[0].name} alone")
        return as_plan(costs, split, reason)
    return as_plan(costs, single, _kept_reason(costs, nodes, single, min_gain), kept=True)


LOOPBACK_BYTES_PER_S = 1e9  # between two stages on one node (a per-message latency stays: the RPC's)


def plan_serving(info: ModelInfo, nodes: Sequence[NodeCapacity], stages: int | None = None) -> tuple[Plan, list[str]]:
    """Where the stages of a served model go, and the node each stage runs on (`Plan.nodes` may name
    slots, `node#2`, when stages share a node).

    `stages` None (`serve --stages auto`): the planner decides for one stream decoding. A batch walks
    the stages in turn, so a split pays only by reaching a faster node or by fitting at all: the
    model stays on one node when that is faster and it fits, and the reason says so. N stages on at
    least N nodes: one stage per node, ranges sized for a full pipeline (in proportion to each node's
    throughput, within its memory); the reason adds when one node would be faster. More stages than
    nodes: stages share nodes in turn, each with the node's speed and a share of its memory.
    """
    nodes = usable(nodes)
    if stages is None:
        auto = plan_stages(info, nodes, None, workload=Workload(in_flight=1))
        return auto, list(auto.nodes)
    if stages <= len(nodes):
        plan = plan_stages(info, nodes, stages)  # a count that does not fit is refused as that count
        auto = plan_stages(info, nodes, None, workload=Workload(in_flight=1)) if stages > 1 else None
        if auto is not None and auto.kept_on_one_node:
            plan.reason += f"; note: {auto.reason} (--stages auto keeps it there)"
        return plan, list(plan.nodes)
    shares = [len(range(j, stages, len(nodes))) for j in range(len(nodes))]
    slots, hosts = [], []
    for i in range(stages):
        node = nodes[i % len(nodes)]
        slots.append(NodeCapacity(f"{node.name}#{i // len(nodes) + 1}", node.throughput,
                                  node.free_memory_bytes // shares[i % len(nodes)],
                                  link_bytes_per_s=LOOPBACK_BYTES_PER_S, limit_bytes=node.limit_bytes))
        hosts.append(node.name)
    plan = plan_in_order(info, slots)
    plan.reason += f"; {stages} stages on {len(nodes)} node{'s' * (len(nodes) > 1)}: stages share nodes"
    return plan, hosts


def _plan_fixed(costs: Costs, nodes: list[NodeCapacity], stages: int) -> Plan:
    if not 1 <= stages <= len(nodes):
        raise SmolforgeError(f"cannot place {stages} stages on {len(nodes)} node(s): one stage per node",
                             fix=f"ask for 1 to {len(nodes)} stages, or add nodes")
    # each stage asked for holds a layer where that fits; else an end stage may hold none (embeddings only)
    fit = _best(costs, nodes, stages, every_stage_works=True) if stages <= costs.n else None
    fit = fit or _best(costs, nodes, stages)
    if fit is None:
        raise no_fit(costs, nodes, stages)
    return as_plan(costs, fit, f"{stages} stage{'s' if stages > 1 else ''} as asked: layers sized to each "
                             "node's throughput within its memory")


def _plan_fewest(costs: Costs, nodes: list[NodeCapacity]) -> Plan:
    whole = costs.stage_bytes(0, costs.n, True, True)
    roomiest = max(nodes, key=lambda n: n.free_memory_bytes)
    for k in range(2, len(nodes) + 1):
        fit = _best(costs, nodes, k)
        if fit is not None:
            return as_plan(costs, fit, f"no node holds it alone (it needs {fmt_size(whole)}; the most free is "
                                     f"{fmt_size(roomiest.free_memory_bytes)} on {roomiest.name}): {k} stages is "
                                     "the fewest that fit")
    raise no_fit(costs, nodes, None)


def _best_split(costs: Costs, nodes: list[NodeCapacity], single: Fit, min_gain: float) -> Fit | None:
    """The split to use instead of `single`, or None: more stages only when each pays `min_gain`."""
    chosen, bar = None, single.per_token_s
    for k in range(2, len(nodes) + 1):
        fit = _best(costs, nodes, k)
        if fit is None or fit.per_token_s > bar * (1 - min_gain):
            break
        chosen, bar = fit, fit.per_token_s
    return chosen


def _kept_reason(costs: Costs, nodes: list[NodeCapacity], single: Fit, min_gain: float) -> str:
    node = single.order[0]
    head = (f"kept on {node.name}: it fits ({fmt_size(costs.stage_bytes(0, costs.n, True, True))} of "
            f"{fmt_size(node.free_memory_bytes)} free)")
    alternative = _best(costs, nodes, 2) if len(nodes) > 1 else None
    if alternative is None:
        return head + (" and no split fits on the other nodes" if len(nodes) > 1 else " and it is the only node")
    rate, _ = costs.link(*alternative.order)
    verdict = ("splitting would be slower" if alternative.per_token_s >= single.per_token_s
               else f"splitting would gain under {min_gain:.0%}")
    return (f"{head} and {verdict} (est. {fmt_ms(single.per_token_s)}/token vs {fmt_ms(alternative.per_token_s)}/token "
            f"with 2 stages over {fmt_rate(rate)})")



# -- the nodes of a served model's stages (the serve job's `StageGroup` asks; node tables in, choices out) --

def holds_whole(model: str, node: ray_glue.NodeInfo, embedded: bool) -> bool:
    """Can `node` load the whole `model` itself: it advertises it, or every node can build or read it
    (`placement.holds_anywhere`)? A node that received only a stage's part does not."""
    return holds_anywhere(model, embedded) or ray_glue.model_resource(model) in node.resources


def stage_model_resources(model: str, node: ray_glue.NodeInfo, embedded: bool) -> dict[str, float] | None:
    """The model resource a stage's task or actor on `node` asks for: only where the node advertises
    the whole model (a preset or a part asks for none)."""
    if holds_anywhere(model, embedded) or not holds_whole(model, node, embedded):
        return None
    return {ray_glue.model_resource(model): ray_glue.MODEL_REQUEST}


def stage_candidates(model: str, nodes: list[ray_glue.NodeInfo], embedded: bool,
                     allowed: set[str] | None = None) -> list[ray_glue.NodeInfo]:
    """The live nodes (of the table `nodes`) that may run a stage of `model`: those that hold it, any
    node with CPUs when every node can build it, and, when the model travels (some node holds it:
    `placement.model_travels`), every live worker with CPUs; only `allowed` names (the job's
    `stage_nodes`) when given. Workers first, then the coordinator's own machine, by name.
    SmolforgeError, listing every node and why not, when none may."""
    anywhere = holds_anywhere(model, embedded)
    travels = model_travels(model, None, embedded, nodes)
    cands = [n for n in nodes if n.alive and (anywhere and n.cpus > 0 or model in n.models
                                              or travels and n.takes_work and n.cpus > 0)
             and (allowed is None or n.name in allowed)]
    if not cands:
        ray_glue.check_placeable(ray_glue.Requirements(  # raises, listing every node
            model=None if travels else model, allowed_nodes=sorted(allowed or []) or None), nodes)
        raise SmolforgeError(f"no live node holds {model}", fix="join a worker that holds the model")
    return sorted(cands, key=lambda n: (n.role in ("coordinator", "embedded"), n.name))


def with_room(nodes: list[ray_glue.NodeInfo], cpus: float) -> list[ray_glue.NodeInfo]:
    """The nodes with `cpus` free now; all of them when none has (a stage's actor then waits for room)."""
    return [n for n in nodes if n.available.get("CPU", n.cpus) >= cpus] or nodes


def probe_plan(model: str, cands: list[ray_glue.NodeInfo], every: list[ray_glue.NodeInfo], cpus: float,
               embedded: bool) -> tuple[list[ray_glue.NodeInfo], int, dict[str, str]]:
    """Which nodes the stage planner measures: (the nodes to probe, the index of the one that reads the
    model's sizes, a unique label per node id). The candidates with room (`with_room`) are probed, in
    order; the first of them that holds the whole model reads the sizes, else a holder of it among
    `cands`, then among `every` live node (the coordinator's first: `placement.model_holders`), probed
    last. A label is the node's name, with its id's head when two nodes share the name. StopIteration
    when no node holds the model to read its sizes from."""
    free = with_room(cands, cpus)
    twice = {n.name for n in free if [m.name for m in free].count(n.name) > 1}
    labels = {n.node_id: f"{n.name}-{n.node_id[:6]}" if n.name in twice else n.name for n in free}
    source = next((i for i, n in enumerate(free) if holds_whole(model, n, embedded)), None)
    if source is not None:
        return list(free), source, labels
    holder = next(iter([n for n in cands if holds_whole(model, n, embedded)] + model_holders(model, every)))
    labels.setdefault(holder.node_id, holder.name)
    return [*free, holder], len(free), labels


def stage_node(cands: list[ray_glue.NodeInfo], cpus: float, model: str, model_bytes: float,
               used: dict[str, int], planned: str | None = None) -> ray_glue.NodeInfo:
    """The node a stage (re)starts on: the node id the plan chose (`planned`) while it is a candidate;
    else, among the candidates with room (`with_room`), the one running the fewest of the model's
    other stages (`used`: node id -> count), a holder of the model before a node it must be sent to
    (its transfer's estimated seconds, `placement.fewest_transfer_seconds`), then in order."""
    chosen = next((n for n in cands if n.node_id == planned), None) if planned else None
    if chosen is not None:
        return chosen
    free = with_room(cands, cpus)
    order = fewest_transfer_seconds(free, model, model_bytes)
    return min(free, key=lambda n: (used.get(n.node_id, 0), order.index(n)))
