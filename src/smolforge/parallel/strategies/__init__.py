"""Data-parallel strategies as plug-ins: a name → class registry.

A new strategy is one file in this package (a `smolforge.train.strategy.Strategy` subclass) and one
line in `STRATEGIES`. The training loop, the job runner and the CLI only ever see the name.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from smolforge.errors import SmolforgeError

if TYPE_CHECKING:
    from smolforge.train.strategy import Strategy


class _Registry(Mapping[str, "type[Strategy]"]):
    """name → strategy class, each module imported when its name is first looked up: checking a job
    spec (the CLI does it before anything starts) then costs one strategy's imports, not all of them
    (FSDP's alone pulls in torch.distributed.checkpoint, seconds on a laptop)."""

    def __init__(self, paths: dict[str, str]):
        self._paths = paths

    def __getitem__(self, name: str) -> "type[Strategy]":
        module, cls = self._paths[name].split(":")
        return getattr(importlib.import_module(f"smolforge.parallel.strategies.{module}"), cls)

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)


STRATEGIES: Mapping[str, "type[Strategy]"] = _Registry({
    "single": "single:SingleProcess",
    "ddp": "ddp:DDP",
    "zero1": "zero1:Zero1",
    "fsdp": "fsdp:FSDP",
    "diloco": "diloco:DiLoCo",
    "ssp": "ssp:SSP",
    "sync-ps": "sync_ps:SyncPS",
    "async-ps": "async_ps:AsyncPS",
    "pipeline": "pipeline:Pipeline",
})


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
