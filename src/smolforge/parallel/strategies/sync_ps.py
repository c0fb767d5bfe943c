"""`sync-ps`: a synchronous parameter server with straggler deadlines (the seed's SyncPS).

Every step the server waits for one part from each worker in its barrier, until a deadline; it
applies what arrived (token-normalised, so a missing part only makes that step's batch smaller),
counts the step (`closed_at_deadline`) and a late part as dropped (`dropped`). The deadline adapts
to the arrivals: max(2 x median, median + 6 x MAD) of recent ones, between `deadline_min_s` and
`deadline_max_s` (or fixed: `deadline_s`, used as given); until four parts have arrived it is the ceiling. A worker
that misses `straggler_after` deadlines in a row leaves the barrier (an event says so), so the
others stop waiting for it; when it asks for work again it has caught up and is back in the barrier
from the next step. A dead worker leaves the barrier at once. Nothing waits without a bound: a step
closes at its deadline once anything arrived.

The server keeps a Polyak (exponential moving) average of the weights, updated at every step with
`polyak_decay`; the final model is it or the raw weights (`final: polyak|raw`). Workers train on the
raw weights, pulled every `pull_every` steps (the seed blends its workers' weights with the server's
instead; a gradient computed at an average and applied to the raw weights is a different method).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Literal

import torch
from pydantic import ConfigDict, Field, model_validator

from smolforge.parallel.strategies.ps_server import ServerCore, median_mad
from smolforge.parallel.strategies.ps_worker import CodecSettings, PSStrategy


class SyncPSSettings(CodecSettings):
    """`strategy_config` of `sync-ps` (`--set strategy_config.KEY=VALUE`)."""

    model_config = ConfigDict(extra="forbid")
    deadline_s: float | None = Field(None, gt=0, description="a fixed deadline per step (default: adaptive)")
    deadline_min_s: float = Field(0.5, gt=0, description="the adaptive deadline's floor")
    deadline_max_s: float = Field(30.0, gt=0, description="its ceiling: no adaptive step waits longer")
    straggler_after: int = Field(3, ge=1, description="missed deadlines in a row before a worker leaves the barrier")
    pull_every: int = Field(1, ge=1, description="pull the raw weights every N steps")
    polyak_decay: float = Field(0.99, ge=0, lt=1, description="the Polyak average's decay per step")
    final: Literal["polyak", "raw"] = Field("raw", description="the model the job ends with")

    @model_validator(mode="after")
    def _floor_below_ceiling(self) -> "SyncPSSettings":
        if self.deadline_min_s > self.deadline_max_s:
            raise ValueError(f"deadline_min_s {self.deadline_min_s} is above deadline_max_s {self.deadline_max_s}")
        return self


class SyncPSServer(ServerCore):
    def _begin(self, start: int) -> None:
        self.version = start
        self.members: set[int] = set(range(self.world))  # expected from the start
        self.stragglers: set[int] = set()
        self.joining: set[int] = set()
        self.missed: dict[int, int] = {}
        self.arrivals: deque[float] = deque(maxlen=64)  # seconds from a step's opening to an on-time part
        self.step_s: deque[float] = deque(maxlen=1000)
        self.max_step_s = 0.0
        self.closed_at_deadline = 0  # steps applied without a part of the barrier (its deadline passed)
        self._open()

    def _open(self) -> None:
        self.members |= self.joining
        self.joining = set()
        live = self.members - self.gone
        self.barrier = sorted(live - self.stragglers) or sorted(live)
        self.arrived: set[int] = set()
        self.total: torch.Tensor | None = None
        self.tokens, self.lr, self.max_norm = 0.0, 0.0, None
        self.opened = time.monotonic()
        self.deadline = self.opened + self.deadline_len()

    def deadline_len(self) -> float:
        """Seconds the open step waits for its barrier: a fixed `deadline_s` as given (stop 51: it was
        clamped to `deadline_max_s`, so 120 meant 30 unless the ceiling was raised too), else the
        adaptive one between its floor and ceiling."""
        c = self.config
        if c["deadline_s"]:
            return float(c["deadline_s"])
        if len(self.arrivals) < 4:
            d = c["deadline_max_s"]
        else:
            med, mad = median_mad(self.arrivals)
            d = max(2.0 * med, med + 6.0 * mad)
        return min(max(d, c["deadline_min_s"]), c["deadline_max_s"])

    def _maybe_close(self) -> None:
        if self.done:
            return
        expected = set(self.barrier) - self.gone
        if expected <= self.arrived or (self.arrived and time.monotonic() >= self.deadline):
            self._close()

    def _close(self) -> None:
        if set(self.barrier) - self.gone - self.arrived:
            self.closed_at_deadline += 1
        if self.total is not None:  # the parts are normalised over the whole step: rescale what arrived
            complete = set(self.barrier) - self.gone <= self.arrived and abs(self.tokens - 1.0) < 1e-6
            self._apply(self.total if complete else self.total / max(self.tokens, 1e-9), self.lr, self.max_norm)
        for m in self.barrier:
            if m in self.arrived or m in self.gone:
                self.missed[m] = 0
                continue
            self.missed[m] = self.missed.get(m, 0) + 1
            if self.missed[m] >= int(self.config["straggler_after"]) and m not in self.stragglers:
                self.stragglers.add(m)
                self.notes.append({"kind": "straggler", "member": m, "step": self.version,
                                   "message": f"step {self.version}: member {m} missed {self.missed[m]} deadlines "
                                              "in a row; the others stop waiting for it until it catches up"})
        took = time.monotonic() - self.opened
        self.step_s.append(took)
        self.max_step_s = max(self.max_step_s, took)
        self.version += 1
        if not self.done:
            self._open()

    def _claim(self, member: int) -> dict[str, Any]:
        self._maybe_close()
        if self.done:
            return {"done": True}
        if member not in self.barrier:  # new, or a straggler asking for work again: it has caught up
            if member in self.stragglers:
                self.stragglers.discard(member)
                self.notes.append({"kind": "straggler_back", "member": member, "step": self.version,
                                   "message": f"step {self.version}: member {member} caught up; back in the "
                                              "barrier from the next step"})
            self.joining.add(member)
            self.missed[member] = 0
            return {"wait": f"joins the barrier at step {self.version + 1}"}
        if member in self.arrived:
            left = max(0.0, self.deadline - time.monotonic())
            waiting = sorted(set(self.barrier) - self.arrived - self.gone)
            return {"wait": f"step {self.version} waits for member(s) {', '.join(map(str, waiting))} "
                            f"(deadline in {left:.1f} s)"}
        pull_every = int(self.config["pull_every"])
        return {"step": self.version, "part": self.barrier.index(member), "parts": len(self.barrier),
                "version": self.version, "need": self.version - (pull_every - 1)}

    def _push(self, member: int, step: int, part: int, version_used: int, grad: torch.Tensor, weight: float,
              lr: float, max_norm: float | None) -> dict[str, Any]:
        self._maybe_close()
        if step != self.version or member not in self.barrier or member in self.arrived:
            return {"accepted": False, "why": f"late: step {step} closed (the server is at step {self.version})"}
        if self.total is None:
            self.total = torch.zeros_like(grad)
        self.total.add_(grad)
        self.tokens += weight
        self.lr, self.max_norm = lr, max_norm
        self.arrived.add(member)
        self.arrivals.append(time.monotonic() - self.opened)
        gap = step - version_used
        self._record_staleness(member, gap)
        self._maybe_close()
        return {"accepted": True, "staleness": gap}

    def _left(self, member: int) -> None:
        self.members.discard(member)
        self.joining.discard(member)
        self.stragglers.discard(member)
        self._maybe_close()

    def _wake_in(self, left: float) -> float:
        return max(0.005, min(left, self.deadline - time.monotonic())) if self.ready else left

    def _stats(self) -> dict[str, Any]:
        steps = sorted(self.step_s) if self.ready else []
        return {"max_step_s": self.max_step_s if self.ready else 0.0,
                "closed_at_deadline": self.closed_at_deadline if self.ready else 0,
                "median_step_s": steps[len(steps) // 2] if steps else None,
                "deadline_s": self.deadline_len() if self.ready else None,
                "stragglers": sorted(self.stragglers) if self.ready else []}


class SyncPS(PSStrategy):
    name = "sync-ps"
    Settings = SyncPSSettings
    Server = SyncPSServer
