"""`--strategy auto`'s decision: which data-parallel strategy, codec and sync interval fit the measured
links and step time. A pure function (no I/O, no torch): the ranks measure (`parallel/auto_probe.py`),
every rank calls `decide` on the same gathered numbers and so reaches the same plan.

The rule (issue 45, item 4): communication stays under `budget` (10 %) of compute.

- **ddp** when its per-step all-reduce fits: a ring all-reduce sends 2(n-1)/n of the gradient's bytes per
  rank over the slowest link, plus 2(n-1) round trips, and that must be ≤ budget × one step's compute.
- else **diloco**, H (`inner_steps`) chosen so that one sync's transfer (an all-gather: each node sends its
  part to the n-1 others) and its CPU work (`Measured.sync_cpu_s`: on a CPU node a sync of llama-100m through
  int8 is ~10 s of one core against 0.9 s on a 1 Gbit/s link, BENCHMARKS.md scale-out 2026-11-30) are
  ≤ budget × H steps' compute, with the codec the run's length allows:
  - the **sparse** codec (SparseLoCo: per-chunk top-k, low-bit values, uint16 indices, one fp32 scale per
    chunk) when the run has at least `SPARSE_MIN_ROUNDS` outer rounds at sparse's H (max_steps ÷ H; a run
    of unknown length counts as long): each round sends 1.6 % of the pseudo-gradient and the rest waits in
    the error-feedback buffer, which needs rounds to catch up;
  - else a **dense** codec (every value, with error feedback) at the H its own, 14-28× larger, sync needs:
    **int4** (half a byte per value) where that halving buys a shorter H, or less waiting when the run
    caps both (a slow link, where the transfer dominates), else **int8** (a byte per value, the less
    lossy; a fast link, where the CPU work dominates and int4's packing costs more of it). When even
    that passes what the run allows (two syncs), the dense codec all the same with H capped and its syncs
    waiting, said so: a sparse plan within budget that cannot learn in the run never reaches the loss it
    is run for (BENCHMARKS.md, scale-out: 4 rounds of sparse at 20 Mbit/s ended at held-out 5.7-6.5 where
    int8 reached 3.36).
  - the dense codec whenever this build's diloco lacks `sparse` (int8 where it lacks `int4` too).
- **streaming fragments** (`fragments`, `overlap` τ) wherever they give the shorter H, or the same H with
  less waiting (and the run allows H ≥ 2 × fragments): each fragment's transfer then runs behind τ inner
  steps of compute, so it costs nothing while it fits in them (H ≥ fragments × (τ + 1): diloco merges a
  fragment before the next is sent; τ steps' compute ≥ a fragment's transfer); only the CPU work is paid
  on the training cores. A blocking sync waits for its transfer and for the slower peer: at 1 Gbit/s a
  blocking int8 sync of llama-100m waited 1.9 s in the collectives besides 1.13 s of CPU (stop 60,
  BENCHMARKS.md scale-out), so the link's speed alone does not make blocking the better plan; it is where
  the fragments' own floor (H ≥ 2 × fragments) is above the blocking H (a fast link and little CPU).

Units: bytes, seconds, Mbit/s (1 Mbit = 1e6 bits). Sources: the all-reduce and all-gather costs are the
ring algorithms' (Thakur et al. 2005); the sparse payload follows SparseLoCo (arXiv 2508.15706: chunk 4096,
top-64, 2-bit values) and the fragment schedule Streaming DiLoCo (arXiv 2501.18512).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

BUDGET = 0.10  # communication ≤ 10 % of compute
SPARSE = {"chunk": 4096, "topk": 64, "bits": 2}  # SparseLoCo's defaults (the sparse codec's own)
MIN_H, MAX_H = 5, 500  # inner steps: a floor and a ceiling
FEATURES = frozenset({"sparse", "fragments", "int4"})  # what diloco takes: issue 45's items 2 and 3, the int4 codec
FRAGMENTS = 4  # streaming: the model synced in this many slices, staggered over H
STREAMED_MERGE = "delta"
"""How a streamed plan merges a fragment (diloco's `merge`): the new global weights plus the τ steps' own
progress since the send, not Streaming DiLoCo's mix (local <- 0.5 local + 0.5 global), which halves the
outer step: llama-100m at 1 Gbit/s, H 10, four fragments, τ 1, mixed, reached one node's loss at step 52
where blocking syncs reached it at 42 (stop 61, BENCHMARKS.md scale-out)."""
SHORT_ROUNDS = 100  # outer rounds under which a factored adapter's outer step is lr 1.0, momentum 0.5
SHORT_OUTER = {"outer_lr": 1.0, "outer_momentum": 0.5}
"""The outer step of a dense plan of under `SHORT_ROUNDS` rounds that trains a factored PEFT method
(`PeftMethodClass.factored`: LoRA's B @ A, Houlsby's down and up projections). DiLoCo's outer Nesterov
momentum 0.9 (lr 0.7, the paper's, for thousands of rounds) moves the shared weights by up to
0.7 / (1 - 0.9) = 7 rounds' pseudo-gradient once it is steady (1.33x in the first round, 2.4x by the third);
each factor is moved that far, so their product by up to its square. Measured: tiny-llama LoRA, 10 rounds:
eval 3.199 with 0.7 / 0.9 against DDP's 2.882, 2.896 with 1.0 / 0.5 (BENCHMARKS.md, data-parallel
strategies); LoRA on the Qwen2.5-0.5B twin, lr 1e-3 (stop 59, BENCHMARKS.md scale-out): 0.7 / 0.9 at H 10
rose from 4.49 to 4.99 over the last 5 of 10 rounds and never reached one node's loss, and int8 at H 5 went
from 4.70 to 8.04 in two rounds. Full fine-tuning moves each weight linearly and keeps the paper's: llama-100m
at 1 Gbit/s, int8 at H 10, the same run (stop 60, BENCHMARKS.md scale-out), reached one node's loss at step
42 with 0.7 / 0.9 and at 46 damped (damped ahead for two rounds, behind from the third; in time 88.0 s and
85.9 s, the same within the run's noise). 100 rounds is ten of momentum 0.9's horizons; a run of unknown
length keeps the paper's. A codec with an outer momentum of its own (sparse: none, error feedback in its place) keeps it."""
SPARSE_MIN_ROUNDS = SPARSE["chunk"] // SPARSE["topk"]
"""Outer rounds (max_steps ÷ H) a run needs before `decide` picks the sparse codec: 64 for SparseLoCo's
chunk 4096 and top-64, the rounds its top-k takes to have sent as many values as a chunk holds, so that a
value held back in the error-feedback buffer has had its turn; with fewer, most of each round's local progress
is still in the buffers when the run ends. Measured (BENCHMARKS.md, scale-out, quick run at 20 Mbit/s,
tiny-llama full fine-tuning, 12 steps): 2 and 4 rounds of sparse did not reach the one-node loss (held-out
5.7-6.5 against a target of 3.575), 4 rounds of int8 did (3.36). SparseLoCo (arXiv 2508.15706) reports
the codec on pre-training runs of many outer rounds (hundreds and more); a run of a few is not among its
results, so the bound here is this codec's own arithmetic and the measurement above, not the paper's."""


@dataclass(frozen=True)
class LinkSample:
    """One measured pair of ranks: `mbit_s` payload rate src → dst, `rtt_s` a 1-value round trip."""

    src: int
    dst: int
    mbit_s: float
    rtt_s: float


@dataclass(frozen=True)
class Measured:
    """What the ranks measured, gathered: every pair's link, the slowest rank's step (seconds: forward,
    backward and the optimizer's step of one rank's batch), the parameters in all and the trainable ones' bytes (what a
    gradient or a pseudo-gradient holds), the run's steps (None: unknown), the tokens a rank's step
    was estimated for with where that number came from (for the plan's event; `decide` reads `step_s`),
    and a diloco sync's CPU work per codec."""

    world: int
    links: tuple[LinkSample, ...]
    step_s: float
    params: int
    trainable_bytes: int
    max_steps: int | None = None
    step_tokens: float | None = None
    tokens_from: str = ""
    step_from: str = ""  # how `step_s` was found: a timed step of the run's model, or estimated from FLOPs
    sync_cpu_s: dict[str, float] = field(default_factory=dict)
    gather_mbit_s: float | None = None  # an all-gather over the group, every link both ways at once (None: not timed)
    factored: bool = False  # the run trains a factored PEFT method (`PeftMethodClass.factored`): `SHORT_OUTER`
    """Per codec ("int8", "int4", "sparse"): the slowest rank's CPU seconds for one whole-model diloco sync besides
    the transfer (the pseudo-gradient, the codec with its error feedback, the world's parts summed, the outer
    step; `auto_probe.sync_cpu_seconds`). Missing: 0. On a CPU node it is not hidden behind compute."""

    @property
    def one_way_mbit_s(self) -> float:
        """The slowest pair's rate, one way at a time (Mbit/s)."""
        return min(s.mbit_s for s in self.links)

    @property
    def link_mbit_s(self) -> float:
        """What a sync gets: the slowest pair one way, or the group's all-gather where that is slower (a sync
        and a ring all-reduce use every link both ways at once), in Mbit/s: the one rate every plan uses."""
        return min(self.one_way_mbit_s, self.gather_mbit_s or float("inf"))


@dataclass(frozen=True)
class Decision:
    """The plan: `strategy` (a registry name), its `config` (`strategy_config`), `reason` (one line, with
    the numbers) and `numbers` (the same, for `--json`)."""

    strategy: str
    config: dict[str, Any]
    reason: str
    numbers: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def codec_bytes(settings: dict[str, Any], values: int) -> int:
    """Bytes of one pseudo-gradient of `values` fp32 values through the codec `settings` name (e.g.
    {"codec": "int4"}, {"codec": "sparse", **SPARSE}): the codec's own formula (`Codec.nbytes`, which
    equals what its payloads carry; int8/int4 pad the last block and add an fp32 scale per block)."""
    from smolforge.parallel.codecs import make_codec

    return make_codec(settings["codec"], **settings).nbytes(values)


def _bottleneck(m: Measured) -> tuple[float, float]:
    """(bytes/s of `Measured.link_mbit_s`, the longest round trip in seconds)."""
    return max(m.link_mbit_s * 1e6 / 8, 1.0), max(s.rtt_s for s in m.links)


@dataclass(frozen=True)
class _Plan:
    """One codec's diloco schedule for the measurements: its payload (bytes per rank per sync), one sync's
    transfer (seconds) and CPU work besides it (`cpu_s`), the H the budget asks (`blocking_h`), the H planned
    (`h`, at most `cap`: two syncs in the run), streamed `fragments` with `overlap` τ (1 and 0: blocking) and
    the share of compute syncs wait."""

    codec: dict[str, Any]
    payload: int
    sent: int
    sync_s: float
    cpu_s: float
    blocking_h: int
    cap: int
    h: int
    fragments: int
    overlap: int
    comm_fraction: float
    need_h: int = 0  # the H this schedule needs within budget (blocking: `blocking_h`)

    @property
    def over(self) -> bool:
        """Over budget: the run is too short for the H the budget asks, so syncs wait."""
        return self.h < (self.need_h or self.blocking_h)


PLANNED_CODECS = {  # the codecs auto plans with, as diloco's settings (each codec's defaults: int8/int4 block 256)
    "sparse": {"codec": "sparse", **SPARSE},
    "int8": {"codec": "int8"},
    "int4": {"codec": "int4"},
}


def _plan(m: Measured, codec: str, budget: float, has: frozenset[str], max_h: int) -> _Plan:
    """diloco with `codec` ("sparse", "int8" or "int4"), blocking or streamed, H from the budget rule: of the
    two, the shorter H, and at the same H the one that waits less (`_wait_order`)."""
    rate, rtt = _bottleneck(m)
    n, params = m.world, m.trainable_bytes // 4
    knobs = PLANNED_CODECS[codec]
    payload = codec_bytes(knobs, params)
    sent = (n - 1) * payload  # an all-gather: this node's part to each of the others
    sync_s = sent / rate + (n - 1) * rtt
    cpu_s = m.sync_cpu_s.get(codec, 0.0)  # the same work whether the model goes whole or in fragments
    cap = max(1, min(max_h, (m.max_steps or max_h) // 2))  # at least two syncs in the run
    blocking_h = max(MIN_H, math.ceil((sync_s + cpu_s) / (budget * m.step_s)))
    plan = dict(codec=knobs, payload=int(payload), sent=int(sent), sync_s=sync_s, cpu_s=cpu_s,
                blocking_h=blocking_h, cap=cap)
    h = min(blocking_h, cap)
    blocking = _Plan(**plan, h=h, fragments=1, overlap=0, comm_fraction=(sync_s + cpu_s) / (h * m.step_s))
    if "fragments" not in has or cap < 2 * FRAGMENTS:
        return blocking
    return min(blocking, _streamed(m, plan, budget), key=_wait_order)


def _wait_order(p: _Plan) -> tuple[int, float]:
    """The shorter H first (more outer rounds in the run), then the smaller share of compute spent waiting."""
    return p.h, p.comm_fraction


def _streamed(m: Measured, plan: dict[str, Any], budget: float) -> _Plan:
    """`plan`'s codec in `FRAGMENTS` streamed fragments: τ steps' compute hides a fragment's transfer, and H
    is long enough for the schedule and for the CPU work, which nothing hides, to fit the budget."""
    sync_s, cpu_s, cap = plan["sync_s"], plan["cpu_s"], plan["cap"]
    tau = max(1, math.ceil(sync_s / FRAGMENTS / m.step_s))  # a fragment's transfer hidden behind τ steps
    # diloco's schedule: τ < H ÷ fragments; and H long enough that the CPU work, not hidden, fits the budget
    need = max(MIN_H, FRAGMENTS * (tau + 1), math.ceil(cpu_s / (budget * m.step_s)))
    h = min(cap, need)
    overlap = min(tau, h // FRAGMENTS - 1)
    # per H: what τ steps do not hide of the transfer, and all of the CPU work (the compute's own cores)
    waits = max(0.0, sync_s - FRAGMENTS * overlap * m.step_s) + cpu_s
    return _Plan(**plan, h=h, fragments=FRAGMENTS, overlap=overlap, comm_fraction=waits / (h * m.step_s), need_h=need)


def decide(m: Measured, budget: float = BUDGET, has: frozenset[str] = FEATURES, max_h: int = MAX_H) -> Decision:
    """The strategy, codec and H that keep communication ≤ `budget` of compute for measurements `m`, and
    that can learn in the run's outer rounds (`m.max_steps` ÷ H; sparse needs `SPARSE_MIN_ROUNDS`).
    `has`: what this build's diloco takes ("sparse" and "int4": the codecs, else `int8`; "fragments":
    streaming, else blocking syncs only). Deterministic in its inputs."""
    if m.world <= 1 or not m.links:
        return Decision("single", {}, "one rank: nothing to share", {"world": m.world})
    rate, rtt = _bottleneck(m)
    n = m.world
    ddp_bytes = 2 * (n - 1) / n * m.trainable_bytes
    ddp_s = ddp_bytes / rate + 2 * (n - 1) * rtt
    numbers = {"world": n, "mbit_s": round(rate * 8 / 1e6, 2), "rtt_ms": round(rtt * 1e3, 3),
               "step_s": round(m.step_s, 4), "step_tokens": m.step_tokens, "step_tokens_from": m.tokens_from,
               "step_from": m.step_from,
               "budget": budget, "model_bytes": m.params * 4,
               "ddp_bytes_per_step": int(ddp_bytes), "ddp_comm_s": round(ddp_s, 4)}
    one_way = m.one_way_mbit_s
    numbers.update(one_way_mbit_s=round(one_way, 2), gather_mbit_s=m.gather_mbit_s and round(m.gather_mbit_s, 2))
    both = (f" ({one_way:.3g} one way, both ways at once in an all-gather)"
            if m.gather_mbit_s and m.gather_mbit_s < one_way else "")
    link = f"slowest link {numbers['mbit_s']:g} Mbit/s{both}, RTT {numbers['rtt_ms']:g} ms, step {m.step_s:.3g} s"
    if ddp_s <= budget * m.step_s:
        return Decision("ddp", {}, f"ddp: its all-reduce ({_mb(ddp_bytes)} per step, {ddp_s:.3g} s) is "
                        f"{ddp_s / m.step_s:.1%} of a step's compute, within {budget:.0%} ({link})", numbers)
    head = (f"diloco: ddp's all-reduce ({ddp_s:.3g} s per step) would be {ddp_s / m.step_s:.0%} of compute, "
            f"over {budget:.0%}")
    dense = ("int8", "int4") if "int4" in has else ("int8",)
    plans = {c: _plan(m, c, budget, has, max_h) for c in ("sparse", *dense)}
    lean, which = _dense(plans, dense)
    if "sparse" not in has:
        return _decision(m, lean, numbers, f"{head}; {which}", link)
    sparse = plans["sparse"]
    rounds = None if m.max_steps is None else m.max_steps // sparse.h
    numbers.update(sparse_rounds=rounds, min_sparse_rounds=SPARSE_MIN_ROUNDS)
    if rounds is None or rounds >= SPARSE_MIN_ROUNDS:
        enough = "the run's length unknown" if rounds is None else f"{rounds} rounds ≥ {SPARSE_MIN_ROUNDS}"
        return _decision(m, sparse, numbers, f"{head}; {enough}: ", link)
    few = (f"{head}; {rounds} rounds < {SPARSE_MIN_ROUNDS}: too few for sparse's error feedback at "
           f"H={sparse.h}, so a dense codec: {which}")
    return _decision(m, lean, numbers, few, link)


def _dense(plans: dict[str, _Plan], names: tuple[str, ...]) -> tuple[_Plan, str]:
    """The dense codec (every value sent, with error feedback) and why: int4 where its half of int8's bytes
    buys a shorter H, or less waiting when the run caps both at the same H (a slow link: a transfer
    dominates), else int8, which loses less per message (a fast link: the CPU work dominates, and int4's
    packing costs more of it; measured on llama-100m, one core: 1.6 s a sync against int8's 1.2-1.45 s)."""
    i8 = plans["int8"]
    if "int4" not in names:
        return i8, "the less lossy "
    i4 = plans["int4"]

    def cost(p: _Plan) -> tuple[int, float]:
        return p.h, (p.comm_fraction if p.over else 0.0)

    if cost(i4) < cost(i8):
        gain = f"H={i4.h} against int8's H={i8.h}" if i4.h < i8.h else f"less waiting at the same H={i4.h}"
        return i4, f"int4, half int8's bytes, for {gain}: "
    if i4.h == i8.h:
        return i8, f"int8, the less lossy (int4 would not shorten H={i8.h}): "
    return i8, f"int8, the less lossy (int4 would need H={i4.h}): "


def _decision(m: Measured, p: _Plan, numbers: dict, why: str, link: str) -> Decision:
    """The Decision for plan `p`, its reason `why` followed by the codec's bytes and the schedule."""
    budget, params = numbers["budget"], m.trainable_bytes // 4
    numbers.update(codec=p.codec["codec"], bytes_per_sync=p.payload, bytes_sent_per_sync=p.sent,
                   sync_s=round(p.sync_s, 4), sync_cpu_s=round(p.cpu_s, 4),
                   sync_fraction_of_model=round(p.payload / max(1, params * 4), 5),
                   inner_steps=p.h, rounds=None if m.max_steps is None else m.max_steps // p.h,
                   comm_fraction=round(p.comm_fraction, 4))
    sends = (f"{why}{p.codec['codec']} sends {_mb(p.payload)} per sync "
             f"({p.payload / max(1, params * 4):.2%} of the fp32 model), {p.sync_s:.3g} s"
             + (f" and {p.cpu_s:.3g} s of CPU" if p.cpu_s else ""))
    over = f"; over budget: H is capped at {p.cap} by the run, so syncs wait" if p.over else ""
    outer, steady = _outer(numbers["rounds"], p.codec["codec"], m.factored)
    if p.fragments == 1:
        fits = (f"over budget: it needs H={p.blocking_h}, capped at {p.cap} by the run, so syncs wait" if p.over
                else f"within {budget:.0%}")
        return Decision("diloco", {**p.codec, "inner_steps": p.h, **outer},
                        f"{sends}, {p.comm_fraction:.1%} of H={p.h} steps' compute, {fits}{steady} ({link})", numbers)
    numbers.update(fragments=p.fragments, overlap=p.overlap)
    return Decision("diloco", {**p.codec, "inner_steps": p.h, "fragments": p.fragments, "overlap": p.overlap,
                               "merge": STREAMED_MERGE, **outer},
                    f"{sends}: blocking would need H={p.blocking_h}, so {p.fragments} streamed fragments, each "
                    f"sent behind τ={p.overlap} steps' compute (H={p.h}), merged with the steps' own progress"
                    f"{over}{steady} ({link})", numbers)


def _outer(rounds: int | None, codec: str, factored: bool) -> tuple[dict[str, float], str]:
    """The outer step's settings for a plan of `rounds` outer rounds, and what the reason says of them:
    `SHORT_OUTER` for a factored adapter's run of fewer than `SHORT_ROUNDS` with a codec that has no
    outer momentum of its own, else diloco's (the paper's; sparse's none)."""
    from smolforge.parallel.codecs import CODECS

    if not factored or CODECS[codec].momentum is not None or rounds is None or rounds >= SHORT_ROUNDS:
        return {}, ""
    return dict(SHORT_OUTER), (f"; outer lr {SHORT_OUTER['outer_lr']:g}, momentum {SHORT_OUTER['outer_momentum']:g}"
                               f" for {rounds} rounds of a factored adapter (momentum 0.9 overshoots a product "
                               f"of factors in under {SHORT_ROUNDS})")


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.3g} MB"
