"""Data-parallel strategies as plug-ins: a name → class registry.

A new strategy is one file in this package (a `smolforge.train.strategy.Strategy` subclass) and one
line in `STRATEGIES` (a plug-in elsewhere sets `STRATEGIES[name] = its class`). The training loop, the
job runner and the CLI only ever see the name; what a strategy can do they read from its class's
capabilities (`needs_server`, `uses_process_group`, `elastic`, `distill_students`, `stage_parts`), and
the CLI's help and errors list the names held here.

One lookup answers every question about a name: `strategy_class(name)` (the class, or one message
naming the closest name); `make_strategy` builds an instance from it, with its settings and its rank's
`RankContext`.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterator, MutableMapping
from typing import TYPE_CHECKING, Any

from smolforge.errors import SmolforgeError

if TYPE_CHECKING:
    from smolforge.train.rank_context import RankContext
    from smolforge.train.strategy import Strategy


class _Registry(MutableMapping[str, "type[Strategy]"]):
    """name → strategy class, each module imported when its name is first looked up: checking a job
    spec (the CLI does it before anything starts) then costs one strategy's imports, not all of them
    (FSDP's alone pulls in torch.distributed.checkpoint, seconds on a laptop). A name may also hold a
    class itself (a plug-in outside this package, a test's strategy)."""

    def __init__(self, paths: dict[str, "str | type[Strategy]"]):
        self._paths = paths

    def __getitem__(self, name: str) -> "type[Strategy]":
        where = self._paths[name]
        if not isinstance(where, str):
            return where
        module, cls = where.split(":")
        return getattr(importlib.import_module(f"smolforge.parallel.strategies.{module}"), cls)

    def __setitem__(self, name: str, cls: "type[Strategy]") -> None:
        self._paths[name] = cls

    def __delitem__(self, name: str) -> None:
        del self._paths[name]

    def __contains__(self, name: object) -> bool:
        return name in self._paths  # without importing the strategy, as Mapping's own would

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)


STRATEGIES: MutableMapping[str, "type[Strategy]"] = _Registry({
    "single": "single:SingleProcess",
    "ddp": "ddp:DDP",
    "zero1": "zero1:Zero1",
    "fsdp": "fsdp:FSDP",
    "diloco": "diloco:DiLoCo",
    "ssp": "ssp:SSP",
    "sync-ps": "sync_ps:SyncPS",
    "async-ps": "async_ps:AsyncPS",
    "pipeline": "pipeline:Pipeline",
    "auto": "auto:Auto",  # resolved by the ranks to ddp or diloco (`parallel/auto_probe.py`)
})


def check_name(name: str, where: str | None = None) -> str:
    """The name if a strategy has it; else one message with the closest name (`where`: the flag)."""
    if name in STRATEGIES:
        return name
    close = difflib.get_close_matches(name, STRATEGIES, n=1)
    raise SmolforgeError(f"unknown strategy {name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""),
                         where=where, fix=f"use one of {', '.join(STRATEGIES)}")


def strategy_class(name: str, where: str | None = None) -> "type[Strategy]":
    """The strategy class registered under `name`, its module imported now (one strategy's imports);
    an unknown name raises `check_name`'s one message (`where`: the flag or field that gave it). Every
    question about a strategy by name (its capabilities, its settings, an instance) starts here."""
    return STRATEGIES[check_name(name, where)]


def names_where(able: Callable[["type[Strategy]"], bool]) -> list[str]:
    """The names whose strategy has a capability, e.g. `names_where(lambda s: s.distill_students)`;
    it imports every strategy (seconds): for an error message or `--help`, not for every command."""
    return [name for name in STRATEGIES if able(strategy_class(name))]


def make_strategy(name: str, config: dict[str, Any] | None = None, context: "RankContext | None" = None) -> Strategy:
    """An instance of the named strategy with its settings (`strategy_config`, checked at submit) and its
    rank's facts (`context`; default: rank 0 of 1, nothing shared)."""
    return strategy_class(name)(context, **(config or {}))
