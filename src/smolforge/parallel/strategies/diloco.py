"""DiLoCo (arXiv 2311.08105): H local steps per worker, then one outer step on the averaged pseudo-gradient.

Each rank trains its own copy with its own optimizer (AdamW) on its own slice of every global batch,
talking to nobody. Every `inner_steps` (H) steps the ranks average their pseudo-gradients
(round-start weights - current weights) and an outer optimizer (SGD with Nesterov momentum, lr 0.7
and momentum 0.9 by default, as in the paper) moves the shared weights; every rank then starts the
next round from them. Gradients cross the network once per H steps instead of every step.

- The average is weighted by each rank's loss tokens in the round, so with H = 1, outer lr 1.0, no
  momentum and a linear inner optimizer (SGD) the result is exactly DDP's step (a test checks it).
- `codec`: how pseudo-gradients travel. `fp32` (an all-reduce), `fp16`, or `int8`: blockwise absmax
  quantisation (one fp32 scale per `block` values) with error feedback: what a round's int8 could not
  carry is added to the next round's pseudo-gradient, so nothing is lost, only delayed.
- Checkpoints and pauses land on outer steps (`at_boundary`), where every rank holds the shared
  weights; each rank's inner optimizer state is kept (gathered as tensors, never pickled), so a
  resumed job continues exactly as an uninterrupted one (the int8 error buffers restart at zero).
"""

from __future__ import annotations

from typing import Any, ContextManager, Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

from smolforge.parallel.strategies.ddp import DDP
from smolforge.train.strategy import Strategy



class DiLoCoSettings(BaseModel):
    """`strategy_config` of `diloco` (`--set strategy_config.KEY=VALUE`)."""

    model_config = ConfigDict(extra="forbid")
    inner_steps: int = Field(20, ge=1, description="H: local steps between outer steps")
    outer_lr: float = Field(0.7, gt=0)
    outer_momentum: float = Field(0.9, ge=0, lt=1)
    nesterov: bool = True
    codec: Literal["fp32", "fp16", "int8"] = Field("fp32", description="how pseudo-gradients travel")
    block: int = Field(256, ge=8, description="int8: values per fp32 scale")


class DiLoCo(DDP):
    name = "diloco"

    Settings = None  # set below: DiLoCoSettings

    def __init__(self, **config: Any):
        settings = DiLoCoSettings(**config)
        super().__init__()
        self.config = settings.model_dump()
        self.inner_steps, self.codec, self.block = settings.inner_steps, settings.codec, settings.block
        self.outer_lr, self.outer_momentum = settings.outer_lr, settings.outer_momentum
        self.nesterov = settings.nesterov and self.outer_momentum > 0
        self.rounds, self.round_steps, self.round_targets = 0, 0, 0.0
        self.params: list[torch.nn.Parameter] = []
        self._pending: dict[str, Any] = {}

    # -- the inner steps: local ---------------------------------------------------------------------

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        self.params = [p for p in model.parameters() if p.requires_grad]
        with torch.no_grad():
            self.shared = torch.nn.Parameter(self._flat(), requires_grad=False)
        self.outer = torch.optim.SGD([self.shared], lr=self.outer_lr, momentum=self.outer_momentum,
                                     nesterov=self.nesterov)
        self.error = torch.zeros_like(self.shared) if self.codec == "int8" else None
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
        total, avg = self._average(delta, weight)
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

    def _average(self, delta: torch.Tensor, weight: float) -> tuple[float, torch.Tensor]:
        """(sum of the ranks' weights, sum of their weighted pseudo-gradients)."""
        if self.codec == "fp32":
            packed = torch.cat([delta, torch.tensor([weight])])
            self._count(packed)
            dist.all_reduce(packed)
            return float(packed[-1]), packed[:-1]
        weights = torch.tensor([weight], dtype=torch.float64)
        every_w = [torch.zeros_like(weights) for _ in range(self.world)]
        self._count(weights)
        dist.all_gather(every_w, weights)
        if self.codec == "fp16":
            # fp16 overflows at 65504: send the unweighted pseudo-gradient, weight it after decoding
            mine = (delta / weight).half()
            every = self._gather(mine)
            out = sum(t.float() * float(w) for t, w in zip(every, every_w))
        else:
            target = delta / weight + self.error
            q, scales = quantize_int8(target, self.block)
            self.error = target - dequantize_int8(q, scales, target.numel())
            qs, ss = self._gather(q), self._gather(scales)
            out = sum(dequantize_int8(a, b, target.numel()) * float(w) for a, b, w in zip(qs, ss, every_w))
        return float(sum(float(w) for w in every_w)), out

    def _gather(self, t: torch.Tensor, checkpoint: bool = False) -> list[torch.Tensor]:
        every = [torch.empty_like(t) for _ in range(self.world)]
        self._count(t, checkpoint)
        dist.all_gather(every, t)
        return every

    # -- checkpoints ------------------------------------------------------------------------------

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """Every rank's own inner optimizer state, gathered as tensors (never pickled) onto rank 0."""
        mine = optimizer.state_dict()
        per_rank = [{"state": {}, "param_groups": mine["param_groups"]} for _ in range(self.world)]
        for idx in sorted(mine["state"]):
            for key in sorted(mine["state"][idx]):
                value = mine["state"][idx][key]
                for r, t in enumerate(self._gather(value.reshape(-1).contiguous(), checkpoint=True)):
                    per_rank[r]["state"].setdefault(idx, {})[key] = t.view(value.shape)
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
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending = dict(state)  # applied in wrap(), once the outer optimizer exists

    def _restore(self, state: dict[str, Any]) -> None:
        self.rounds = int(state.get("rounds", 0))
        if "outer_momentum_buffer" in state:
            self.outer.state[self.shared]["momentum_buffer"] = state["outer_momentum_buffer"].clone()


def quantize_int8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax int8: (codes, one fp32 scale per block); the last block is zero-padded."""
    pad = (-x.numel()) % block
    blocks = torch.nn.functional.pad(x.float(), (0, pad)).view(-1, block)
    scales = blocks.abs().amax(dim=1).clamp_min(1e-30) / 127.0
    codes = torch.round(blocks / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes.view(-1), scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
    return (codes.view(scales.numel(), -1).float() * scales[:, None]).view(-1)[:numel]


DiLoCo.Settings = DiLoCoSettings
