"""`async-ps`: an asynchronous parameter server (the seed's EDP).

Workers never wait for each other: each takes the next part of the global steps, computes its
gradient on the weights it holds (pulled every `pull_every` parts, so possibly stale), pushes it, and
goes on. The server applies every part as it arrives, one optimizer step each, at the lr of the part's
step, optionally scaled down by its staleness (`staleness_lr: inverse`: lr / (1 + parts applied since
the worker's weights)). Gradients travel as fp32, fp16, blockwise int8 or int4, or sparse top-k low-bit with
error feedback (`parallel.codecs`: what a push could not carry is added to the worker's next one). A dead worker's
unfinished part goes to another; a joiner starts from the current weights.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import ConfigDict, Field

from smolforge.parallel.strategies.ps_server import PartQueue, ServerCore
from smolforge.parallel.strategies.ps_worker import CodecSettings, PSStrategy


class AsyncPSSettings(CodecSettings):
    """`strategy_config` of `async-ps` (`--set strategy_config.KEY=VALUE`)."""

    model_config = ConfigDict(extra="forbid")
    pull_every: int = Field(1, ge=1, description="pull the current weights every N parts")
    staleness_lr: Literal["none", "inverse"] = Field("none", description="scale a stale gradient's lr down")


class AsyncPSServer(ServerCore):
    def _begin(self, start: int) -> None:
        self.queue = PartQueue(start, self.steps, self.world)
        self.version = start * self.world  # parts applied

    @property
    def done(self) -> bool:
        return self.queue.peek() is None and not self.queue.out

    def _claim(self, member: int) -> dict[str, Any]:
        if self.queue.peek() is None:
            return {"done": True} if not self.queue.out else {"wait": "every part is handed out; the last are "
                                                                     "being computed"}
        slot = self.queue.take(member)
        return {"step": slot // self.world, "part": slot % self.world, "parts": self.world,
                "version": self.version, "need": -1}

    def _push(self, member: int, step: int, part: int, version_used: int, grad: torch.Tensor, weight: float,
              lr: float, max_norm: float | None) -> dict[str, Any]:
        if not self.queue.finish(member, step * self.world + part):
            return {"accepted": False}
        gap = self.version - version_used
        if self.config["staleness_lr"] == "inverse":
            lr = lr / (1.0 + gap)
        self._apply(grad / weight if weight > 0 else grad, lr, max_norm)  # the part's own token mean
        self.version += 1
        self._record_staleness(member, gap)
        return {"accepted": True, "staleness": gap}

    def _left(self, member: int) -> None:
        self.queue.release(member)

    def resume_step(self) -> int:
        return self.queue.lowest_open() // self.world

    def progress(self) -> int:
        return self.version // self.world


class AsyncPS(PSStrategy):
    name = "async-ps"
    Settings = AsyncPSSettings
    Server = AsyncPSServer
