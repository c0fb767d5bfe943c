"""What a stage costs, and where the cuts go among nodes already chosen: a `ModelInfo` (bytes and FLOPs
per layer, from a model or its config alone), a node's measured `NodeCapacity` (`measure_node`), the
per-token cost model (`Costs`: compute, the transfer over each cut, memory within each node) and
`plan_in_order`, the layer ranges for stages whose nodes are given (a pipeline's ranks, in rank order).
Pure arithmetic, below the cluster: a pipeline rank sizes its stage with it inside its own process.

Which node runs a stage is the cluster's decision (`cluster.control.stage_plan`: `plan_stages`,
`plan_serving`), over these costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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
                 f"est. {fmt_ms(self.per_token_s)}/token"]
        last = self.num_stages - 1
        for i, (lo, hi) in enumerate(zip(self.bounds, self.bounds[1:])):
            what = [f"layers {lo}-{hi - 1}" if hi > lo else "no layers"]
            what += ["embeddings"] * (i == 0) + ["head"] * (i == last)
            link = f", then {fmt_rate(self.link_bytes_per_s[i])} to stage {i + 1}" if i < last else ""
            lines.append(f"  stage {i}: {' + '.join(what)} on {self.nodes[i]} ({fmt_size(self.free_bytes[i])} free, "
                         f"needs {fmt_size(self.stage_bytes[i])}, {self.throughput_share[i]:.0%} of throughput), "
                         f"est. {fmt_ms(self.stage_seconds[i])}/token{link}")
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


class Costs:
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
class Fit:
    """Bounds for one ordered choice of nodes, with their per-token estimate."""

    order: tuple[NodeCapacity, ...]
    bounds: list[int]
    seconds: list[float]
    per_token_s: float

    @property
    def key(self) -> tuple[float, float]:
        return self.per_token_s, sum(self.seconds)


def _stage_s(costs: Costs, order: tuple[NodeCapacity, ...], j: int, lo: int, hi: int) -> float:
    """Stage j's per-token time on order[j]: its compute plus sending its output to stage j+1."""
    last = j == len(order) - 1
    send = 0.0 if last else costs.send_s(order[j], order[j + 1])
    return costs.compute_s(order[j], lo, hi, last) + send


def fit_order(costs: Costs, order: tuple[NodeCapacity, ...], every_stage_works: bool = False) -> Fit | None:
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
        fits.append(Fit(order=order, bounds=b, seconds=seconds, per_token_s=costs.per_token_s(seconds)))
    return min(fits, key=lambda f: f.key) if fits else None


def _ranges(costs: Costs, order: tuple[NodeCapacity, ...], by_total: bool,
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


def plan_in_order(info: ModelInfo, nodes: Sequence[NodeCapacity], *, workload: Workload = Workload(),
                  links: Mapping[tuple[str, str], float] | None = None) -> Plan:
    """Layer ranges for stages already placed: stage i runs on `nodes[i]` (a data-parallel group's
    ranks, in rank order). Only the ranges are chosen, as
    `cluster.control.stage_plan.plan_stages` sizes them: in proportion to
    each node's measured throughput, within its free memory."""
    nodes = usable(nodes)
    costs = Costs(info, workload, links)
    fit = fit_order(costs, tuple(nodes))
    if fit is None:
        raise no_fit(costs, list(nodes), len(nodes))
    return as_plan(costs, fit, f"{len(nodes)} stage{'s' if len(nodes) > 1 else ''} on the nodes as placed: layers "
                             "sized to each node's measured throughput within its free memory")


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


def usable(nodes: Sequence[NodeCapacity]) -> list[NodeCapacity]:
    """The nodes that report throughput and free memory; SmolforgeError when none does or two share a name."""
    usable = [n for n in nodes if n.throughput > 0 and n.free_memory_bytes > 0]
    if not usable:
        raise SmolforgeError("no node to place the model on: none reports throughput and free memory",
                             fix="join a worker (`smolforge worker join`) and let it report its resources")
    if len({n.name for n in usable}) != len(usable):
        raise SmolforgeError("two nodes share a name", fix="give every node a unique name (--name)")
    return usable


def as_plan(costs: Costs, fit: Fit, reason: str, kept: bool = False) -> Plan:
    """The `Plan` of a fit: its bounds, nodes, per-stage seconds and bytes, with `reason`."""
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


def no_fit(costs: Costs, nodes: list[NodeCapacity], stages: int | None) -> SmolforgeError:
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
        what += (f"it needs {fmt_size(need)} ({costs.workload.counted}), the most free on one node is "
                 f"{fmt_size(best.free_memory_bytes)} on {best.name}: {fmt_size(need - best.free_memory_bytes)} missing")
    elif free < need:
        what += (f"it needs {fmt_size(need)} ({costs.workload.counted}), the nodes have {fmt_size(free)} free: "
                 f"{fmt_size(need - free)} missing")
    elif piece > roomiest:
        what += (f"{piece_name} alone need {fmt_size(piece)}, the most free on one node is {fmt_size(roomiest)}: "
                 f"{fmt_size(piece - roomiest)} missing there")
    else:
        what += (f"the nodes have {fmt_size(free)} free of the {fmt_size(need)} it needs, but whole layers do not "
                 "pack into what each node has free")
    what += _caps(costs, nodes)
    halve = ", load the model in bf16 (half the bytes of fp32)" if costs.info.dtype_bytes >= 4 else ""
    fix = f"free memory on the nodes or join another (`smolforge worker join`){halve}, or choose a smaller model"
    return SmolforgeError(what, fix=fix + ("; or allow more stages" if stages else ""))


def _caps(costs: Costs, nodes: list[NodeCapacity]) -> str:
    """The nodes' memory limits, when some have one: the reason a capped node refuses what the machine could hold."""
    capped = [n for n in nodes if n.limit_bytes]
    if not capped:
        return ""
    each = ", ".join(f"{n.name} {fmt_size(n.limit_bytes)} ({fmt_size(n.free_memory_bytes)} free for a stage)" for n in capped)
    return (f"; the model's weights are {fmt_size(costs.info.total_bytes)} in {costs.info.dtype_bytes * 8}-bit, and "
            f"the memory limit (worker join --memory-limit) is {each}")


def fmt_size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def fmt_rate(bytes_per_s: float) -> str:
    bits = bytes_per_s * 8
    return f"{bits / 1e9:.3g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:.3g} Mbit/s"
