"""`ssp`: stale-synchronous parallel through a parameter server (the seed's ClassicDP `staleness_bound`).

Workers take parts of the global steps in order from the server (a fast worker takes more of them),
push each part's gradient tagged with its step, and pull the weights whenever the server has newer
ones. The server applies step s when all its parts arrived (summed, token-normalised, clipped once:
DDP's step). A worker may compute a part of step s only when every step before s - K is applied (K =
`staleness_bound`): one that would run further ahead of the slowest **waits** (the reason is shown,
and counted: `bound_waits`, `claim_waits`, `comm_wait_s`); nothing is ever raised for staleness. Its
gradient is then computed on weights at most K steps old (`staleness_max` <= K, measured). K = 0 is
fully synchronous and gives DDP's weights.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import ConfigDict, Field

from smolforge.parallel.strategies.ps_server import PartQueue, ServerCore
from smolforge.parallel.strategies.ps_worker import CodecSettings, PSStrategy


class SSPSettings(CodecSettings):
    """`strategy_config` of `ssp` (`--set strategy_config.KEY=VALUE`)."""

    model_config = ConfigDict(extra="forbid")
    staleness_bound: int = Field(2, ge=0, description="K: how many steps a worker may run ahead of the slowest")
    pull_every: int = Field(1, ge=1, description="pull newer weights at most every N parts (within the bound)")


class SSPServer(ServerCore):
    def _begin(self, start: int) -> None:
        self.version = start
        self.bound = int(self.config["staleness_bound"])
        self.queue = PartQueue(start, self.steps, self.world)
        self.pending: dict[int, list] = {}  # step -> [summed gradient, token share, parts, lr, max_norm]

    def _claim(self, member: int) -> dict[str, Any]:
        if self.done:
            return {"done": True}
        slot = self.queue.peek()
        if slot is None:
            return {"wait": f"every part is handed out; step {self.version} waits for its last parts"}
        step = slot // self.world
        if step > self.version + self.bound:
            return {"wait": f"staleness bound: step {step} would be more than {self.bound} ahead of step "
                            f"{self.version}, which waits for a slower worker", "bound": True}
        self.queue.take(member)
        return {"step": step, "part": slot % self.world, "parts": self.world, "version": self.version,
                "need": step - self.bound}

    def _push(self, member: int, step: int, part: int, version_used: int, grad: torch.Tensor, weight: float,
              lr: float, max_norm: float | None) -> dict[str, Any]:
        if not self.queue.finish(member, step * self.world + part):
            return {"accepted": False}
        acc = self.pending.setdefault(step, [torch.zeros_like(grad), 0.0, 0, lr, max_norm])
        acc[0].add_(grad)  # each part normalised over the step's tokens: their sum is the step's gradient
        acc[1] += weight
        acc[2] += 1
        gap = step - version_used
        self._record_staleness(member, gap)
        while self.version in self.pending and self.pending[self.version][2] == self.world:
            total, _, _, step_lr, norm = self.pending.pop(self.version)
            self._apply(total, step_lr, norm)
            self.version += 1
        return {"accepted": True, "staleness": gap}

    def _left(self, member: int) -> None:
        self.queue.release(member)


class SSP(PSStrategy):
    name = "ssp"
    Settings = SSPSettings
    Server = SSPServer
