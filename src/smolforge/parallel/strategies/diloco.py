"""DiLoCo (arXiv 2311.08105): H local steps per worker, then one outer step on the averaged pseudo-gradient.

Each rank trains its own copy with its own optimizer (AdamW) on its own slice of every global batch,
talking to nobody. Every `inner_steps` (H) steps the ranks average their pseudo-gradients
(round-start weights - current weights) and an outer optimizer (SGD with Nesterov momentum, lr 0.7
and momentum 0.9 by default, as in the paper) moves the shared weights; every rank then starts the
next round from them. Gradients cross the network once per H steps instead of every step.

- The average is weighted by each rank's loss tokens in the round, so with H = 1, outer lr 1.0, no
  momentum and a linear inner optimizer (SGD) the result is exactly DDP's step (a test checks it).
- `codec`: how pseudo-gradients travel (`smolforge.parallel.codecs`). `fp32` (an all-reduce), or a lossy
  codec whose parts every rank gathers and sums exactly as sent (`Codec.aggregate`): `fp16`, `int8`
  (blockwise absmax, one fp32 scale per `block` values) or `sparse` (SparseLoCo: per `chunk` values the
  `topk` largest at `bits` bits; ~0.9 % of fp32 at its defaults, and no outer momentum unless set).
  Each rank keeps an error-feedback buffer: what a round's message could not carry is added to the
  next round's pseudo-gradient, so nothing is lost, only delayed.
- Checkpoints and pauses land on outer steps (`at_boundary`), where every rank holds the shared
  weights; each rank's inner optimizer state and error-feedback buffer are kept (gathered as tensors,
  never pickled), so a resumed job continues bitwise as an uninterrupted one (the same world size; a
  resume with another one starts the buffers at zero).
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

from pathlib import Path
from typing import Any, Callable, ContextManager, Literal, TypeVar

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from smolforge.parallel.codecs import CODECS, ErrorFeedback, make_codec, pack_payload, unpack_payload
from smolforge.parallel.rendezvous import init_group, leave_group
from smolforge.parallel.strategies.ddp import DDP
from smolforge.train import balance
from smolforge.train.rank_context import Membership, RankContext
from smolforge.train.strategy import Strategy

T = TypeVar("T")
MAX_REGROUPS = 4  # re-formations in a row for one collective before its error is let through
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused",
             "Timed out", "timed out", "Socket Timeout", "No route to host")



class DiLoCoSettings(BaseModel):
    """`strategy_config` of `diloco` (`--set strategy_config.KEY=VALUE`)."""

    model_config = ConfigDict(extra="forbid")
    inner_steps: int = Field(20, ge=1, description="H: local steps between outer steps")
    outer_lr: float = Field(0.7, gt=0)
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="0.9; 0 with codec sparse unless set")
    nesterov: bool = True
    codec: str = Field("fp32", description="how pseudo-gradients travel: " + ", ".join(CODECS))
    # bounded like the parameter-server strategies: the codec pads every message to a whole block, so
    # an unbounded one made a pseudo-gradient of a few values cost megabytes
    block: int = Field(256, ge=64, le=4096, description="int8: values per fp32 scale")
    chunk: int = Field(4096, ge=64, le=65536, description="sparse: values per chunk (positions as uint16)")
    topk: int = Field(64, ge=1, description="sparse: values sent per chunk (64 of 4096: 1.6 %)")
    bits: Literal[2, 4] = Field(2, description="sparse: bits per value sent")

    @field_validator("codec")
    @classmethod
    def _known_codec(cls, v: str) -> str:
        if v not in CODECS:
            raise ValueError(f"unknown codec {v!r} (one of {', '.join(CODECS)})")
        return v

    @model_validator(mode="after")
    def _codec_defaults(self) -> "DiLoCoSettings":
        if self.topk > self.chunk:
            raise ValueError(f"topk {self.topk} is more than a chunk ({self.chunk})")
        momentum = CODECS[self.codec].momentum  # sparse: error feedback in place of outer momentum
        if momentum is not None and "outer_momentum" not in self.model_fields_set:
            self.outer_momentum = momentum
        return self


class DiLoCo(DDP):
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
        self.outer_lr, self.outer_momentum = settings.outer_lr, settings.outer_momentum
        self.nesterov = settings.nesterov and self.outer_momentum > 0
        self.rounds, self.round_steps, self.round_targets = 0, 0, 0.0
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
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else self.member

    @property
    def world(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else self.nominal_world

    def rows_for(self, step: int, total: int) -> tuple[int, int]:
        """The step's rows split evenly among the current members (fewer members: more rows each).

        Joiners are taken in here, as a step starts and before any of its collectives: a joiner's
        first step is then the others' next one, and every member runs the same collectives."""
        if self.admit_next:
            self.admit_next = False
            self._regroup("a member joins", admit=True)
        shares = balance.split_rows([1.0] * self.world, total)
        return sum(shares[:self.rank]), shares[self.rank]

    # -- the inner steps: local ---------------------------------------------------------------------

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        self.device = device
        self.params = [p for p in model.parameters() if p.requires_grad]
        with torch.no_grad():
            self.shared = torch.nn.Parameter(self._flat(), requires_grad=False)
        self.outer = torch.optim.SGD([self.shared], lr=self.outer_lr, momentum=self.outer_momentum,
                                     nesterov=self.nesterov)
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
        self.last_step = step
        self.round_steps += 1
        self.round_targets += targets
        if self.round_steps >= self.inner_steps:
            self._outer_step()

    def at_boundary(self, step: int) -> bool:
        return self.round_steps == 0

    def finish(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self.round_steps:
            self._outer_step()  # a short last round: every rank ends with the same weights

    # -- the outer step -------------------------------------------------------------------------------

    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().float().reshape(-1) for p in self.params])

    @torch.no_grad()
    def _outer_step(self) -> None:
        weight = max(self.round_targets, 1.0)
        delta = (self.shared - self._flat()) * weight  # this rank's pseudo-gradient, token-weighted
        residual = self.feedback.residual

        def average() -> tuple[float, torch.Tensor]:
            self.feedback.load(residual)  # a retry in a re-formed group starts from the same residual
            return self._average(delta, weight)

        with self.waiting():
            total, avg = self._collective(average)
        self.shared.grad = avg / total
        self.outer.step()
        self.shared.grad = None
        offset = 0
        for p in self.params:
            n = p.numel()
            p.copy_(self.shared[offset:offset + n].view_as(p).to(p.dtype))
            offset += n
        self.rounds += 1
        self.round_steps, self.round_targets = 0, 0.0
        if self.membership is not None and self._collective(self._joiners_waiting):
            self.admit_next = True  # at the start of the next step (after a checkpoint or a pause here)

    # -- elastic membership -------------------------------------------------------------------------

    def _joiners_waiting(self) -> bool:
        """Whether any member saw a joiner waiting: all re-form the group at this outer step, or none."""
        t = torch.tensor([int(self.membership.joiners_waiting())], device=self.device)
        self._count(t)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

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
        view = self.membership.regroup(None if joining else self.epoch + 1, admit)
        leave_group()
        members = view["members"]
        init_group(view["backend"], view["addr"][0], view["addr"][1], members.index(self.member), len(members),
                   view["timeout_s"], view["secret"], view.get("listen"))
        self.epoch = view["epoch"]
        self._sync(joining)
        if self.is_main:
            self.notes.append({"kind": "regroup", "members": members, "joined": view.get("joined", []),
                               "step": self.last_step, "why": why})

    @torch.no_grad()
    def _sync(self, joining: bool) -> None:
        """Rank 0's step, round position, shared weights and outer momentum to every member (a joiner
        starts from them; the others already hold the same)."""
        momentum = self.outer.state.get(self.shared, {}).get("momentum_buffer")
        header = torch.tensor([self.last_step, self.rounds, self.round_steps, momentum is not None],
                              dtype=torch.float64, device=self.device)
        dist.broadcast(header, 0)
        dist.broadcast(self.shared.data, 0)
        if header[3]:
            buf = momentum if momentum is not None else torch.zeros_like(self.shared)
            dist.broadcast(buf, 0)
            self.outer.state[self.shared]["momentum_buffer"] = buf
        if joining:
            self.last_step, self.rounds, self.round_steps = (int(v) for v in header[:3].tolist())
            self.round_targets = 0.0
            offset = 0
            for p in self.params:
                n = p.numel()
                p.copy_(self.shared[offset:offset + n].view_as(p).to(p.dtype))
                offset += n

    def reduce(self, values: list[float], device: torch.device) -> list[float]:
        return self._collective(lambda: DDP.reduce(self, values, device))

    def agree(self, code: int, device: torch.device) -> int:
        return self._collective(lambda: DDP.agree(self, code, device))

    def barrier(self) -> None:
        self._collective(lambda: DDP.barrier(self))

    def gather_rng(self) -> list[torch.Tensor] | None:
        return self._collective(lambda: DDP.gather_rng(self))

    def _average(self, delta: torch.Tensor, weight: float) -> tuple[float, torch.Tensor]:
        """(sum of the ranks' weights, sum of their weighted pseudo-gradients): an all-reduce for a codec
        whose payloads sum in transit (fp32), else every rank's message gathered (one uint8 buffer each)
        and summed by the codec, exactly as sent."""
        coder = self.feedback.coder
        if coder.summable:
            packed = torch.cat([delta, torch.tensor([weight])])
            self._count(packed)
            dist.all_reduce(packed)
            return float(packed[-1]), packed[:-1]
        weights = torch.tensor([weight], dtype=torch.float64)
        every_w = [float(w) for w in self._gather(weights)]
        # unweighted (fp16 overflows at 65504), and the residual is in the same units round after round
        payload = self.feedback.encode(delta / weight)
        parts = [unpack_payload(b, payload) for b in self._gather(pack_payload(payload))]
        return sum(every_w), coder.aggregate(parts, every_w, delta.numel())

    def _gather(self, t: torch.Tensor, checkpoint: bool = False) -> list[torch.Tensor]:
        every = [torch.empty_like(t) for _ in range(self.world)]
        self._count(t, checkpoint)
        dist.all_gather(every, t)
        return every

    # -- checkpoints ------------------------------------------------------------------------------

    def optimizer_state(self, optimizer: torch.optim.Optimizer, spool_dir: Path | None = None) -> dict[str, Any] | None:
        """Every rank's own inner optimizer state, gathered as tensors (never pickled) onto rank 0."""
        return self._collective(lambda: self._gather_optimizer_state(optimizer))

    def _gather_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        mine = optimizer.state_dict()
        per_rank = [{"state": {}, "param_groups": mine["param_groups"]} for _ in range(self.world)]
        for idx in sorted(mine["state"]):
            for key in sorted(mine["state"][idx]):
                value = mine["state"][idx][key]
                for r, t in enumerate(self._gather(value.reshape(-1).contiguous(), checkpoint=True)):
                    per_rank[r]["state"].setdefault(idx, {})[key] = t.view(value.shape)
        if self.feedback.coder.lossy:  # each rank's error-feedback buffer (zeros: none yet), for state_dict
            mine_error = self.feedback.residual
            mine_error = torch.zeros_like(self.shared) if mine_error is None else mine_error
            every = self._gather(mine_error.contiguous(), checkpoint=True)
            self._residuals = every if self.is_main else None  # only the main rank writes them
        return {"per_rank": per_rank} if self.is_main else None

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        if "per_rank" in state:
            parts = state["per_rank"]
            state = parts[self.rank] if len(parts) == self.world else parts[0]
        optimizer.load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rounds": self.rounds}
        momentum = self.outer.state.get(self.shared, {}).get("momentum_buffer")
        if momentum is not None:
            out["outer_momentum_buffer"] = momentum.clone()
        if self._residuals is not None:  # gathered by optimizer_state, the collective before this call
            out["error_feedback"], self._residuals = self._residuals, None
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending = dict(state)  # applied in wrap(), once the outer optimizer exists

    def _restore(self, state: dict[str, Any]) -> None:
        self.rounds = int(state.get("rounds", 0))
        if "outer_momentum_buffer" in state:
            self.outer.state[self.shared]["momentum_buffer"] = state["outer_momentum_buffer"].clone()
        errors = state.get("error_feedback") or []
        # each rank its own buffer; another world size cannot replay them: they start at zero
        self.feedback.load(errors[self.rank] if len(errors) == self.world else None)


DiLoCo.Settings = DiLoCoSettings
