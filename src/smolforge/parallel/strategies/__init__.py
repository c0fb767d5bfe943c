"""Data-parallel strategies as plug-ins: a name → class registry.

A new strategy is one file in this package (a `smolforge.train.strategy.Strategy` subclass) and one
line in `STRATEGIES`. The training loop, the job runner and the CLI only ever see the name.
"""

from __future__ import annotations

import difflib
from typing import Any

from smolforge.errors import SmolforgeError
from smolforge.parallel.strategies.async_ps import AsyncPS
from smolforge.parallel.strategies.ddp import DDP
from smolforge.parallel.strategies.diloco import DiLoCo
from smolforge.parallel.strategies.fsdp import FSDP
from smolforge.parallel.strategies.single import SingleProcess
from smolforge.parallel.strategies.ssp import SSP
from smolforge.parallel.strategies.sync_ps import SyncPS
from smolforge.parallel.strategies.zero1 import Zero1
from smolforge.train.strategy import Strategy

STRATEGIES: dict[str, type[Strategy]] = {
    "single": SingleProcess,
    "ddp": DDP,
    "zero1": Zero1,
    "fsdp": FSDP,
    "diloco": DiLoCo,
    "ssp": SSP,
    "sync-ps": SyncPS,
    "async-ps": AsyncPS,
}


def check_name(name: str) -> str:
    """The name if a strategy has it; else one message with the closest name."""
    if name in STRATEGIES:
        return name
    close = difflib.get_close_matches(name, STRATEGIES, n=1)
    raise SmolforgeError(f"unknown strategy {name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""),
                         fix=f"use one of {', '.join(STRATEGIES)}")


def make_strategy(name: str, config: dict[str, Any] | None = None) -> Strategy:
    """An instance of the named strategy with its settings (`strategy_config`)."""
    return STRATEGIES[check_name(name)](**(config or {}))
