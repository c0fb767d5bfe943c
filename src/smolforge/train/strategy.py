"""The strategy interface: how a training loop shares learning with other processes.

The training loop (`smolforge.train.engine`) never imports torch.distributed. Everything a loop
needs from its peers goes through a `Strategy`:

- `wrap(model)`: the module to run forward/backward on (DDP wraps it; one process returns it as is)
- `make_optimizer(groups, cls, **defaults)`: the optimizer over the trainable groups (ZeRO shards it)
- `optimizer_state(optimizer)`: its whole state for a checkpoint, on the main rank (collective)
- `accumulate(last)`: the context for one micro-batch's backward (skip gradient sync unless last)
- `reduce(values)`: sum numbers over every rank (target-token counts, losses, eval sums)
- `agree(code)`: every rank leaves the loop on the same step (the largest stop code wins)
- `shard(items)`: this rank's slice of a list (eval examples)
- `after_step(step)`: hook for strategies with an outer step (DiLoCo, parameter servers)
- `gather_rng()` / `rng_for_rank(states)`: every rank's RNG state in a checkpoint, each rank its own
  back on resume (LoRA dropout differs per rank)
- `state_dict()` / `load_state_dict()`: the strategy's own state in checkpoints
- `barrier()`, `bytes_sent`, `rank`, `world`, `is_main`

This class is the single-process strategy: rank 0 of 1, every method the identity. The others live
in `smolforge.parallel.strategies`, one file each, picked by name from its registry.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, ContextManager

import torch


class Strategy:
    name = "single"

    def __init__(self, **config: Any):
        self.config = dict(config)
        self.bytes_sent = 0

    # -- who we are ---------------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return 0

    @property
    def world(self) -> int:
        return 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device_for(self, device: torch.device) -> torch.device:
        """The device this rank trains on (a GPU rank uses its local GPU)."""
        return device

    # -- the step -----------------------------------------------------------------------------------

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        return model

    def accumulate(self, wrapped: torch.nn.Module, last: bool) -> ContextManager:
        return nullcontext()

    def make_optimizer(self, groups: list[dict[str, Any]], optimizer_class: type[torch.optim.Optimizer],
                       **defaults: Any) -> torch.optim.Optimizer:
        return optimizer_class(groups, **defaults)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """The optimizer's whole state for a checkpoint: every rank calls it, the main rank gets it.

        A checkpoint holds the whole state whatever the strategy, so that it resumes under any other
        strategy or world size (a sharded optimizer loads the whole state and keeps its own part)."""
        return optimizer.state_dict()

    def after_step(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Called after every optimizer step (DiLoCo's outer step, a parameter server's push)."""

    # -- agreeing -----------------------------------------------------------------------------------

    def reduce(self, values: list[float], device: torch.device) -> list[float]:
        return list(values)

    def agree(self, code: int, device: torch.device) -> int:
        return code

    def shard(self, items: list) -> list:
        return items[self.rank::self.world]

    def barrier(self) -> None:
        """Every rank reaches this point before any goes on."""

    # -- checkpoints --------------------------------------------------------------------------------

    def gather_rng(self) -> list[torch.Tensor] | None:
        """Every rank's CPU RNG state, rank order, on the main rank (None elsewhere)."""
        return [torch.get_rng_state()]

    def rng_for_rank(self, states: list[torch.Tensor]) -> torch.Tensor | None:
        """This rank's state among those a checkpoint kept; None when they came from another world size."""
        return states[self.rank] if len(states) == self.world else None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Strategies with state of their own (an outer optimizer, a staleness clock) restore it."""


SingleProcess = Strategy
