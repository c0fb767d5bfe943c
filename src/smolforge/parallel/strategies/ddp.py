"""DDP: every rank holds the whole model; gradients are all-reduced (averaged) after each backward.

The loop scales its loss by world / (the step's target tokens over all ranks), so DDP's average
over ranks gives the gradient of the summed token loss over the global batch, exactly what one
process with the whole batch computes. Micro-batches before the last skip the all-reduce
(`no_sync`); the last one syncs the accumulated gradients once.

Speed-balanced batches (`balance = "auto"`, this class and those built on it): each rank measures
its rows per second of forward and backward (up to the moment it hands its last gradient bucket to
the all-reduce, so waiting for a slower peer is not counted as work); every few steps the ranks
exchange their rates and each takes rows of the next global batches in proportion. The loss is
normalised over the whole step, so the weights stay those of one process with the global batch.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager, nullcontext
from typing import Any, ContextManager

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from smolforge.train import balance
from smolforge.train.rank_context import RankContext
from smolforge.train.strategy import Strategy


class DDP(Strategy):
    name = "ddp"
    balances = True  # every step is synchronous: rows per rank can follow speed, the result stays exact
    joins_later = False  # made before its process group exists (an elastic member joining a running job)
    distill_students = True  # its subclasses too, unless they say otherwise

    def __init__(self, context: RankContext | None = None, **config: Any):
        super().__init__(context, **config)
        if not (dist.is_available() and dist.is_initialized()) and not self.joins_later:
            raise RuntimeError(f"the {self.name} strategy needs a process group "
                               "(smolforge.parallel.rendezvous.init_group)")
        self.meter = balance.RateMeter()
        self.shares: list[int] | None = None  # rows per rank once balanced
        self.handed_at = 0.0  # when this rank handed its last gradient bucket to the all-reduce
        self.device = torch.device("cpu")  # where small collectives' tensors live (NCCL: the GPU)

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
        self.device = device
        # No buffer broadcast: our models' buffers (rotary tables) are the same on every rank, and the
        # broadcast would make each forward wait for rank 0, hiding a rank's own speed.
        wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                          broadcast_buffers=False)
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

    @contextmanager
    def waiting(self):
        """Time spent in a blocking collective: on a fast rank mostly waiting for the others."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.comm_wait_s += time.perf_counter() - t0

    def reduce(self, values: list[float], device: torch.device) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=device)
        self._count(t)
        with self.waiting():
            dist.all_reduce(t)
        return t.tolist()

    def agree(self, code: int, device: torch.device) -> int:
        t = torch.tensor([code], device=device)
        self._count(t)
        with self.waiting():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def barrier(self) -> None:
        with self.waiting():
            dist.barrier()

    # -- speed-balanced batches ---------------------------------------------------------------------

    def observe(self, rows: int, started: float, ended: float, targets: float = 0.0) -> None:
        busy_until = self.handed_at if started <= self.handed_at <= ended else ended
        self.comm_wait_s += ended - busy_until  # backward's end waits for the last all-reduce
        self.meter.add(rows, busy_until - started)

    def rows_for(self, step: int, total: int) -> tuple[int, int]:
        if self.balances and self.balance != "off" and self.meter.due(self.shares is not None):
            self._rebalance(total)
        shares = self.shares if self.shares and sum(self.shares) == total else None
        if shares is None:
            return super().rows_for(step, total)
        return sum(shares[:self.rank]), shares[self.rank]

    @property
    def rows(self) -> list[int] | None:
        return list(self.shares) if self.shares else None

    def _rebalance(self, total: int) -> None:
        """Every rank shares its measured rate and all compute the same split. A collective: each rank
        observes every step, so all of them get here at the same step."""
        t = torch.zeros(self.world, dtype=torch.float64, device=self.device)
        t[self.rank] = self.meter.take()
        self._count(t)
        with self.waiting():
            dist.all_reduce(t)
        rates = t.tolist()
        shares = balance.split_rows(rates, total) if balance.uneven(rates) else None
        if shares != self.shares:
            self.notes.append({"kind": "balance", "rows": shares or [total // self.world] * self.world,
                               "rates": rates})
        self.shares = shares

    def _handed(self, buffer: torch.Tensor) -> None:
        """A gradient bucket goes to the all-reduce now: its bytes counted, and when (`observe` measures
        this rank's own work up to the last one of a step)."""
        self._count(buffer)
        self.handed_at = time.perf_counter()

    def gather_rng(self) -> list[torch.Tensor] | None:
        mine = torch.get_rng_state()
        every = [torch.empty_like(mine) for _ in range(self.world)]
        self._count(mine, checkpoint=True)
        dist.all_gather(every, mine)  # gloo and NCCL both gather on the CPU group for byte tensors
        return every if self.is_main else None


def _counted_allreduce(strategy, bucket):  # no annotations: DDP compares them to real types, and ours are strings
    """DDP's default gradient all-reduce (average over ranks), counting the bucket's bytes."""
    strategy._handed(bucket.buffer())  # the last call of a step: this rank's backward is done
    return default_hooks.allreduce_hook(None, bucket)
