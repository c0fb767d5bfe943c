"""DDP: every rank holds the whole model; gradients are all-reduced (averaged) after each backward.

The loop scales its loss by world / (the step's target tokens over all ranks), so DDP's average
over ranks gives the gradient of the summed token loss over the global batch, exactly what one
process with the whole batch computes. Micro-batches before the last skip the all-reduce
(`no_sync`); the last one syncs the accumulated gradients once.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Any, ContextManager

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from smolforge.train.strategy import Strategy


class DDP(Strategy):
    name = "ddp"

    def __init__(self, **config: Any):
        super().__init__(**config)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("the ddp strategy needs a process group (smolforge.parallel.rendezvous.init_group)")

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world(self) -> int:
        return dist.get_world_size()

    def device_for(self, device: torch.device) -> torch.device:
        if device.type == "cuda":
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
        return device

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        wrapped.register_comm_hook(self, _counted_allreduce)  # DDP's own all-reduce, its bytes counted
        return wrapped

    def _count(self, tensor: torch.Tensor, checkpoint: bool = False) -> None:
        """Bytes this rank hands to a collective (the payload; a ring all-reduce moves about twice that).

        What gathers a checkpoint (RNG states, a sharded or per-rank optimizer state) is counted apart:
        it depends on how often one saves, not on the strategy's training traffic."""
        n = tensor.numel() * tensor.element_size()
        if checkpoint:
            self.checkpoint_bytes_sent += n
        else:
            self.bytes_sent += n

    def accumulate(self, wrapped: torch.nn.Module, last: bool) -> ContextManager:
        return nullcontext() if last else wrapped.no_sync()

    def reduce(self, values: list[float], device: torch.device) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=device)
        self._count(t)
        dist.all_reduce(t)
        return t.tolist()

    def agree(self, code: int, device: torch.device) -> int:
        t = torch.tensor([code], device=device)
        self._count(t)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def barrier(self) -> None:
        dist.barrier()

    def gather_rng(self) -> list[torch.Tensor] | None:
        mine = torch.get_rng_state()
        every = [torch.empty_like(mine) for _ in range(self.world)]
        self._count(mine, checkpoint=True)
        dist.all_gather(every, mine)  # gloo and NCCL both gather on the CPU group for byte tensors
        return every if self.is_main else None


def _counted_allreduce(strategy, bucket):  # no annotations: DDP compares them to real types, and ours are strings
    """DDP's default gradient all-reduce (average over ranks), counting the bucket's bytes."""
    strategy._count(bucket.buffer())
    return default_hooks.allreduce_hook(None, bucket)
