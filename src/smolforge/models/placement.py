"""Where the cuts go: `plan_stages` chooses the layer ranges of a model's stages (`models.partition`)
and the node for each, from the nodes' measured throughput and free memory, counting the transfer
over each cut, and keeps the model on one node when splitting would not pay (`Plan.reason` says why).
Pure arithmetic over a `ModelInfo` (bytes and FLOPs per layer, from a model or its config alone).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations, permutations
from typing import Mapping, Sequence

import torch
from torch import nn

from smolforge.errors import SmolforgeError
from smolforge.models.partition import arch_of, decoder_layers, final_norm
from smolforge.models.stage_memory import Workload

DEFAULT_LINK_BYTES_PER_S = 100e6 / 8  # 100 Mbit/s: home Wi-Fi or a busy LAN, when nothing was measured
DEFAULT_LINK_LATENCY_S = 1e-3


@dataclass(frozen=True)
class ModelInfo:
    """What placement needs to know about a model: bytes to hold and FLOPs per token. See `model_info`."""

    model_type: str
    layer_bytes: tuple[int, ...]
    layer_flops: tuple[float, ...]  # forward FLOPs per token of each layer (2 x its weights)
    embed_bytes: int                # token (+ position) embeddings: the first stage
    head_bytes: int                 # final norm + LM head: the last stage
    head_flops: float
    hidden_size: int
    dtype_bytes: int
    tied_bytes: int = 0             # head bytes shared with the embeddings: stored once when both are on one node
    kv_bytes_per_token: int = 0     # keys + values one layer caches per token

    @property
    def num_layers(self) -> int:
        return len(self.layer_bytes)

    @property
    def boundary_bytes_per_token(self) -> int:
        """What crosses a cut per token: one hidden state."""
        return self.hidden_size * self.dtype_bytes

    @property
    def total_bytes(self) -> int:
        return sum(self.layer_bytes) + self.embed_bytes + self.head_bytes - self.tied_bytes


@dataclass(frozen=True)
class NodeCapacity:
    """A node's capacity as the stage planner sees it: measured, not advertised. `throughput` is
    measured FLOP/s on this model's kind of work. (The node as Ray knows it, with its resources,
    labels and models, is `cluster.nodes.ray_glue.NodeInfo`: `models/` imports no Ray.)"""

    name: str
    throughput: float
    free_memory_bytes: int
    link_bytes_per_s: float | None = None  # its network link; a cut between two nodes runs at the slower
    link_latency_s: float | None = None
    limit_bytes: int | None = None  # its memory limit (`worker join --memory-limit`), when it has one


@dataclass
class Plan:
    """Where the cuts go and who runs what, with the per-token estimate that chose it."""

    bounds: list[int]
    nodes: list[str]
    stage_seconds: list[float]     # per token: the stage's compute plus sending its output on
    stage_bytes: list[int]         # memory each stage needs (weights x headroom + KV cache + activations)
    free_bytes: list[int]          # what its node has free
    throughput_share: list[float]  # its node's share of the plan's total throughput
    link_bytes_per_s: list[float]  # bandwidth of each cut (N-1 entries)
    per_token_s: float             # the estimate for the workload (see `Workload.in_flight`)
    reason: str
    kept_on_one_node: bool = False
    counted: str = ""  # what `stage_bytes` count, when more than weights x headroom (a training stage's activations)

    @property
    def num_stages(self) -> int:
        return len(self.nodes)

    def describe(self) -> str:
        lines = [f"plan: {self.num_stages} stage{'s' if self.num_stages > 1 else ''}, "
                 f"est. {_ms(self.per_token_s)}/token"]
        last = self.num_stages - 1
        for i, (lo, hi) in enumerate(zip(self.bounds, self.bounds[1:])):
            what = [f"layers {lo}-{hi - 1}" if hi > lo else "no layers"]
            what += ["embeddings"] * (i == 0) + ["head"] * (i == last)
            link = f", then {_rate(self.link_bytes_per_s[i])} to stage {i + 1}" if i < last else ""
            lines.append(f"  stage {i}: {' + '.join(what)} on {self.nodes[i]} ({_size(self.free_bytes[i])} free, "
                         f"needs {_size(self.stage_bytes[i])}, {self.throughput_share[i]:.0%} of throughput), "
                         f"est. {_ms(self.stage_seconds[i])}/token{link}")
        lines.append(f"  {self.reason}")
        lines += [f"  a stage needs {self.counted}"] * bool(self.counted)
        return "\n".join(lines)


def model_info(source, dtype: torch.dtype | None = None) -> ModelInfo:
    """Sizes and costs of a loaded model, or of an HF config (built on the meta device: no memory used).

    `dtype` is the dtype the stages will hold (default: the model's, or the config's, or fp32).
    FLOPs count the matmuls (2 per weight per token), not attention over the context.
    """
    model = source if isinstance(source, nn.Module) else _meta_model(source)
    arch = arch_of(model.config)
    nbytes = _dtype_bytes(model, dtype)
    layers = decoder_layers(model)
    embed = model.get_input_embeddings()
    embeds = [embed, *arch.family.position_parameters(model)]
    lm_head = model.get_output_embeddings()
    layer_params = [_numel(layer) for layer in layers]
    head_params = _numel(final_norm(model)) + _numel(lm_head)
    tied = lm_head.weight is embed.weight
    cfg = model.config
    heads = int(getattr(cfg, "num_attention_heads", 0) or cfg.n_head)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or arch.hidden_size // heads)
    return ModelInfo(
        model_type=arch.model_type,
        layer_bytes=tuple(p * nbytes for p in layer_params),
        layer_flops=tuple(2.0 * p for p in layer_params),
        embed_bytes=sum(_numel(m) for m in embeds) * nbytes,
        head_bytes=head_params * nbytes,
        head_flops=2.0 * lm_head.weight.numel(),
        hidden_size=arch.hidden_size,
        dtype_bytes=nbytes,
        tied_bytes=lm_head.weight.numel() * nbytes if tied else 0,
        kv_bytes_per_token=2 * kv_heads * head_dim * nbytes,
    )


def _meta_model(config):
    from transformers import AutoModelForCausalLM

    arch_of(config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _dtype_bytes(model, dtype: torch.dtype | None) -> int:
    if dtype is None and model.device.type == "meta":
        dtype = getattr(model.config, "dtype", None)
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if dtype is None:
        dtype = next(model.parameters()).dtype
    return torch.empty((), dtype=dtype).element_size()


class _Costs:
    """Per-token time and memory of a candidate stage, from prefix sums over the layers."""

    def __init__(self, info: ModelInfo, workload: Workload, links: Mapping[tuple[str, str], float] | None):
        self.info, self.workload, self.links = info, workload, dict(links or {})
        self.n = info.num_layers
        self.bytes_upto = _prefix(info.layer_bytes)
        self.flops_upto = _prefix(info.layer_flops)
        self.compute_mult = 3.0 if workload.training else 1.0
        self.transfer_mult = 2.0 if workload.training else 1.0
        self.kv_per_layer = workload.kv_tokens * info.kv_bytes_per_token

    def end_bytes(self, first: bool, last: bool) -> float:
        """The embeddings on the first stage, the head on the last; a tied pair once when both are one stage."""
        info = self.info
        return info.embed_bytes * first + info.head_bytes * last - info.tied_bytes * (first and last)

    def stage_bytes(self, lo: int, hi: int, first: bool, last: bool, j: int = 0, k: int = 1) -> float:
        """Stage j of k (default: the only one, which makes a lower bound for a piece of a longer pipeline)."""
        weights = self.bytes_upto[hi] - self.bytes_upto[lo] + self.end_bytes(first, last)
        return (weights * self.workload.headroom + self.kv_per_layer * (hi - lo)
                + self.workload.activation_bytes(hi - lo, last, j, k))

    def seconds_per_flop(self, node: NodeCapacity) -> float:
        return self.compute_mult / node.throughput

    def compute_s(self, node: NodeCapacity, lo: int, hi: int, last: bool) -> float:
        flops = self.flops_upto[hi] - self.flops_upto[lo] + self.info.head_flops * last
        return flops * self.seconds_per_flop(node)

    def link(self, a: NodeCapacity, b: NodeCapacity) -> tuple[float, float]:
        """(bytes/s, latency s) of the cut a -> b: a measured pair, else the slower of the two links."""
        measured = self.links.get((a.name, b.name)) or self.links.get((b.name, a.name))
        rates = [n.link_bytes_per_s or DEFAULT_LINK_BYTES_PER_S for n in (a, b)]
        latency = max(n.link_latency_s if n.link_latency_s is not None else DEFAULT_LINK_LATENCY_S for n in (a, b))
        return (measured or min(rates)), latency

    def per_token_s(self, stage_seconds: Sequence[float]) -> float:
        return self.workload.per_token_s(stage_seconds)

    def send_s(self, a: NodeCapacity, b: NodeCapacity) -> float:
        """Per token: the hidden state's bytes, plus the latency shared by the tokens of one message."""
        rate, latency = self.link(a, b)
        per_token = self.info.boundary_bytes_per_token / rate + latency / max(1, self.workload.tokens_per_message)
        return per_token * self.transfer_mult


def _prefix(values: Sequence[float]) -> list[float]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


@dataclass
class _Fit:
    """Bounds for one ordered choice of nodes, with their per-token estimate."""

    order: tuple[NodeCapacity, ...]
    bounds: list[int]
    seconds: list[float]
    per_token_s: float

    @property
    def key(self) -> tuple[float, float]:
        return self.per_token_s, sum(self.seconds)


def _stage_s(costs: _Costs, order: tuple[NodeCapacity, ...], j: int, lo: int, hi: int) -> float:
    """Stage j's per-token time on order[j]: its compute plus sending its output to stage j+1."""
    last = j == len(order) - 1
    send = 0.0 if last else costs.send_s(order[j], order[j + 1])
    return costs.compute_s(order[j], lo, hi, last) + send


def _fit(costs: _Costs, order: tuple[NodeCapacity, ...], every_stage_works: bool = False) -> _Fit | None:
    """The best contiguous layer ranges for stages on `order` (one per node), or None if none fit.
    `every_stage_works`: each stage holds at least one layer (stages a user asked for by number).

    A full pipeline is as fast as its slowest stage, so the ranges minimise that: a 2x faster node
    takes about 2x the layers. With few sequences in flight the total counts too, so the ranges
    that minimise the total (the fast node takes all it can hold) compete, and the better wins.
    """
    bounds = [_ranges(costs, order, False, every_stage_works)]
    if costs.workload.in_flight is not None:
        bounds.append(_ranges(costs, order, True, every_stage_works))
    fits = []
    for b in filter(None, bounds):
        seconds = [_stage_s(costs, order, j, lo, hi) for j, (lo, hi) in enumerate(zip(b, b[1:]))]
        fits.append(_Fit(order=order, bounds=b, seconds=seconds, per_token_s=costs.per_token_s(seconds)))
    return min(fits, key=lambda f: f.key) if fits else None


def _ranges(costs: _Costs, order: tuple[NodeCapacity, ...], by_total: bool,
            every_stage_works: bool = False) -> list[int] | None:
    """DP over (stage, end layer), O(stages x layers^2): minimise (slowest, total), or (total, slowest).

    Memory rules out the ranges a node cannot hold; only the end stages may hold no layers (an
    embeddings-only first stage can be what lets a big vocabulary fit), and none may when
    `every_stage_works`: a user who asks for two stages on two nodes means both to compute.
    """
    n, k = costs.n, len(order)
    bytes_upto, flops_upto = costs.bytes_upto, costs.flops_upto
    work = costs.workload
    headroom = work.headroom
    worst = (math.inf, math.inf)
    best = [[worst] * (n + 1) for _ in range(k)]
    start = [[-1] * (n + 1) for _ in range(k)]
    for j, node in enumerate(order):
        # The stage's bytes and seconds as `stage_bytes` and `_stage_s` compute them, inlined: this loop is hot.
        first, last = j == 0, j == k - 1
        end_bytes, head_flops = costs.end_bytes(first, last), costs.info.head_flops * last
        per_flop, cap = costs.seconds_per_flop(node), node.free_memory_bytes
        # per layer: KV cache (serving) or activations (training, as many micro-batches as this stage holds)
        per_layer = costs.kv_per_layer + work.layer_bytes(j, k)
        fixed = work.activation_bytes(0, last, j, k)
        send = 0.0 if last else costs.send_s(node, order[j + 1])
        for hi in ([n] if last else range(n + 1)):
            for lo in ([0] if first else range(hi, -1, -1)):  # downwards: once memory overflows it stays so
                if (bytes_upto[hi] - bytes_upto[lo] + end_bytes) * headroom + per_layer * (hi - lo) + fixed > cap:
                    break
                prev = (0.0, 0.0) if first else best[j - 1][lo]
                if prev[0] == math.inf or (lo == hi and (every_stage_works or not (first or last))):
                    continue
                t = (flops_upto[hi] - flops_upto[lo] + head_flops) * per_flop + send
                cand = (prev[0] + t, max(prev[1], t)) if by_total else (max(prev[0], t), prev[1] + t)
                if cand < best[j][hi]:
                    best[j][hi], start[j][hi] = cand, lo
    if best[k - 1][n][0] == math.inf:
        return None
    bounds, hi = [n], n
    for j in range(k - 1, -1, -1):
        hi = start[j][hi]
        bounds.append(hi)
    return bounds[::-1]


MAX_ORDERS = 64  # node orders tried per stage count: exhaustive up to 5 nodes, then the fastest subsets


def _orders(costs: _Costs, nodes: Sequence[NodeCapacity], k: int) -> list[tuple[NodeCapacity, ...]]:
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


def _best(costs: _Costs, nodes: Sequence[NodeCapacity], k: int, every_stage_works: bool = False) -> _Fit | None:
    fits = [f for f in (_fit(costs, order, every_stage_works) for order in _orders(costs, nodes, k)) if f is not None]
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
    nodes = _usable(nodes)
    costs = _Costs(info, workload, links)
    if stages is not None:
        return _plan_fixed(costs, nodes, stages)
    single = _best(costs, nodes, 1)
    if single is None:
        return _plan_fewest(costs, nodes)
    split = _best_split(costs, nodes, single, min_gain)
    if split is not None:
        reason = (f"split into {len(split.order)} stages: est. {_ms(split.per_token_s)}/token vs "
                  f"{_ms(single.per_token_s)}/token on {single.order[0].name} alone")
        return _plan(costs, split, reason)
    return _plan(costs, single, _kept_reason(costs, nodes, single, min_gain), kept=True)


def plan_in_order(info: ModelInfo, nodes: Sequence[NodeCapacity], *, workload: Workload = Workload(),
                  links: Mapping[tuple[str, str], float] | None = None) -> Plan:
    """Layer ranges for stages already placed: stage i runs on `nodes[i]` (a data-parallel group's
    ranks, in rank order). Only the ranges are chosen, as `plan_stages` sizes them: in proportion to
    each node's measured throughput, within its free memory."""
    nodes = _usable(nodes)
    costs = _Costs(info, workload, links)
    fit = _fit(costs, tuple(nodes))
    if fit is None:
        raise _no_fit(costs, list(nodes), len(nodes))
    return _plan(costs, fit, f"{len(nodes)} stage{'s' if len(nodes) > 1 else ''} on the nodes as placed: layers "
                             "sized to each node's measured throughput within its free memory")


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
    nodes = _usable(nodes)
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


def measure_node(name: str, device: torch.device | None = None, size: int = 512, seconds: float = 0.2) -> NodeCapacity:
    """This process's node as placement sees it: FLOP/s of fp32 matmuls on `device` with this
    process's threads (a short timed loop, after a warm-up), and the memory free there now (the
    device's on a GPU, the machine's available RAM on a CPU, within the node's memory limit and cgroup:
    `telemetry.memory.memory_room_bytes`)."""
    import time

    import psutil

    from smolforge.telemetry.memory import memory_limit_bytes, memory_room_bytes

    device = device or torch.device("cpu")
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.mm(a, b)
    sync()
    done, t0 = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        done += 1
        if done % 4 == 0:
            sync()
            if time.perf_counter() - t0 >= seconds:
                break
    flops = 2 * size ** 3 * done / (time.perf_counter() - t0)
    if device.type == "cuda":
        return NodeCapacity(name, throughput=flops, free_memory_bytes=int(torch.cuda.mem_get_info(device)[0]))
    return NodeCapacity(name, throughput=flops, free_memory_bytes=memory_room_bytes(psutil.virtual_memory().available),
                        limit_bytes=memory_limit_bytes())


def _usable(nodes: Sequence[NodeCapacity]) -> list[NodeCapacity]:
    usable = [n for n in nodes if n.throughput > 0 and n.free_memory_bytes > 0]
    if not usable:
        raise SmolforgeError("no node to place the model on: none reports throughput and free memory",
                             fix="join a worker (`smolforge worker join`) and let it report its resources")
    if len({n.name for n in usable}) != len(usable):
        raise SmolforgeError("two nodes share a name", fix="give every node a unique name (--name)")
    return usable


def _plan_fixed(costs: _Costs, nodes: list[NodeCapacity], stages: int) -> Plan:
    if not 1 <= stages <= len(nodes):
        raise SmolforgeError(f"cannot place {stages} stages on {len(nodes)} node(s): one stage per node",
                             fix=f"ask for 1 to {len(nodes)} stages, or add nodes")
    # each stage asked for holds a layer where that fits; else an end stage may hold none (embeddings only)
    fit = _best(costs, nodes, stages, every_stage_works=True) if stages <= costs.n else None
    fit = fit or _best(costs, nodes, stages)
    if fit is None:
        raise _no_fit(costs, nodes, stages)
    return _plan(costs, fit, f"{stages} stage{'s' if stages > 1 else ''} as asked: layers sized to each "
                             "node's throughput within its memory")


def _plan_fewest(costs: _Costs, nodes: list[NodeCapacity]) -> Plan:
    whole = costs.stage_bytes(0, costs.n, True, True)
    roomiest = max(nodes, key=lambda n: n.free_memory_bytes)
    for k in range(2, len(nodes) + 1):
        fit = _best(costs, nodes, k)
        if fit is not None:
            return _plan(costs, fit, f"no node holds it alone (it needs {_size(whole)}; the most free is "
                                     f"{_size(roomiest.free_memory_bytes)} on {roomiest.name}): {k} stages is "
                                     "the fewest that fit")
    raise _no_fit(costs, nodes, None)


def _best_split(costs: _Costs, nodes: list[NodeCapacity], single: _Fit, min_gain: float) -> _Fit | None:
    """The split to use instead of `single`, or None: more stages only when each pays `min_gain`."""
    chosen, bar = None, single.per_token_s
    for k in range(2, len(nodes) + 1):
        fit = _best(costs, nodes, k)
        if fit is None or fit.per_token_s > bar * (1 - min_gain):
            break
        chosen, bar = fit, fit.per_token_s
    return chosen


def _kept_reason(costs: _Costs, nodes: list[NodeCapacity], single: _Fit, min_gain: float) -> str:
    node = single.order[0]
    head = (f"kept on {node.name}: it fits ({_size(costs.stage_bytes(0, costs.n, True, True))} of "
            f"{_size(node.free_memory_bytes)} free)")
    alternative = _best(costs, nodes, 2) if len(nodes) > 1 else None
    if alternative is None:
        return head + (" and no split fits on the other nodes" if len(nodes) > 1 else " and it is the only node")
    rate, _ = costs.link(*alternative.order)
    verdict = ("splitting would be slower" if alternative.per_token_s >= single.per_token_s
               else f"splitting would gain under {min_gain:.0%}")
    return (f"{head} and {verdict} (est. {_ms(single.per_token_s)}/token vs {_ms(alternative.per_token_s)}/token "
            f"with 2 stages over {_rate(rate)})")


def _plan(costs: _Costs, fit: _Fit, reason: str, kept: bool = False) -> Plan:
    order, k = fit.order, len(fit.order)
    total = sum(n.throughput for n in order)
    spans = list(zip(fit.bounds, fit.bounds[1:]))
    return Plan(
        bounds=list(fit.bounds),
        nodes=[n.name for n in order],
        stage_seconds=list(fit.seconds),
        stage_bytes=[int(costs.stage_bytes(lo, hi, i == 0, i == k - 1, i, k)) for i, (lo, hi) in enumerate(spans)],
        free_bytes=[n.free_memory_bytes for n in order],
        throughput_share=[n.throughput / total for n in order],
        link_bytes_per_s=[costs.link(a, b)[0] for a, b in zip(order, order[1:])],
        per_token_s=fit.per_token_s,
        reason=reason,
        kept_on_one_node=kept,
        counted=costs.workload.counted if costs.workload.activation_bytes(1, True) else "",
    )


def _no_fit(costs: _Costs, nodes: list[NodeCapacity], stages: int | None) -> SmolforgeError:
    """How much memory is missing: in all, on one node for the biggest piece, or why the layers do not pack."""
    split = (stages or len(nodes)) > 1
    need = costs.stage_bytes(0, costs.n, True, True) + costs.info.tied_bytes * costs.workload.headroom * split
    free = sum(n.free_memory_bytes for n in nodes)
    roomiest = max(n.free_memory_bytes for n in nodes)
    n = costs.n
    pieces = {"the embeddings": costs.stage_bytes(0, 0, True, False), "the head": costs.stage_bytes(n, n, False, True),
              "the largest layer": max(costs.stage_bytes(i, i + 1, False, False) for i in range(n))}
    piece_name, piece = max(pieces.items(), key=lambda kv: kv[1])
    where = f"in {stages} stage{'s' if stages > 1 else ''}" if stages else f"split across all {len(nodes)} node(s)"
    what = f"the model does not fit {where}: "
    if stages == 1:  # one node must hold it all: the roomiest is the one to compare with
        best = max(nodes, key=lambda node: node.free_memory_bytes)
        what += (f"it needs {_size(need)} ({costs.workload.counted}), the most free on one node is "
                 f"{_size(best.free_memory_bytes)} on {best.name}: {_size(need - best.free_memory_bytes)} missing")
    elif free < need:
        what += (f"it needs {_size(need)} ({costs.workload.counted}), the nodes have {_size(free)} free: "
                 f"{_size(need - free)} missing")
    elif piece > roomiest:
        what += (f"{piece_name} alone need {_size(piece)}, the most free on one node is {_size(roomiest)}: "
                 f"{_size(piece - roomiest)} missing there")
    else:
        what += (f"the nodes have {_size(free)} free of the {_size(need)} it needs, but whole layers do not "
                 "pack into what each node has free")
    what += _caps(costs, nodes)
    halve = ", load the model in bf16 (half the bytes of fp32)" if costs.info.dtype_bytes >= 4 else ""
    fix = f"free memory on the nodes or join another (`smolforge worker join`){halve}, or choose a smaller model"
    return SmolforgeError(what, fix=fix + ("; or allow more stages" if stages else ""))


def _caps(costs: _Costs, nodes: list[NodeCapacity]) -> str:
    """The nodes' memory limits, when some have one: the reason a capped node refuses what the machine could hold."""
    capped = [n for n in nodes if n.limit_bytes]
    if not capped:
        return ""
    each = ", ".join(f"{n.name} {_size(n.limit_bytes)} ({_size(n.free_memory_bytes)} free for a stage)" for n in capped)
    return (f"; the model's weights are {_size(costs.info.total_bytes)} in {costs.info.dtype_bytes * 8}-bit, and "
            f"the memory limit (worker join --memory-limit) is {each}")


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _rate(bytes_per_s: float) -> str:
    bits = bytes_per_s * 8
    return f"{bits / 1e9:.3g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:.3g} Mbit/s"
