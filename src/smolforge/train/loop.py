"""The one training loop: the step every smolforge trainer takes, and the loop around it.

`smolforge train` (the engine) and the distillation student are both this `Trainer`: they differ
only in where micro-batches come from (a seeded sample order over a known dataset; a stream of
teacher shards still being written) and in the loss (token cross-entropy; KD + CE). A strategy
(`smolforge.train.strategy`, `smolforge.parallel.strategies`) shares the work with other ranks,
so the loop never imports torch.distributed.

Why the loss is normalised the way it is: a loss function returns a *sum* over the micro-batch's
target tokens; the trainer divides by the target tokens of the whole optimizer step (every
micro-batch, every rank) and multiplies by the world size (DDP averages over ranks). So gradient
accumulation and data parallelism give the gradient of one big batch.

The split-learning client (`smolforge.split.trainer`) shares the pieces below it (sample order,
schedule, loss, hooks, progress) but keeps its own step: its optimizer step spans two processes
(the client's AdamW and the server's trunk step, under one global clip coefficient).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from smolforge.train.precision import autocast_dtype
from smolforge.train.strategy import TOKENS, Batch, BatchLayout, StepPass, Strategy, target_tokens  # noqa: F401

Forward = Callable[[torch.nn.Module, Batch], torch.Tensor]
"""(model, batch) -> logits aligned with batch["input_ids"]; runs under autocast."""
LossSum = Callable[[torch.Tensor, Batch], torch.Tensor]
"""(logits, batch) -> the loss summed over the batch's target tokens; runs in fp32."""


class StopRequested(Exception):
    """Raised by a batch source while it waits for data and a pause or cancel arrives.

    Without it a trainer blocked on a slow producer (a teacher still writing shards) would only
    see the request after its next step, which may be minutes away; with it, a pause still
    checkpoints the steps already done.
    """

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, device: torch.device,
                   strategy: Strategy | None = None, kind: str = "adamw") -> torch.optim.Optimizer:
    """AdamW (or plain SGD) over what trains: decay on matrices, none on biases and norms (built by
    the strategy, which may shard its state across ranks)."""
    strategy = strategy or Strategy()
    strategy.prepare(model, device)  # FSDP replaces the parameters with shards: before the optimizer sees them
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}]
    cls = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[kind]
    return strategy.make_optimizer(groups, cls, lr=lr, foreach=device.type == "cuda" or None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this process holds (a sharded optimizer's own part only)."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard's optimizer there
    local = [t.to_local() if hasattr(t, "to_local") else t  # FSDP's states are DTensors: this rank's shard
             for st in inner.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in local)


def plain_forward(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Logits aligned with input_ids (prompt tuning's virtual-token positions dropped)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    extra = logits.shape[1] - batch["input_ids"].shape[1]
    return logits[:, extra:] if extra > 0 else logits


@dataclass
class StepStats:
    loss: float  # mean over the step's target tokens, every rank (a rank that computes its part alone: its own)
    lr: float
    grad_norm: float
    tokens: int  # this rank's tokens (attention mask), for throughput


@dataclass
class LoopHooks:
    """What a trainer does between steps; the loop decides when."""

    after_step: Callable[[int, StepStats], None]  # (steps done, stats): progress, metrics, eval
    save: Callable[[int, bool], None]  # (steps done, pausing): a checkpoint
    should_stop: Callable[[], str | None] | None = None  # "pause" | "cancel" | None (asked on rank 0)


class Trainer:
    """One optimizer step (`step`) and the loop of steps (`run`), under a strategy."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, *,
                 loss_sum: LossSum, device: torch.device, strategy: Strategy | None = None,
                 forward: Forward = plain_forward, precision: str = "fp32",
                 max_grad_norm: float | None = 1.0, step_tokens: Callable[[int], float] | None = None,
                 layout: BatchLayout = TOKENS):
        """`step_tokens`: step -> its loss tokens, every rank's rows, where the data can count them
        (`Strategy.step_targets`'s `counted`); None: the ranks sum their own."""
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.loss_sum, self.forward, self.device = loss_sum, forward, device
        self.strategy = strategy or Strategy()
        self.max_grad_norm, self.step_tokens = max_grad_norm, step_tokens
        self.layout = layout  # which units of a batch carry the loss (tokens; a classifier's rows)
        self.amp = autocast_dtype(precision, device)  # measured on CPUs; bf16/fp16 on GPUs
        self.scaler = torch.amp.GradScaler("cuda") if self.amp == torch.float16 and device.type == "cuda" else None
        self.wrapped = self.strategy.wrap(model, device)
        self.tokens_seen = 0
        self.first_step_at: float | None = None

    def step(self, step: int, micro: list[Batch]) -> StepStats:
        """Forward, loss, backward for each micro-batch (`Strategy.forward_backward`); clip; optimizer and
        schedule step."""
        s = self.strategy
        if self.scheduler.last_epoch != step:  # steps handed out out of order (a parameter server)
            self._seek_schedule(step)
        my_targets = float(sum(self.layout.targets(m) for m in micro))
        global_targets = s.step_targets(step, my_targets, self.device, self.step_tokens)
        scale = s.step_ranks / max(1.0, global_targets)  # DDP averages over ranks; undo that
        started = time.perf_counter()
        how = StepPass(forward=self.forward, loss_sum=self.loss_sum, scale=scale, device=self.device, amp=self.amp,
                       scaler=self.scaler, layout=self.layout)
        loss_total, tokens = s.forward_backward(self.wrapped, micro, how)  # each micro-batch in turn, or piped
        s.observe(sum(self.layout.rows(m) for m in micro), started, time.perf_counter(), targets=my_targets)
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        grad_norm = self._clip()
        lr = self.scheduler.get_last_lr()[0]
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        s.after_step(step + 1, self.model, self.optimizer, targets=my_targets)
        self.tokens_seen += tokens
        s.own_loss(step, loss_total, my_targets)  # this rank's part, for the job's final_loss (train.step_loss)
        # the mean over the very tokens whose loss was summed: the whole step's where the ranks reduce it (DDP:
        # global_targets is that count already), this rank's rows' where it computes its part alone
        loss_mean = s.step_loss(loss_total, my_targets, global_targets, self.device)
        return StepStats(loss=loss_mean, lr=lr, grad_norm=grad_norm, tokens=tokens)

    def _clip(self) -> float:
        """The global gradient norm (clipped to max_grad_norm when set; by the strategy, which may leave
        it to a parameter server that clips the ranks' summed gradient)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        return self.strategy.clip_grad_norm(params, self.max_grad_norm)

    def _seek_schedule(self, step: int) -> None:
        """Put the LR schedule at `step` (a rank that skipped steps others took)."""
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": on purpose here
            warnings.simplefilter("ignore")
            self.scheduler.last_epoch = step - 1
            self.scheduler.step()

    def stop_decision(self, should_stop: Callable[[], str | None] | None) -> str | None:
        """Rank 0's pause/cancel decision, shared with every rank so they leave the loop together."""
        code = {"pause": 1, "cancel": 2}.get((should_stop() if should_stop else None) or "", 0)
        return {1: "pause", 2: "cancel"}.get(self.strategy.agree(code, self.device))

    def run(self, start: int, steps: int, batches: Callable[[int], list[Batch]], hooks: LoopHooks,
            save_every: int = 0) -> tuple[int, str | None]:
        """Steps `start`..`steps`; returns (steps done, "pause" | "cancel" | None).

        A checkpoint every `save_every` steps (not at the last: the caller saves the final state)
        and on a pause. `batches(step)` may raise StopRequested while it waits for data.
        """
        self.model.train()
        s = self.strategy
        done, stopped, wanted, save_due, saved = start, None, None, False, start
        while True:
            try:
                step = s.next_step(done, steps)  # the next in order; a parameter server hands them out
                if step is None:
                    break
                micro = batches(step)
            except StopRequested as req:
                stopped = req.what
                if stopped == "pause" and done > start and s.at_boundary(done):
                    hooks.save(done, True)
                break
            if self.first_step_at is None:
                self.first_step_at = time.perf_counter()
            stats = self.step(step, micro)
            done = step + 1
            hooks.after_step(done, stats)
            wanted = wanted or self.stop_decision(hooks.should_stop)
            if wanted == "cancel":
                stopped = wanted
                break
            # due when a multiple of save_every was passed (a rank handed steps out of order may skip it)
            save_due = save_due or bool(save_every and done // save_every > saved // save_every and done != steps)
            # A checkpoint or a pause lands where every rank shares its state (DiLoCo: an outer step).
            if s.at_boundary(done) and (save_due or wanted == "pause"):
                hooks.save(done, wanted == "pause")
                save_due, saved = False, done
                if wanted == "pause":
                    stopped = wanted
                    break
        if stopped is None:  # every step taken (by this rank or, handed out, by others)
            s.finish(self.model, self.optimizer)
        return done, stopped

    def tokens_per_s(self) -> float:
        """This rank's tokens per second since the first step, times the world size."""
        if self.first_step_at is None:
            return 0.0
        return self.tokens_seen * self.strategy.world / max(time.perf_counter() - self.first_step_at, 1e-9)
