"""`--strategy auto`'s decision: which data-parallel strategy, codec and sync interval fit the measured
links and step time. A pure function (no I/O, no torch): the ranks measure (`parallel/auto_probe.py`),
every rank calls `decide` on the same gathered numbers and so reaches the same plan.

The rule (issue 45, item 4): communication stays under `budget` (10 %) of compute.

- **ddp** when its per-step all-reduce fits: a ring all-reduce sends 2(n-1)/n of the gradient's bytes per
  rank over the slowest link, plus 2(n-1) round trips, and that must be ≤ budget × one step's compute.
- else **diloco** with the `sparse` codec (SparseLoCo: per-chunk top-k, low-bit values, uint16 indices,
  one fp32 scale per chunk; `int8` when this build's diloco lacks `sparse`) and H (`inner_steps`) chosen
  so that one sync's transfer (an all-gather: each node sends its part to the n-1 others) is ≤ budget ×
  H steps' compute.
- **streaming fragments** (`fragments`, `overlap` τ) when the blocking H would be longer than
  `prefer_h` or than the run allows: each fragment's transfer then runs behind τ inner steps of compute,
  so it costs nothing while it fits in them (H = fragments × τ, τ steps' compute ≥ a fragment's transfer).

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
INT8_BLOCK = 256  # diloco's int8 default: one fp32 scale per 256 values
MIN_H, PREFER_H, MAX_H = 5, 100, 500  # inner steps: a floor, above which streaming is preferred, a ceiling
FEATURES = frozenset({"sparse", "fragments"})  # what diloco takes once issue 45's items 2 and 3 are in
FRAGMENTS = 4  # streaming: the model synced in this many slices, staggered over H


@dataclass(frozen=True)
class LinkSample:
    """One measured pair of ranks: `mbit_s` payload rate src → dst, `rtt_s` a 1-value round trip."""

    src: int
    dst: int
    mbit_s: float
    rtt_s: float


@dataclass(frozen=True)
class Measured:
    """What the ranks measured, gathered: every pair's link, the slowest rank's step compute (seconds,
    forward and backward of one rank's batch), the parameters in all and the trainable ones' bytes (what a
    gradient or a pseudo-gradient holds), and the run's steps (None: unknown)."""

    world: int
    links: tuple[LinkSample, ...]
    step_s: float
    params: int
    trainable_bytes: int
    max_steps: int | None = None


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


def sparse_bytes(params: int, chunk: int, topk: int, bits: int) -> int:
    """Bytes of one sparse pseudo-gradient of `params` fp32 values: the sparse codec's own formula
    (`parallel/codecs.py` `Sparse.nbytes`: per chunk `topk` uint16 positions and an fp32 scale, the
    values packed at `bits` bits)."""
    from smolforge.parallel.codecs import make_codec

    return make_codec("sparse", chunk=chunk, topk=topk, bits=bits).nbytes(params)


def int8_bytes(params: int, block: int = INT8_BLOCK) -> int:
    """Bytes of one blockwise-int8 pseudo-gradient: the int8 codec's own formula (`Int8.nbytes`: a byte
    per value, the last block padded, and an fp32 scale per block)."""
    from smolforge.parallel.codecs import make_codec

    return make_codec("int8", block=block).nbytes(params)


def _bottleneck(m: Measured) -> tuple[float, float]:
    """(bytes/s of the slowest measured link, the longest round trip)."""
    rate = min(s.mbit_s for s in m.links) * 1e6 / 8
    return max(rate, 1.0), max(s.rtt_s for s in m.links)


def decide(m: Measured, budget: float = BUDGET, has: frozenset[str] = FEATURES, max_h: int = MAX_H,
           prefer_h: int = PREFER_H) -> Decision:
    """The strategy, codec and H that keep communication ≤ `budget` of compute for measurements `m`.
    `has`: what this build's diloco takes ("sparse": the codec, else `int8`; "fragments": streaming, else
    blocking syncs only). Deterministic in its inputs."""
    if m.world <= 1 or not m.links:
        return Decision("single", {}, "one rank: nothing to share", {"world": m.world})
    rate, rtt = _bottleneck(m)
    n = m.world
    ddp_bytes = 2 * (n - 1) / n * m.trainable_bytes
    ddp_s = ddp_bytes / rate + 2 * (n - 1) * rtt
    numbers = {"world": n, "mbit_s": round(rate * 8 / 1e6, 2), "rtt_ms": round(rtt * 1e3, 3),
               "step_s": round(m.step_s, 4), "budget": budget, "model_bytes": m.params * 4,
               "ddp_bytes_per_step": int(ddp_bytes), "ddp_comm_s": round(ddp_s, 4)}
    link = f"slowest link {numbers['mbit_s']:g} Mbit/s, RTT {numbers['rtt_ms']:g} ms, step {m.step_s:.3g} s"
    if ddp_s <= budget * m.step_s:
        return Decision("ddp", {}, f"ddp: its all-reduce ({_mb(ddp_bytes)} per step, {ddp_s:.3g} s) is "
                        f"{ddp_s / m.step_s:.1%} of a step's compute, within {budget:.0%} ({link})", numbers)
    return _diloco(m, numbers, link, (ddp_s, budget, has, max_h, prefer_h))


def _diloco(m: Measured, numbers: dict, link: str, knobs: tuple) -> Decision:
    """diloco with the sparse (else int8) codec, blocking or streamed, H from the 10 % rule."""
    ddp_s, budget, has, max_h, prefer_h = knobs
    sparse = "sparse" in has
    rate, rtt = _bottleneck(m)
    n, params = m.world, m.trainable_bytes // 4
    codec = {"codec": "sparse", **SPARSE} if sparse else {"codec": "int8"}
    payload = sparse_bytes(params, **SPARSE) if sparse else int8_bytes(params)
    sent = (n - 1) * payload  # an all-gather: this node's part to each of the others
    sync_s = sent / rate + (n - 1) * rtt
    cap = max(1, min(max_h, (m.max_steps or max_h) // 2))  # at least two syncs in the run
    blocking_h = max(MIN_H, math.ceil(sync_s / (budget * m.step_s)))
    numbers.update(codec=codec["codec"], bytes_per_sync=int(payload), bytes_sent_per_sync=int(sent),
                   sync_s=round(sync_s, 4), sync_fraction_of_model=round(payload / max(1, params * 4), 5))
    why = (f"diloco: ddp's all-reduce ({ddp_s:.3g} s per step) would be {ddp_s / m.step_s:.0%} of compute, over "
           f"{budget:.0%}; diloco {codec['codec']} sends {_mb(payload)} per sync "
           f"({payload / max(1, params * 4):.2%} of the fp32 model), {sync_s:.3g} s")
    if blocking_h <= min(prefer_h, cap) or "fragments" not in has:
        h = min(blocking_h, cap)
        numbers.update(inner_steps=h, comm_fraction=round(sync_s / (h * m.step_s), 4))
        over = "" if h == blocking_h else f"; over budget: H is capped at {cap} by the run, so syncs wait"
        return Decision("diloco", {**codec, "inner_steps": h},
                        f"{why} ≤ {budget:.0%} of H={blocking_h} steps' compute{over} ({link})", numbers)
    tau = max(1, math.ceil(sync_s / FRAGMENTS / m.step_s))  # a fragment's transfer hidden behind τ steps
    h = max(MIN_H, FRAGMENTS * tau)
    fits = h <= cap
    h = min(h, cap)
    numbers.update(inner_steps=h, fragments=FRAGMENTS, overlap=min(tau, max(1, h // FRAGMENTS)),
                   comm_fraction=0.0 if fits else round(sync_s / (h * m.step_s) - 1, 4))
    over = "" if fits else f"; over budget: H is capped at {cap} by the run, so syncs wait"
    return Decision("diloco", {**codec, "inner_steps": h, "fragments": FRAGMENTS, "overlap": numbers["overlap"]},
                    f"{why}: blocking would need H={blocking_h}, so {FRAGMENTS} streamed fragments, each "
                    f"sent behind τ={numbers['overlap']} steps' compute (H={h}){over} ({link})", numbers)


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.3g} MB"
