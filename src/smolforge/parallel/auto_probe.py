"""`--strategy auto` inside the ranks: measure, gather, decide (`parallel/auto_choice.py`), and hand back the
round's plan with the chosen strategy in place of `auto`.

What is measured, once per round (a regroup is a new round, so a node joining or leaving decides again):

- **every pair's link**, over the round's own process group (the channel training uses): rank i sends
  rank j a warm-up of 256 KB, then a payload sized to about half a second at the warm-up's rate (at most
  `probe_mb` MB), timed on the sender up to a 1-value acknowledgement (Mbit/s of payload); the round trip is
  the least of 5 one-value ping-pongs (a busy machine's scheduling only ever adds to a round trip, as NTP's
  minimum-delay filter assumes). Pairs go one at a time, the others waiting at a barrier.
- **an all-gather over the whole group** (`gather_rate`, stop 61), what a diloco sync does: every rank
  sends while it receives, each link busy both ways at once. One way at a time a 20 Mbit/s netlab link read
  19.1 Mbit/s where a job's sync fragments crossed at 14.7 (stop 60): the plan takes the slower of the two.
- **the step**, timed (`timed_step_seconds`): the run's own model built as training builds it, and two
  of training's own steps (`Trainer.step`: forward, backward, clipping, the optimizer) on random token ids
  the shape of a batch; the second counts. Tokens = rows per rank × grad_accum × the width a batch of *this
  run's data* is padded to (`step_tokens`: the first `SAMPLE_ROWS` examples encoded as training encodes
  them, and the expected longest row of a batch; `max_length` with packing, or when the data cannot be read
  here). Where the model cannot be built here, the step is estimated from FLOPs instead (6 × parameters ×
  tokens for full fine-tuning, 4 × for an adapter, at the measured matmul rate × `MATMUL_EFFICIENCY`),
  said so in the event's `step_from`. The slowest rank's step counts, and every rank states that rank's
  tokens and sources. Measured on llama-100m, full fine-tuning, one core (stop 58): timed 1.50 s against
  1.4-1.7 s in the job, where the FLOPs estimate said 2.5-3.3 s; counting `max_length` for every row, as
  this did first, said 32.7 s, and auto then planned H for a step 23× too long.
- **a diloco sync's CPU work** per codec (`sync_cpu_seconds`: the functions a sync calls — the pseudo-gradient,
  the codec with its error feedback, the world's parts summed, the outer step — timed on 16M values and
  scaled to the model): on a CPU node it is paid on the training cores, not hidden behind the link.
- **the model's sizes** from its config on the meta device (no weights read), PEFT applied there: the
  parameters in all and the trainable ones' bytes (what ddp's all-reduce moves).

Every rank gathers the same numbers (float64 tensors, `gather_numbers`: nothing pickled crosses the network)
and calls the same pure `decide`, so all reach one
plan without a broadcast. Collective: every rank of the group calls `resolve` at the same point.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from smolforge.parallel.auto_choice import PLANNED_CODECS, Decision, LinkSample, Measured, decide

if TYPE_CHECKING:
    import torch

    from smolforge.config import TrainConfig
    from smolforge.parallel.rank_task import RankPlan

MATMUL_EFFICIENCY = 0.5  # a training step's FLOP rate ÷ a bare matmul's on the same threads
SAMPLE_ROWS = 256  # training examples encoded to estimate a batch's padded width
SYNC_SAMPLE = 1 << 24  # values a sync is timed on (64 MB of fp32: past the caches, as the model is), then scaled
SYNC_CODECS = tuple(PLANNED_CODECS)  # the codecs `auto_choice.decide` plans with, each timed
WARM_BYTES = 256 * 1024
PROBE_SECONDS = 0.5


def _device() -> "torch.device":
    """Where the probe's tensors live: the GPU under NCCL (it moves only CUDA tensors), else the CPU (gloo)."""
    import torch
    import torch.distributed as dist

    nccl = dist.is_initialized() and dist.get_backend() == dist.Backend.NCCL and torch.cuda.is_available()
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def _pair(me: int, src: int, dst: int, probe_mb: float) -> LinkSample | None:
    """One timed exchange src → dst (collective between the two; others return None at once)."""
    import torch
    import torch.distributed as dist

    if me not in (src, dst):
        return None
    dev = _device()
    peer, ack, size = (dst if me == src else src), torch.zeros(1, device=dev), torch.zeros(1, device=dev)
    rtts = []
    for _ in range(5):  # round trips: one value there and back
        t0 = time.perf_counter()
        if me == src:
            dist.send(ack, peer)
            dist.recv(ack, peer)
        else:
            dist.recv(ack, peer)
            dist.send(ack, peer)
        ack.cpu()  # on a GPU (NCCL), the round trip ends when the value is on the host
        rtts.append(time.perf_counter() - t0)
    rate = _timed_send(me == src, peer, torch.ones(WARM_BYTES // 4, device=dev))
    if me == src:
        size[0] = max(WARM_BYTES, min(probe_mb * 1e6, (rate or 1e6) * PROBE_SECONDS)) // 4
        dist.send(size, peer)
    else:
        dist.recv(size, peer)
    rate = _timed_send(me == src, peer, torch.ones(int(size.item()), device=dev))
    return LinkSample(src, dst, rate * 8 / 1e6, min(rtts)) if me == src else None


def _timed_send(sending: bool, peer: int, payload: "torch.Tensor") -> float | None:
    """Bytes/s of one payload sent to `peer`, timed by the sender up to the peer's acknowledgement."""
    import torch
    import torch.distributed as dist

    ack = torch.zeros(1, device=payload.device)
    t0 = time.perf_counter()
    if sending:
        dist.send(payload, peer)
        dist.recv(ack, peer)
        ack.cpu()  # a GPU's send is asynchronous: the acknowledgement is here once it is on the host
        return payload.numel() * 4 / max(time.perf_counter() - t0, 1e-9)
    dist.recv(payload, peer)
    dist.send(ack, peer)
    return None


def probe_links(probe_mb: float = 4.0) -> list[LinkSample]:
    """Every ordered pair's measured link, the same list on every rank (collective over the default group)."""
    import torch.distributed as dist

    me, world = dist.get_rank(), dist.get_world_size()
    mine = []
    for src in range(world):
        for dst in range(world):
            if src != dst:
                sample = _pair(me, src, dst, probe_mb)
                if sample is not None:
                    mine.append(sample)
                dist.barrier()
    rows = [[s.src, s.dst, s.mbit_s, s.rtt_s] for s in mine]
    every = gather_numbers(rows + [[math.nan] * 4] * (world - len(rows)), width=4)  # world rows each: fixed shape
    return sorted((LinkSample(int(r[0]), int(r[1]), r[2], r[3]) for part in every for r in part
                   if not math.isnan(r[0])), key=lambda s: (s.src, s.dst))


def gather_rate(links: list[LinkSample], probe_mb: float) -> float:
    """Mbit/s of payload a rank sends in an all-gather over the whole group, every rank at once (what a diloco
    sync does: each link both ways at once), the slowest rank's: a payload sized to about `PROBE_SECONDS` at
    the slowest pair's one-way rate (at most `probe_mb` MB), after a warm-up gather of `WARM_BYTES`.
    Collective over the default group. Measured on netlab at a 20 Mbit/s cap: one way 19.1 Mbit/s, a 2-rank
    gloo all-gather of 1-16 MB 11-13, a job's 14 MB int4 fragments 14.7 (stop 60-61, BENCHMARKS.md
    scale-out); timing each pair both ways at once instead read 6.6 in one direction and 19.5 in the other
    in most tries (why, not looked into)."""
    import torch
    import torch.distributed as dist

    world, dev = dist.get_world_size(), _device()
    slowest = min(s.mbit_s for s in links) * 1e6 / 8
    values = int(max(WARM_BYTES, min(probe_mb * 1e6, slowest * PROBE_SECONDS / max(1, world - 1)))) // 4
    warm = torch.ones(WARM_BYTES // 4, device=dev)
    dist.all_gather([torch.empty_like(warm) for _ in range(world)], warm)
    mine = torch.ones(values, device=dev)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_gather(parts, mine)
    parts[-1][-1:].cpu()  # on a GPU (NCCL), the gather is over once its last value is on the host
    rate = values * 4 * (world - 1) / max(time.perf_counter() - t0, 1e-9)
    return min(part[0][0] for part in gather_numbers([[rate]], width=1)) * 8 / 1e6


def gather_numbers(rows: list[list[float]], width: int) -> list[list[list[float]]]:
    """Every rank's `rows` (the same count on every rank, `width` floats each), gathered as float64 tensors:
    numbers cross the network, never a pickle (`all_gather_object` would unpickle what a peer sent).
    Collective over the default group."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor(rows, dtype=torch.float64, device=_device()).reshape(len(rows), width)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [t.cpu().tolist() for t in every]


TEXT_BYTES = 160  # a gathered sentence's UTF-8 bytes, at most (longer ones are cut)


def text_row(text: str, width: int = TEXT_BYTES) -> list[float]:
    """`text` as `width` numbers (its UTF-8 bytes, zero-padded, cut at a character's boundary), for
    `gather_numbers`: a sentence crosses the network as numbers, never a pickle."""
    raw = text.encode()[:width].decode(errors="ignore").encode()
    return [float(b) for b in raw] + [0.0] * (width - len(raw))


def row_text(row: list[float]) -> str:
    """`text_row`'s inverse."""
    return bytes(int(v) for v in row).rstrip(b"\0").decode(errors="replace")


def matmul_flops(dtype: "torch.dtype | None" = None, seconds: float = 0.3) -> float:
    """FLOP/s of a 512×512 matmul on this process's threads (`dtype`, default fp32), timed for ~`seconds`."""
    import torch

    a = torch.randn(512, 512, dtype=dtype or torch.float32)
    b = torch.randn(512, 512, dtype=dtype or torch.float32)
    a @ b  # warm-up
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    return n * 2 * 512 ** 3 / (time.perf_counter() - t0)


def model_sizes(cfg: "TrainConfig") -> tuple[int, int] | None:
    """(parameters in all, trainable bytes) of the run's model with its PEFT method, built on the meta
    device from its config (no weights read); None when its config is not here (a model not a language model)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from smolforge.models.default_student import model_config
    from smolforge.models.dtypes import torch_dtype
    from smolforge.models.peft_methods import apply_peft

    config = model_config(cfg.model)
    if config is None:
        return None
    body = {k: v for k, v in config.items() if k != "model_type"}
    dtype = torch_dtype(cfg.dtype) if cfg.dtype in ("bf16", "fp16", "fp32") else torch.float32  # auto: fp32
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **body), dtype=dtype)
        net = apply_peft(net, cfg.peft)
    params = list(net.parameters())
    return (sum(p.numel() for p in params),
            sum(p.numel() * p.element_size() for p in params if p.requires_grad))


def padded_width(lengths: list[int], batch: int) -> float:
    """The expected width of a batch of `batch` rows drawn without replacement from rows of `lengths`
    tokens, padded to its longest row (what `data.collate` makes): with the lengths sorted ascending,
    the i-th (1-based) is the batch's longest with probability C(i-1, b-1) / C(n, b). Exact, no sampling.
    Raises ValueError for no rows or a batch under 1."""
    if not lengths or batch < 1:
        raise ValueError(f"padded_width needs rows and a batch ≥ 1 (got {len(lengths)} rows, batch {batch})")
    ordered, n = sorted(lengths), len(lengths)
    b = min(batch, n)
    total = math.comb(n, b)
    return sum(length * math.comb(i, b - 1) for i, length in enumerate(ordered) if i >= b - 1) / total


def step_tokens(cfg: "TrainConfig") -> tuple[float, str]:
    """(tokens one rank's step computes, how that was found): rows per rank × grad_accum × the padded
    width of a batch of this run's data (`padded_width` over the first `SAMPLE_ROWS` training examples,
    encoded as training encodes them: the model's tokenizer and chat template, truncated at max_length);
    with packing, or data this rank cannot read or encode here, max_length (said so)."""
    rows, width = cfg.batch_size * cfg.grad_accum, cfg.data.max_length
    if cfg.data.packing:
        return float(rows * width), f"packed: {width} tokens a row"
    try:
        from smolforge.data.splits import read_spec
        from smolforge.models.loading import load_tokenizer
        from smolforge.train.rendering import load_checked_splits

        train, _, fmt, _ = read_spec(cfg.data)
        sample = train[:SAMPLE_ROWS]
        encoded = load_checked_splits(cfg.data, load_tokenizer(cfg.model), read=(sample, [], fmt, 0)).train
        expected = padded_width([len(r["input_ids"]) for r in encoded], cfg.batch_size)
    except Exception as err:  # noqa: BLE001 - an estimate: any failure falls back to the bound, said so
        return float(rows * width), f"max_length {width} (the data was not read here: {type(err).__name__})"
    return rows * expected, f"{expected:.1f} tokens a row padded, from {len(encoded)} rows of the data"


def step_seconds(params: int, trainable_bytes: int, flops: float, tokens: float) -> float:
    """One rank's forward and backward of `tokens` tokens, estimated from FLOPs at `flops` ×
    MATMUL_EFFICIENCY."""
    full = trainable_bytes >= params  # every weight trains (bf16 weights: 2 bytes each, still ≥ params)
    return (6 if full else 4) * params * tokens / max(flops * MATMUL_EFFICIENCY, 1.0)


def timed_step_seconds(cfg: "TrainConfig", tokens: float) -> float:
    """One rank's training step on this run's own model, timed: the model built as training builds it
    (`train.engine.build_model`: its weights, dtype, PEFT method, gradient checkpointing), and the step
    training takes (`train.loop.Trainer.step`: forward and backward of each micro-batch under the run's
    precision, clipping, training's optimizer) on `grad_accum` micro-batches of `cfg.batch_size` rows of
    random token ids as wide as `tokens` makes a row. The second of two steps (the first warms up), in
    seconds. Raises what building the model raises (the caller falls back to FLOPs)."""
    import torch

    from smolforge.train.engine import build_model
    from smolforge.train.evaluate import token_loss_sum
    from smolforge.train.loop import Trainer, make_optimizer

    device = _device()
    _, model = build_model(cfg, device)
    model.train()
    optimizer = make_optimizer(model, cfg.lr or 1e-4, cfg.weight_decay, device, kind=cfg.optimizer)
    trainer = Trainer(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
                      loss_sum=lambda logits, m: token_loss_sum(logits, m["labels"])[0], device=device,
                      precision=cfg.precision, max_grad_norm=cfg.max_grad_norm)
    rows, accum = cfg.batch_size, cfg.grad_accum
    shape = (rows, max(2, round(tokens / (rows * accum))))
    vocab = model.get_input_embeddings().num_embeddings
    micro = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
             for ids in (torch.randint(0, vocab, shape, device=device) for _ in range(accum))]
    spent = 0.0
    for step in range(2):
        t0 = time.perf_counter()
        trainer.step(step, micro)
        if device.type == "cuda":
            torch.cuda.synchronize()
        spent = time.perf_counter() - t0
    del trainer, optimizer, model, micro
    gc.collect()  # the probe's model and optimizer state go before training builds its own (cycles included)
    return spent


def sync_cpu_seconds(codec: str, values: int, world: int, sample: int = SYNC_SAMPLE) -> float:
    """CPU seconds of one whole-model diloco sync of `values` fp32 values through `codec`, besides the
    transfer, on this process's threads: the functions `DiLoCo._send` and `_merge` call (the pseudo-gradient,
    the codec's encode with its error feedback, both read piece by piece from the parameters, the `world`
    parts summed a piece at a time into the outer step, the new weights copied back), in a sync after a
    first one (momentum and residual exist), timed on `sample` values and scaled linearly (every pass is
    elementwise or per block/chunk)."""
    import torch

    from smolforge.parallel.codecs import ErrorFeedback, make_codec, pack_pieces, unpack_payload
    from smolforge.parallel.strategies.diloco_stream import (Averaged, fill_pseudo_gradient, make_fragments,
                                                             merge_into, outer_step)

    n = min(sample, max(values, 1))
    params = [torch.nn.Parameter(torch.zeros(n), requires_grad=False)]
    frag = make_fragments(params, 1)[0]
    coder = make_codec(codec, **PLANNED_CODECS[codec])  # the settings a plan would give diloco
    outer = torch.optim.SGD([frag.shared], lr=0.7, momentum=0.9 if coder.momentum is None else coder.momentum,
                            nesterov=coder.momentum is None)
    feedback = ErrorFeedback(coder)

    def sync() -> None:
        params[0].data.add_(torch.randn(n) * 1e-3)  # a round's training (not timed below)
        t0 = time.perf_counter()
        buf, like = pack_pieces(feedback.encode_pieces(n, fill_pseudo_gradient(params, frag)))
        mean = Averaged(coder, parts=[unpack_payload(buf, like)] * world, weights=[1.0 / world] * world)
        outer_step(outer, frag.shared, mean.piece, mean.unit)
        merge_into(params, frag, 0.0)
        spent.append(time.perf_counter() - t0)

    spent: list[float] = []
    sync()
    sync()
    return spent[-1] * values / n


def _step(cfg: "TrainConfig", sizes: tuple[int, int], tokens: float) -> tuple[float, str]:
    """(this rank's step in seconds, how it was found): timed on the run's model, or where that model
    cannot be built here, estimated from FLOPs (said so, with why)."""
    try:
        return timed_step_seconds(cfg, tokens), "timed: a step of the run's model"
    except Exception as err:  # noqa: BLE001 - an estimate in its place, said so
        from smolforge.models.dtypes import torch_dtype

        flops = matmul_flops(torch_dtype(cfg.dtype) if cfg.dtype in ("bf16", "fp32") else None)
        return (step_seconds(*sizes, flops, tokens),
                f"estimated from FLOPs (the model was not built here: {type(err).__name__})")


def measure(cfg: "TrainConfig", probe_mb: float, world: int) -> Measured | None:
    """This round's measurements, the same on every rank (collective); None when the model's size is unknown."""
    try:
        sizes = model_sizes(cfg)
    except Exception:  # noqa: BLE001 - a PEFT method or family the meta device cannot build: ddp, said so
        sizes = None
    links = probe_links(probe_mb)
    gather = gather_rate(links, probe_mb)
    tokens, source = step_tokens(cfg) if sizes else (0.0, "")
    mine, how = _step(cfg, sizes, tokens) if sizes else (0.0, "")
    cpu = [sync_cpu_seconds(c, sizes[1] // 4, world) if sizes else 0.0 for c in SYNC_CODECS]
    width = 2 + len(SYNC_CODECS) + 2 * TEXT_BYTES
    row = [mine, tokens, *cpu, *text_row(source), *text_row(how)]
    every = [part[0] for part in gather_numbers([row], width=width)]
    if sizes is None:
        return None
    # the slowest rank's step, and the tokens it was estimated for, said as that rank said it: every rank
    # states the same numbers (ranks may read the data differently: one may not reach it)
    slow = every[max(range(len(every)), key=lambda r: (every[r][0], -r))]
    texts = slow[2 + len(SYNC_CODECS):]
    tokens, source, how = slow[1], row_text(texts[:TEXT_BYTES]), row_text(texts[TEXT_BYTES:])
    slowest = {c: max(e[2 + i] for e in every) for i, c in enumerate(SYNC_CODECS)}
    from smolforge.models.peft import peft_method

    return Measured(world=world, links=tuple(links), gather_mbit_s=gather, step_s=slow[0], params=sizes[0],
                    trainable_bytes=sizes[1], max_steps=cfg.max_steps, step_tokens=tokens, tokens_from=source,
                    step_from=how, sync_cpu_s=slowest, factored=peft_method(cfg.peft.method).factored)


def diloco_features() -> frozenset[str]:
    """What this build's diloco takes of issue 45's additions: "sparse" (the codec, item 2), "fragments"
    (streaming syncs, item 3) and "int4" (the codec); the plan keeps to those (int8, blocking syncs without
    them)."""
    from smolforge.errors import SmolforgeError
    from smolforge.parallel.strategies import strategy_class

    tries = {"sparse": {"codec": "sparse"}, "fragments": {"fragments": 2, "overlap": 1}, "int4": {"codec": "int4"}}
    has = set()
    for feature, settings in tries.items():
        try:
            strategy_class("diloco").check_settings(settings)
            has.add(feature)
        except (ValueError, SmolforgeError):
            pass
    return frozenset(has)


def resolve(plan: "RankPlan", world: int, emit: Callable[[dict], None] | None = None,
            train: "TrainConfig | None" = None) -> "RankPlan":
    """The plan with `auto` replaced by the strategy measured and decided here (any other plan as is).
    `emit` (rank 0's): the decision as a `strategy_plan` job event, its numbers in the event's data.
    `train`: the run as this rank runs it (its node's copy of the model), default the plan's."""
    if plan.strategy != "auto":
        return plan
    from smolforge.parallel.strategies import strategy_class

    knobs = plan.strategy_config
    measured = measure(train or plan.train, knobs.get("probe_mb", 4.0), world) if world > 1 else None
    if measured is None:
        decision = Decision("ddp", {}, "the model's size is not known here: ddp" if world > 1
                            else "one rank: nothing to share", {"world": world})
    else:
        decision = decide(measured, budget=knobs.get("budget", 0.10), has=diloco_features(),
                          max_h=knobs.get("max_inner_steps", 500))
    if emit is not None:
        emit({"type": "event", "kind": "strategy_plan", "message": f"auto chose {decision.reason}",
              "data": {"event": "strategy_plan", **decision.to_dict(),
                       "links": [vars(s) for s in (measured.links if measured else ())]}})
    return replace(plan, strategy=decision.strategy,
                   strategy_config=strategy_class(decision.strategy).settings_dict(decision.config))
