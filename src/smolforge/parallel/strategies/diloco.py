"""DiLoCo (arXiv 2311.08105): H local steps per worker, then one outer step on the averaged pseudo-gradient.

Each rank trains its own copy with its own optimizer (AdamW) on its own slice of every global batch,
talking to nobody. Every `inner_steps` (H) steps the ranks average their pseudo-gradients
(round-start weights - current weights) and an outer optimizer (SGD with Nesterov momentum, lr 0.7
and momentum 0.9 by default, as in the paper) moves the shared weights; every rank then starts the
next round from them. Gradients cross the network once per H steps instead of every step.

- The average is weighted by each rank's loss tokens in the round, so with H = 1, outer lr 1.0, no
  momentum and a linear inner optimizer (SGD) the result is exactly DDP's step (a test checks it).
- `codec`: how pseudo-gradients travel (`smolforge.parallel.codecs`). `fp32` (an all-reduce), or a lossy
  codec whose parts every rank gathers and sums exactly as sent (`Codec.aggregate`): `fp16`, `int8` or
  `int4` (blockwise absmax, one fp32 scale per `block` values; int4 half int8's bytes) or `sparse` (SparseLoCo: per `chunk` values the
  `topk` largest at `bits` bits; ~0.9 % of fp32 at its defaults, and no outer momentum unless set).
  Each rank keeps an error-feedback buffer: what a round's message could not carry is added to the
  next round's pseudo-gradient, so nothing is lost, only delayed.
- Checkpoints and pauses land on outer steps (`at_boundary`), where every rank holds the shared
  weights; each rank's inner optimizer state and error-feedback buffer are kept (gathered as tensors,
  never pickled), so a resumed job continues bitwise as an uninterrupted one (the same world size; a
  resume with another one starts the buffers at zero).
- `fragments` / `overlap` (Streaming DiLoCo, `diloco_stream.py`): the model synced one fragment at a
  time on a staggered schedule, each merged `overlap` steps after its send while the ranks train on;
  checkpoints land where no fragment is in flight and keep every rank's own weights. `fragments` 1 and
  `overlap` 0 (the defaults) are the whole-model blocking sync above, bitwise (a test keeps it so).
  `merge`: how a fragment lands τ steps after its send, mixed (`mix`, the paper's) or `delta` (the new
  global weights plus the τ steps' own progress).
- `inner_steps_by_speed` (`diloco_speeds.py`): each rank's inner steps per round follow its measured
  speed (a round is H global steps' rows, shared out by rate), so a slow node does not hold a fast one.
- Elastic membership (as torchft and prime-diloco do): a collective that fails because a peer is
  gone (its process or machine died) re-forms the group with the members left, through the job's
  membership service (`membership`, given by the worker glue; see `cluster/workloads/data_parallel/job_control.py`), and is
  run again; the survivors carry on from where they are, without a restart from a checkpoint, and
  the lost member's current round is all that is lost. A member that joins a running job waits
  (`start_at`) until the others reach an outer step, then everyone re-forms the group with it and
  rank 0 sends the step, the round and the shared weights and outer momentum; it starts with a fresh
  inner optimizer. The rows of each global batch are split among whoever is a member, so the global
  batch stays the same. Rank 0 (which writes checkpoints and the adapter) leaving is the exception:
  the job then restarts from its last checkpoint, as a synchronous one does.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Literal, TypeVar

import torch
import torch.distributed as dist
from pydantic import ConfigDict, Field, model_validator

from smolforge.parallel.codec_settings import CodecFields
from smolforge.parallel.codecs import CODECS, Codec, ErrorFeedback, make_codec, pack_pieces, unpack_payload
from smolforge.parallel.rendezvous import init_group, leave_group
from smolforge.parallel.strategies.ddp import DDP
from smolforge.parallel.strategies.diloco_speeds import SpeedPlan
from smolforge.parallel.strategies.diloco_stream import (Averaged, Flight, Fragment, fill_pseudo_gradient,
                                                         make_fragments, merge_into, offsets,
                                                         outer_step, pseudo_gradient, snapshot)
from smolforge.train import balance
from smolforge.train.rank_context import Membership, RankContext
from smolforge.train.strategy import Strategy

T = TypeVar("T")
MAX_REGROUPS = 4  # re-formations in a row for one collective before its error is let through
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused",
             "Timed out", "timed out", "Socket Timeout", "No route to host")



class DiLoCoSettings(CodecFields):
    """`strategy_config` of `diloco` (`--set strategy_config.KEY=VALUE`); the codec's fields are `CodecFields`'."""

    model_config = ConfigDict(extra="forbid")
    inner_steps: int = Field(20, ge=1, description="H: local steps between outer steps")
    outer_lr: float = Field(0.7, gt=0)
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="0.9; 0 with codec sparse unless set")
    nesterov: bool = True

    # Streaming DiLoCo (diloco_stream.py): fragments synced on a staggered schedule, overlapped with compute
    fragments: int = Field(1, ge=1, le=64, description="parameter groups synced in turn (1: the whole model)")
    overlap: int = Field(0, ge=0, description="tau: inner steps from a fragment's send to its merge (0: blocking)")
    mix: float = Field(0.5, ge=0, lt=1, description="overlap > 0: merge as local <- mix local + (1 - mix) global")
    merge: Literal["mix", "delta"] = Field("mix", description="overlap > 0: `mix` (Streaming DiLoCo's), or `delta`: "
                                           "local <- global + the steps' own progress since the send")
    background: bool = Field(True, description="overlap > 0: send from a thread (False: at send time, blocking)")
    inner_steps_by_speed: bool = Field(False, description="inner steps per round follow each rank's measured speed")

    @model_validator(mode="after")
    def _codec_defaults(self) -> "DiLoCoSettings":
        momentum = CODECS[self.codec].momentum  # sparse: error feedback in place of outer momentum
        if momentum is not None and "outer_momentum" not in self.model_fields_set:
            self.outer_momentum = momentum
        return self

    @model_validator(mode="after")
    def _schedule(self) -> "DiLoCoSettings":
        if self.fragments > self.inner_steps:
            raise ValueError(f"fragments ({self.fragments}) must not exceed inner_steps ({self.inner_steps}): "
                             "each fragment needs its own step of the H-step cycle")
        if self.overlap and self.overlap >= self.inner_steps // self.fragments:
            raise ValueError(f"overlap ({self.overlap}) must be under inner_steps // fragments "
                             f"({self.inner_steps // self.fragments}): a fragment lands before the next is sent, "
                             "so checkpoints have steps with nothing in flight")
        if self.inner_steps_by_speed and (self.fragments > 1 or self.overlap):
            raise ValueError("inner_steps_by_speed takes whole-model blocking syncs (fragments 1, overlap 0)")
        return self


class DiLoCo(SpeedPlan, DDP):
    name = "diloco"
    balances = False  # inner steps are local; uneven rows would change each rank's own AdamW path
    elastic = True  # members may leave (a rank dies) or join (at an outer step) without a restart

    Settings = None  # set below: DiLoCoSettings

    def __init__(self, context: RankContext | None = None, **config: Any):
        settings = DiLoCoSettings(**config)
        super().__init__(context)
        self.config = settings.model_dump()
        self.inner_steps, self.codec = settings.inner_steps, settings.codec
        self.feedback = ErrorFeedback(make_codec(settings.codec, **self.config))  # this rank's residual
        self._residuals: list[torch.Tensor] | None = None  # every rank's, gathered for a checkpoint
        self.ended = False  # every step taken and every rank on the shared weights (`finish`)
        self.round_ended = False  # fragment 0 merged at the step just taken: `agree` meets the others there
        self.held_code = 0  # a stop code asked since the last round's end (`agree`)
        self.outer_lr, self.outer_momentum = settings.outer_lr, settings.outer_momentum
        self.nesterov = settings.nesterov and self.outer_momentum > 0
        self.overlap, self.mix, self.background = settings.overlap, settings.mix, settings.background
        self.delta = settings.merge == "delta" and self.overlap > 0  # `merge_into` with the send's snapshot
        self.by_speed = settings.inner_steps_by_speed
        # Fragment f's steps since its last send and its loss tokens since then (fragment 0: the whole model
        # when fragments == 1, today's round); its first send comes after H - offset_f steps
        self.since = [(self.inner_steps - o) % self.inner_steps for o in offsets(self.inner_steps, settings.fragments)]
        self.targets = [0.0] * settings.fragments
        self.streamed = settings.fragments > 1 or self.overlap > 0  # ranks' local weights differ at checkpoints
        self.sync_group: Any = None  # a background transfer's own process group
        self.frags: list[Fragment] = []
        self._count_lock = threading.Lock()  # a background transfer counts its bytes from its thread
        self.rounds, self.syncs, self.background_syncs = 0, 0, 0
        # a sync's seconds on this rank by kind (`_timed`): "cpu", the pseudo-gradient, the codec, the sum of
        # the parts, the outer step and the merge; "transfer", inside the collectives (a peer's lateness too)
        self.sync_s = {"cpu": 0.0, "transfer": 0.0}
        self.params: list[torch.nn.Parameter] = []
        self._pending: dict[str, Any] = {}
        # elastic membership, from the context the worker glue (smolforge.cluster.workloads.data_parallel.rank) gives
        self.membership: Membership | None = self.context.membership  # .regroup(epoch), .joiners_waiting()
        self.member = self.context.member  # this rank's id in the job: its first rank, or a new id for a joiner
        self.nominal_world = self.context.world  # ranks the job started with (the global batch is per_rank times this)
        self.epoch = 0  # how many times the group was re-formed
        self.admit_next = False  # joiners wait: take them in as the next step starts
        self.last_step = 0

    joins_later = True  # read by DDP.__init__: a joiner has no process group yet

    @property
    def round_steps(self) -> int:
        """Steps since the last (whole-model, or fragment 0's) sync."""
        return self.since[0]

    @property
    def round_targets(self) -> float:
        return self.targets[0]

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else self.member

    @property
    def world(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else self.nominal_world

    def rows_for(self, step: int, total: int) -> tuple[int, int]:
        """The step's rows split evenly among the current members (fewer members: more rows each).

        Joiners are taken in here, as a step starts and before any of its collectives: a joiner's
        first step is then the others' next one, and every member runs the same collectives."""
        if self.by_speed:
            return self._speed_rows(total)
        if self.admit_next:
            self.admit_next = False
            self._regroup("a member joins", admit=True)
        shares = balance.split_rows([1.0] * self.world, total)
        return sum(shares[:self.rank]), shares[self.rank]

    # -- the inner steps: local ---------------------------------------------------------------------

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        self.device = device
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.frags = make_fragments(self.params, len(self.since))
        # one outer optimizer over every fragment's shared weights: a step moves those that have a gradient
        self.outer = torch.optim.SGD([f.shared for f in self.frags], lr=self.outer_lr, momentum=self.outer_momentum,
                                     nesterov=self.nesterov)
        for frag in self.frags:  # each fragment its own error-feedback stream (one: the strategy's own)
            frag.feedback = (self.feedback if len(self.frags) == 1
                             else ErrorFeedback(make_codec(self.codec, **self.config)))
        self._new_sync_group()
        if self._pending:
            self._restore(self._pending)
        return model  # no DDP: gradients stay on this rank

    def accumulate(self, wrapped: torch.nn.Module, last: bool) -> ContextManager:
        return Strategy.accumulate(self, wrapped, last)

    def step_reduce(self, values: list[float], device: torch.device) -> list[float]:
        return list(values)

    @property
    def step_ranks(self) -> int:
        return 1

    def after_step(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                   targets: float = 0.0) -> None:
        """Count the step for every fragment; merge the flights due now, then send the fragments due now
        (fragments 1 and overlap 0: the whole model, sent and merged at once every H steps, as before)."""
        self.last_step = step
        for f in range(len(self.frags)):
            self.since[f] += 1
            self.targets[f] += targets
        if self.by_speed:
            if self._speed_after(targets):
                self._send(0, step)
            return
        for f, frag in enumerate(self.frags):
            if frag.flight is not None and frag.merge_at <= step:
                self._merge(f)
        for f in range(len(self.frags)):
            if self.since[f] >= self.inner_steps:
                self._send(f, step)

    def at_boundary(self, step: int) -> bool:
        """Where a checkpoint or pause may land: no fragment in flight and, for whole-model blocking syncs,
        right after one (every rank then holds the shared weights). Streamed syncs keep every rank's own
        weights in the checkpoint instead (`optimizer_state` gathers them): any step with nothing in flight."""
        if any(frag.flight is not None for frag in self.frags):
            return False
        return self.streamed or self.round_steps == 0

    def next_step(self, done: int, steps: int) -> int | None:
        if self.by_speed:
            return self._speed_next(done, steps)
        return super().next_step(done, steps)

    def agree(self, code: int, device: torch.device) -> int:
        """A stop code (pause, cancel) and whether a joiner waits, agreed once a round: at the step fragment 0
        merged (the whole model's sync, blocking; by speed, the round's end), after the step's hooks, so a
        member that left there (`job leave`) is found by this collective and the others re-form at once.
        Held until then, so between syncs the ranks share no collective and none waits for another's step.
        Agreeing every step made every step wait for the slower rank's (stop 58, BENCHMARKS.md); agreeing
        at every fragment's send made streamed ranks (4 fragments) wait for each other every H ÷ 4 steps,
        where the transfers themselves wait for nobody for τ steps (stop 61). A pause then lands at the
        first boundary (`at_boundary`) from there; a cancel waits for the round's end."""
        self.held_code = max(self.held_code, code)
        if not self.round_ended:
            return 0
        self.round_ended = False
        code, joiners = self._collective(lambda: self._agree_round(device))
        self.held_code = 0
        if joiners:
            self.admit_next = True  # at the start of the next step (after a checkpoint or a pause here)
        return code

    def _agree_round(self, device: torch.device) -> tuple[int, bool]:
        """(the highest held stop code, whether any member sees a joiner waiting): one all-reduce."""
        waiting = self.membership is not None and self.membership.joiners_waiting()
        t = torch.tensor([self.held_code, int(waiting)], device=device)
        self._count(t)
        with self.waiting():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t[0]), bool(t[1])

    def finish(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Land what is in flight, then a short last round of every fragment not just synced, merged
        whole (not mixed): every rank ends with the same weights."""
        for f, frag in enumerate(self.frags):
            if frag.flight is not None:  # no step since its send: replaced, so the ranks end equal
                self._merge(f, mix=None if self.since[f] else 0.0)
        for f in range(len(self.frags)):
            if self.since[f]:
                self._send(f, self.last_step, now=True)
        self.ended = True  # the checkpoint that follows is the run's last (`_gather_optimizer_state`)

    # -- the outer step -------------------------------------------------------------------------------

    def _flat(self, frag: Fragment | None = None) -> torch.Tensor:
        params = self.params if frag is None else self.params[frag.first:frag.last]
        return torch.cat([p.detach().float().reshape(-1) for p in params])

    @torch.no_grad()
    def _send(self, f: int, step: int, now: bool = False) -> None:
        """Fragment f's token-weighted pseudo-gradient goes out (through the codec, `_average`): in the
        background, or blocking; merged `overlap` steps later (`now`, or overlap 0: merged here)."""
        frag = self.frags[f]
        weight = max(self.targets[f], 1.0)  # this rank's pseudo-gradient's weight: its loss tokens
        coder = frag.feedback.coder
        delta, message = None, None
        with self._timed("cpu"):  # a lossy codec's message is made now, piece by piece from the parameters
            if coder.summable:
                delta = pseudo_gradient(self.params, frag)
            else:
                fill = fill_pseudo_gradient(self.params, frag)
                message = pack_pieces(frag.feedback.encode_pieces(frag.end - frag.start, fill))
        self.since[f], self.targets[f] = 0, 0.0

        def average() -> Averaged:  # run again as it is after a regroup: the same message, another group
            return self._average(coder, weight, delta, message)

        now = now or not self.overlap
        if self.delta and not now:
            frag.meta["sent"] = snapshot(self.params, frag)
        self.syncs += 1
        if not now and self.background:
            self.background_syncs += 1
            frag.flight = Flight(average, background=True)
        else:
            with self.waiting():
                frag.flight = Flight(average, background=False, done=self._collective(average))
        frag.merge_at, frag.meta["weight"] = step + self.overlap, weight
        if now:
            self._merge(f, mix=0.0)

    @torch.no_grad()
    def _merge(self, f: int, mix: float | None = None) -> None:
        """Fragment f's outer step from its averaged pseudo-gradient, then into the local weights."""
        frag = self.frags[f]
        with self.waiting():
            mean = self._collective(frag.flight.wait)
        frag.flight = None
        with self._timed("cpu"):  # the ranks' messages summed a piece at a time, into the outer step
            outer_step(self.outer, frag.shared, mean.piece, mean.unit)
            sent = frag.meta.pop("sent", None)
            if mix is None and self.overlap:
                merge_into(self.params, frag, self.mix, sent=sent)
            else:
                merge_into(self.params, frag, mix or 0.0)
        if f:
            return
        self.rounds += 1
        self.round_ended = True  # `agree`, after this step's hooks
        if self.by_speed:
            self._replan(frag.meta["weight"])

    def metrics(self) -> dict[str, float]:
        """Fragment syncs sent, how many of them ran in the background (streamed syncs), and this rank's
        seconds in them so far: `sync_cpu_s` (its own passes over the values, which on a CPU node take the
        cores compute would use) and `sync_transfer_s` (inside the collectives, a slower peer included):
        the two parts `--strategy auto` plans with (`auto_choice.Measured.sync_cpu_s` and the link)."""
        return {"fragment_syncs": float(self.syncs), "background_syncs": float(self.background_syncs),
                "sync_cpu_s": round(self.sync_s["cpu"], 4), "sync_transfer_s": round(self.sync_s["transfer"], 4)}

    @contextmanager
    def _timed(self, kind: str) -> Iterator[None]:
        """Add the block's wall seconds to `sync_s[kind]` (a background sync's thread too)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            with self._count_lock:
                self.sync_s[kind] += time.perf_counter() - t0

    def _count(self, tensor: torch.Tensor, checkpoint: bool = False) -> None:
        with self._count_lock:
            super()._count(tensor, checkpoint)

    def _new_sync_group(self) -> None:
        """Background transfers get their own process group (made by every member at once: in `wrap`
        and after a regroup), so they never interleave with the training thread's collectives."""
        if self.overlap and self.background and dist.is_initialized():
            self.sync_group = dist.new_group()

    # -- elastic membership -------------------------------------------------------------------------

    def start_at(self, step: int) -> int:
        """A joiner waits until the others take it in at an outer step, then starts at their step."""
        if self.membership is None or dist.is_initialized():
            return step
        self._regroup("joining", admit=True)
        return self.last_step

    def _collective(self, fn: Callable[[], T]) -> T:
        """Run a collective; when a peer is gone, re-form the group with the members left and run it again."""
        for _ in range(MAX_REGROUPS):
            try:
                return fn()
            except RuntimeError as err:
                if self.membership is None or not any(s in str(err) for s in PEER_LOST):
                    raise
                self._regroup("lost a peer: " + str(err).split(". ")[0][-160:])
        return fn()

    def _regroup(self, why: str, admit: bool = False) -> None:
        """Re-form the group (`admit`: with the members waiting to join; a lost peer alone does not
        take them in, so nobody enters in the middle of a step's collectives)."""
        joining = not dist.is_initialized()
        for frag in self.frags:
            if frag.flight is not None:
                frag.flight.drain()  # its thread fails or ends before its group is torn down
        view = self.membership.regroup(None if joining else self.epoch + 1, admit)
        leave_group()
        members = view["members"]
        init_group(view["backend"], view["addr"][0], view["addr"][1], members.index(self.member), len(members),
                   view["timeout_s"], view["secret"], view.get("listen"))
        self.epoch = view["epoch"]
        self._sync(joining)
        self._new_sync_group()
        self.rates = None  # a new group: the next by-speed round splits evenly until measured again
        if self.is_main:
            self.notes.append({"kind": "regroup", "members": members, "joined": view.get("joined", []),
                               "step": self.last_step, "why": why})

    def _residual(self) -> torch.Tensor:
        """This rank's error-feedback residuals, every fragment's in place (zeros where none yet)."""
        return torch.cat([torch.zeros(frag.end - frag.start) if frag.feedback.residual is None
                          else frag.feedback.residual for frag in self.frags])

    def _momentum(self, frag: Fragment) -> torch.Tensor | None:
        return self.outer.state.get(frag.shared, {}).get("momentum_buffer")

    @torch.no_grad()
    def _sync(self, joining: bool) -> None:
        """Rank 0's step, round positions, shared weights and outer momentum to every member (a joiner
        starts from them; the others already hold the same)."""
        moms = [self._momentum(frag) for frag in self.frags]
        header = torch.tensor([self.last_step, self.rounds, *self.since, *(m is not None for m in moms)],
                              dtype=torch.float64, device=self.device)
        dist.broadcast(header, 0)
        n = len(self.frags)
        for f, frag in enumerate(self.frags):
            dist.broadcast(frag.shared.data, 0)
            if header[2 + n + f]:
                buf = moms[f] if moms[f] is not None else torch.zeros_like(frag.shared)
                dist.broadcast(buf, 0)
                self.outer.state[frag.shared]["momentum_buffer"] = buf
        if joining:
            self.last_step, self.rounds = int(header[0]), int(header[1])
            self.since, self.targets = [int(v) for v in header[2:2 + n].tolist()], [0.0] * n
            for frag in self.frags:
                merge_into(self.params, frag, 0.0)

    def reduce(self, values: list[float], device: torch.device) -> list[float]:
        if self.by_speed:  # no collective between outer steps: rank 0 evaluates on every row (`shard`)
            return list(values)
        return self._collective(lambda: DDP.reduce(self, values, device))

    def shard(self, items: list) -> list:
        if self.by_speed:
            return list(items) if self.is_main else []
        return super().shard(items)

    def barrier(self) -> None:
        self._collective(lambda: DDP.barrier(self))

    def gather_rng(self) -> list[torch.Tensor] | None:
        return self._collective(lambda: DDP.gather_rng(self))

    def _average(self, coder: Codec, weight: float, delta: torch.Tensor | None,
                 message: tuple[torch.Tensor, dict] | None) -> Averaged:
        """The ranks' pseudo-gradients averaged with their `weight`s: for a codec whose payloads sum in
        transit (fp32) an all-reduce of the weighted values (`delta`, unweighted); else every rank's
        `message` (`pack_pieces`: one uint8 buffer, encoded unweighted, since fp16 overflows at 65504 and
        the residual keeps its units) gathered, to be summed by the codec exactly as sent, each part
        weighted by its share of the weights, a piece at a time by the outer step (`Averaged.piece`)."""
        if coder.summable:
            with self._timed("cpu"):
                packed = torch.empty(delta.numel() + 1)
                torch.mul(delta, weight, out=packed[:-1])
                packed[-1] = weight
            self._count(packed)
            with self._timed("transfer"):
                dist.all_reduce(packed, group=self.sync_group)
            with self._timed("cpu"):
                return Averaged(coder, values=packed[:-1].div_(packed[-1]))
        weights = torch.tensor([weight], dtype=torch.float64)
        with self._timed("transfer"):
            every_w = [float(w) for w in self._gather(weights, group=self.sync_group)]
            every = self._gather(message[0], group=self.sync_group)
        parts = [unpack_payload(b, message[1]) for b in every]  # views of the buffers
        return Averaged(coder, parts=parts, weights=[w / sum(every_w) for w in every_w])

    def _gather(self, t: torch.Tensor, checkpoint: bool = False, group: Any = None) -> list[torch.Tensor]:
        every = [torch.empty_like(t) for _ in range(self.world)]
        self._count(t, checkpoint)
        dist.all_gather(every, t, group=group)
        return every

    # -- checkpoints ------------------------------------------------------------------------------

    def optimizer_state(self, optimizer: torch.optim.Optimizer, spool_dir: Path | None = None) -> dict[str, Any] | None:
        """Every rank's own inner optimizer state, gathered as tensors (never pickled) onto rank 0."""
        return self._collective(lambda: self._gather_optimizer_state(optimizer))

    def _gather_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        mine = optimizer.state_dict()
        if self.ended:  # the run's last checkpoint: nothing crosses the link (see `state_dict`)
            self._gathered, self._residuals = {}, None  # an earlier checkpoint's are not this one's
            return {"per_rank": [mine]} if self.is_main else None
        per_rank = [{"state": {}, "param_groups": mine["param_groups"]} for _ in range(self.world)]
        for idx in sorted(mine["state"]):
            for key in sorted(mine["state"][idx]):
                value = mine["state"][idx][key]
                for r, t in enumerate(self._gather(value.reshape(-1).contiguous(), checkpoint=True)):
                    per_rank[r]["state"].setdefault(idx, {})[key] = t.view(value.shape)
        if self.streamed:  # each rank's own weights and tokens since each fragment's send: for state_dict
            targets = torch.tensor(self.targets, dtype=torch.float64, device=self.device)
            self._gathered = {"local": self._gather(self._flat(), checkpoint=True),
                              "targets": self._gather(targets, checkpoint=True)}
        if self.feedback.coder.lossy:  # each rank's error-feedback buffers (zeros: none yet), for state_dict
            every = self._gather(self._residual().contiguous(), checkpoint=True)
            self._residuals = every if self.is_main else None  # only the main rank writes them
        return {"per_rank": per_rank} if self.is_main else None

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        if "per_rank" in state:
            parts = state["per_rank"]
            state = parts[self.rank] if len(parts) == self.world else parts[0]
        optimizer.load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        """Rounds and outer momentum (per fragment); the by-speed rates; streamed syncs: the shared weights,
        each fragment's position and every rank's own weights and tokens (gathered by `optimizer_state`,
        which a checkpoint calls first), so a resume is exact.

        The run's last checkpoint (after `finish`: every rank holds the shared weights) keeps rank 0's inner
        optimizer state only, and no error-feedback buffers or local weights, marked `ended`: gathering
        every rank's AdamW moments and residual crossed the link for 1.3 GB a rank with llama-100m, 9-15
        minutes after training at 20 Mbit/s (BENCHMARKS.md, scale-out), for a state only a run extended
        past its end would read. Such a run starts every rank from rank 0's moments and empty buffers, said
        in its notes."""
        out: dict[str, Any] = {"rounds": self.rounds}
        if self.ended:
            out["ended"] = True
        for f, frag in enumerate(self.frags):
            momentum = self._momentum(frag)
            if momentum is not None:
                out["outer_momentum_buffer" + (f".{f}" if f else "")] = momentum.clone()
        if self.rates is not None:
            out["rates"] = list(self.rates)
        if self.streamed:
            out.update(since=list(self.since), shared=[frag.shared.detach().clone() for frag in self.frags],
                       **getattr(self, "_gathered", {}))
        if self._residuals is not None:  # gathered by optimizer_state, the collective before this call
            out["error_feedback"], self._residuals = self._residuals, None
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending = dict(state)  # applied in wrap(), once the outer optimizer exists

    @torch.no_grad()
    def _restore(self, state: dict[str, Any]) -> None:
        self.rounds = int(state.get("rounds", 0))
        if state.get("ended") and self.world > 1 and self.is_main:
            self.notes.append({"kind": "diloco_extended", "message": "resumed from the run's last checkpoint, "
                               "which keeps rank 0's inner optimizer state only: every rank starts from it, "
                               "with empty error-feedback buffers"})
        self.rates = state.get("rates")
        for f, frag in enumerate(self.frags):
            key = "outer_momentum_buffer" + (f".{f}" if f else "")
            if key in state:
                self.outer.state[frag.shared]["momentum_buffer"] = state[key].clone()
        if self.streamed and "shared" in state and len(state["shared"]) == len(self.frags):
            for frag, shared in zip(self.frags, state["shared"]):
                frag.shared.copy_(shared)
            self.since = [int(v) for v in state["since"]]
            if len(state.get("local", [])) == self.world:  # the same ranks: each its own weights back
                local, offset = state["local"][self.rank], 0
                for p in self.params:
                    p.copy_(local[offset:offset + p.numel()].view_as(p).to(p.dtype))
                    offset += p.numel()
                self.targets = [float(v) for v in state["targets"][self.rank].tolist()]
        errors = state.get("error_feedback") or []
        # each rank its own buffers; another world size cannot replay them: they start at zero
        mine = errors[self.rank] if len(errors) == self.world else None
        for frag in self.frags:
            frag.feedback.load(None if mine is None else mine[frag.start:frag.end])


DiLoCo.Settings = DiLoCoSettings
