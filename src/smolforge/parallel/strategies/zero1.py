"""ZeRO stage 1: DDP's gradients, but each rank keeps the optimizer state of only 1/N of the parameters.

Gradients are all-reduced as in DDP (the loop and its loss scaling are unchanged); each rank then
steps AdamW for the parameters it owns and broadcasts them (`torch.distributed.optim.
ZeroRedundancyOptimizer`). AdamW is elementwise, so the weights equal DDP's; what changes is
memory: two fp32 moments per parameter on one rank instead of on every rank. The seeds'
`fsdp_stage: 1` is this (stage 0 is `ddp`).

Checkpoints hold the whole optimizer state, gathered onto rank 0 (`consolidate_state_dict`), so a
job saved under `zero1` resumes under any strategy or world size and the other way round.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from smolforge.parallel.strategies.ddp import DDP
from smolforge.train.loop import optimizer_state_bytes


class Zero1(DDP):
    name = "zero1"

    def make_optimizer(self, groups: list[dict[str, Any]], optimizer_class: type[torch.optim.Optimizer],
                       **defaults: Any) -> torch.optim.Optimizer:
        # Bucket views: the parameters a rank owns are broadcast as one flat tensor instead of one message
        # per tensor (LoRA has hundreds of small ones): 1.45x DDP's step time became about 1.0x (BENCHMARKS.md).
        self.optimizer = ZeroRedundancyOptimizer(groups, optimizer_class=optimizer_class,
                                                 parameters_as_bucket_view=True, **defaults)
        return self.optimizer

    def after_step(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                   targets: float = 0.0) -> None:
        # ZeroRedundancyOptimizer.step() ended by broadcasting the parameters this rank owns
        for p in _owned(self.optimizer):
            self._count(p)

    def optimizer_state(self, optimizer: torch.optim.Optimizer, spool_dir: Path | None = None) -> dict[str, Any] | None:
        self.checkpoint_bytes_sent += optimizer_state_bytes(optimizer)  # what this rank's part weighs
        optimizer.consolidate_state_dict(to=0)  # a collective: every rank sends its part to rank 0
        return optimizer.state_dict() if self.is_main else None


def _owned(optimizer: ZeroRedundancyOptimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.optim.param_groups for p in group["params"]]
