"""The training engine: one readable loop that is also each rank of a data-parallel group.

Why it looks like this:
- The order of samples is a pure function of (seed, step), so resuming from a checkpoint at step N
  sees exactly the batches an uninterrupted run would, and rank r of a data-parallel group takes its
  slice of the same global batch a single process would take whole.
- The loss is a sum over target tokens divided by the target-token count of the whole optimizer
  step (all micro-batches, all ranks), so gradient accumulation and data parallelism give the same
  gradient as one big batch.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from smolforge.config import TrainConfig
from smolforge.data.collate import collate
from smolforge.data.encode import IGNORE
from smolforge.data.splits import Splits, load_splits
from smolforge.errors import SmolforgeError
from smolforge.models.loading import load_model, load_tokenizer, pick_device
from smolforge.models.peft_methods import (
    apply_peft,
    enable_gradient_checkpointing,
    save_adapter,
    trainable_summary,
)
from smolforge.paths import atomic_write_json
from smolforge.telemetry.memory import peak_rss_mb
from smolforge.telemetry.progress import StepProgress
from smolforge.telemetry.sinks import run_name
from smolforge.telemetry.writers import MetricsWriter
from smolforge.train import checkpoint as ckpt
from smolforge.train.evaluate import eval_loss_sums, exact_match_counts, perplexity, token_loss_sum
from smolforge.train.loop import LoopHooks, StepStats, Trainer, make_optimizer, optimizer_state_bytes
from smolforge.train.schedule import make_scheduler
from smolforge.train.step_loss import StepLoss
from smolforge.train.strategy import Strategy


@dataclass
class StepInfo:
    step: int
    max_steps: int
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    samples_done: int
    samples_total: int
    epoch: float


@dataclass
class TrainHooks:
    on_step: Callable[[StepInfo], None] | None = None
    on_checkpoint: Callable[[Path, int], None] | None = None
    on_eval: Callable[[dict], None] | None = None
    should_stop: Callable[[], str | None] | None = None
    on_model: Callable[[torch.nn.Module], None] | None = None  # the built model, before training (fault injection)


@dataclass
class TrainResult:
    output_dir: str
    adapter_dir: str | None
    steps: int
    final_loss: float | None
    eval: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    tokens_per_s: float = 0.0
    trainable_params: int = 0
    total_params: int = 0
    stopped: str | None = None
    checkpoint_dir: str | None = None
    data: dict[str, Any] = field(default_factory=dict)
    strategy: str = "single"
    optimizer_state_bytes: int = 0  # held by this process (a sharded optimizer: its own part)
    comm_bytes_sent: int = 0  # handed to collectives by this process while training (Strategy.bytes_sent)
    checkpoint_bytes_sent: int = 0  # ... and to gather checkpoints
    comm_wait_s: float = 0.0  # time this process spent waiting in collectives
    batch_rows: list[int] | None = None  # rows per rank of the last step when balanced (None: equal slices)
    rounds: int | None = None  # outer steps, for strategies that have them (DiLoCo)
    strategy_metrics: dict[str, float] = field(default_factory=dict)  # Strategy.metrics(): staleness, waits...
    samples: int = 0  # sequences trained on, every rank together
    peak_rss_mb: float = 0.0
    # this rank's raw part of the last global step it counted in: a job's final_loss merges every rank's
    # (`train.step_loss.final_loss`), where `final_loss` above is this rank's own view of its last step
    last_step_loss: StepLoss | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


class SampleOrder:
    """Which rows each step uses: per-epoch seeded permutations, drop-last, sliced per rank."""

    def __init__(self, n_rows: int, per_step: int, seed: int):
        self.n_rows, self.per_step, self.seed = n_rows, per_step, seed
        self.steps_per_epoch = max(1, n_rows // per_step) if n_rows >= per_step else 1
        self._cache: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._cache:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._cache = {epoch: torch.randperm(self.n_rows, generator=g).tolist()}
        return self._cache[epoch]

    def step_rows(self, step: int) -> list[int]:
        epoch, k = divmod(step, self.steps_per_epoch)
        perm = self._perm(epoch)
        if self.n_rows < self.per_step:  # tiny data: wrap around
            return [perm[i % self.n_rows] for i in range(self.per_step)]
        return perm[k * self.per_step:(k + 1) * self.per_step]


def total_steps(cfg: TrainConfig, order: SampleOrder) -> int:
    if cfg.max_steps:
        return cfg.max_steps
    return max(1, math.ceil(cfg.epochs * order.steps_per_epoch))


def build_model(cfg: TrainConfig, device: torch.device, tokenizer=None):
    """Tokenizer and the PEFT-wrapped model on device."""

    tokenizer = tokenizer or load_tokenizer(cfg.model)
    model = load_model(cfg.model, device=device, dtype=cfg.dtype, training=True)
    model = apply_peft(model, cfg.peft)  # peft keeps LoRA/IA3 weights in fp32 on a bf16/fp16 base
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    model.to(device)
    return tokenizer, model


def evaluate(model, tokenizer, splits: Splits, cfg: TrainConfig, device, accuracy: bool = True,
             strategy: Strategy | None = None) -> dict[str, Any]:
    """Eval loss/perplexity (and accuracy where answers exist), each rank doing its shard."""
    strategy = strategy or Strategy()
    rows = strategy.shard(splits.eval)
    with strategy.whole_model(model):  # ranks make different numbers of forwards: none may be a collective
        loss_sum, count = eval_loss_sums(model, rows, tokenizer.pad_token_id, cfg.batch_size * 2, device)
        correct = total = 0
        if accuracy and cfg.eval_accuracy and splits.eval_examples:
            correct, total = exact_match_counts(model, tokenizer, strategy.shard(splits.eval_examples),
                                                cfg.max_new_tokens, 64, device)
    loss_sum, count, correct, total = strategy.reduce([loss_sum, count, correct, total], device)
    out: dict[str, Any] = {}
    if count:
        out["eval_loss"] = loss_sum / count
        out["perplexity"] = perplexity(out["eval_loss"])
    if total:
        out["accuracy"] = correct / total
    return out


def refuse_used_output_dir(cfg: TrainConfig) -> None:
    """A fresh run into a directory holding another run's checkpoints would lose either way: pruning
    keeps the highest steps (the old run's), deleting the new checkpoints, and a later --resume would
    continue the old run. So it is refused, and nothing is deleted."""
    if cfg.resume:
        return
    old = ckpt.list_checkpoints(cfg.output_dir)
    if old:
        raise SmolforgeError(f"{cfg.output_dir} already holds checkpoints of a run (up to {old[-1].name})",
                             where="--output-dir",
                             fix="pass --resume to continue that run, or choose a new --output-dir "
                                 "(nothing was deleted)")


def train(cfg: TrainConfig, hooks: TrainHooks | None = None, *, splits: Splits | None = None,
          model=None, tokenizer=None, strategy: Strategy | None = None, examples=None) -> TrainResult:
    """Run training as cfg says; returns the summary. Pass splits/model/tokenizer to reuse loaded ones,
    or `examples` (read_spec(cfg.data), read by a caller that checked the data before loading torch).

    `strategy` shares the work with other ranks (smolforge.parallel.strategies); default: one process.
    """

    hooks = hooks or TrainHooks()
    strategy = strategy or Strategy()
    t_start = time.perf_counter()
    rank, world = strategy.rank, strategy.world
    torch.set_num_threads(cfg.num_threads or available_cpus())

    device = strategy.device_for(pick_device(cfg.device))
    torch.manual_seed(cfg.seed)
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.model)
    refuse_used_output_dir(cfg)
    if splits is None:  # before the model: bad data should fail in a second, not after a load
        splits = load_splits(cfg.data, tokenizer, read=examples)
    if not splits.train:  # every answer cut off by max_length: refuse, not a modulo by zero rows later
        raise SmolforgeError(
            f"no training example keeps an answer token within max_length {cfg.data.max_length} "
            f"({splits.train_stats.dropped_no_target} dropped: the prompt, with the chat template, fills it)",
            where=str(cfg.data.path), fix="raise --max-length (data.max_length)")
    if model is None:
        tokenizer, model = build_model(cfg, device, tokenizer)
    if hooks.on_model:
        hooks.on_model(model)
    trainable, total_params = trainable_summary(model)
    out_dir = Path(cfg.output_dir)
    strategy.spool_dir = out_dir  # state a sharded strategy streams to disk (checkpoints) starts here
    is_main = rank == 0
    quiet = cfg.quiet or not is_main
    log = (lambda *a: None) if quiet else _printer()
    log(f"model {cfg.model}: trainable params: {trainable:,} || all params: {total_params:,} || "
        f"trainable%: {100 * trainable / max(1, total_params):.2f}")
    st = splits.stats
    log(f"data: {st['train_sequences']} train / {st['eval_sequences']} eval sequences ({st['format']}); "
        f"truncated {st['truncated']}, skipped lines {st['skipped_lines']}, dropped {st['dropped_no_target']}")

    per_rank = cfg.batch_size * cfg.grad_accum
    order = SampleOrder(len(splits.train), per_rank * world, cfg.seed)
    steps = total_steps(cfg, order)
    optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay, device, strategy, cfg.optimizer)
    scheduler = make_scheduler(optimizer, steps, cfg.warmup_steps, cfg.scheduler, cfg.min_lr_ratio)

    start_step = 0
    resumed_from = None
    if cfg.resume:
        latest = ckpt.latest_checkpoint(out_dir)
        if latest is not None:
            state = ckpt.load_checkpoint(latest, model, optimizer, scheduler, strategy=strategy)
            start_step, resumed_from = int(state["step"]), str(latest)
            log(f"resumed from {latest} at step {start_step}")

    trainer = Trainer(model, optimizer, scheduler, loss_sum=lambda logits, m: token_loss_sum(logits, m["labels"])[0],
                      device=device, strategy=strategy, precision=cfg.precision, max_grad_norm=cfg.max_grad_norm)
    begin = strategy.start_at(start_step)  # a member joining a running group starts where the others are
    if begin != start_step:
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": on purpose here
            warnings.simplefilter("ignore")
            for _ in range(begin - start_step):
                scheduler.step()
        log(f"joined the group at step {begin}")
        start_step = begin
    writer = MetricsWriter(out_dir, tensorboard=cfg.tensorboard is not False, append=start_step > 0, wandb=cfg.wandb,
                           run_name=run_name("single", "trainer", 0, cfg.lr, cfg.batch_size),
                           config=cfg.model_dump(mode="json")) if is_main else None
    result = TrainResult(output_dir=str(out_dir), adapter_dir=None, steps=start_step, final_loss=None,
                         trainable_params=trainable, total_params=total_params,
                         data=splits.stats | {"resumed_from": resumed_from})
    progress = StepProgress(steps, "train", quiet=quiet, completed=start_step)
    last_loss = [float("nan")]

    def step_tokens(step: int) -> float:
        """Loss tokens of the whole global step (what `target_tokens` counts on its collated rows)."""
        return float(sum(sum(1 for t in splits.train[i]["labels"][1:] if t != IGNORE) for i in order.step_rows(step)))

    strategy.step_tokens = step_tokens

    def batches(step: int) -> list[dict[str, torch.Tensor]]:
        first, count = strategy.rows_for(step, per_rank * world)  # equal slices unless balanced by speed
        mine = order.step_rows(step)[first:first + count]
        return [collate([splits.train[i] for i in mine[j:j + cfg.batch_size]], tokenizer.pad_token_id)
                for j in range(0, count, cfg.batch_size)]

    def after_step(done: int, stats: StepStats) -> None:
        last_loss[0] = stats.loss
        result.steps = done
        tps = trainer.tokens_per_s()
        info = StepInfo(step=done, max_steps=steps, loss=stats.loss, lr=stats.lr, grad_norm=stats.grad_norm,
                        tokens_per_s=tps, samples_done=done * per_rank * world, samples_total=steps * per_rank * world,
                        epoch=done / order.steps_per_epoch)
        if hooks.on_step:
            hooks.on_step(info)
        progress.update(done, f"loss {stats.loss:.4f} · {tps:,.0f} tok/s")
        if writer and (done % cfg.log_every == 0 or done == steps):
            writer.log("train", done, loss=stats.loss, lr=stats.lr, grad_norm=stats.grad_norm, tokens_per_s=tps,
                       epoch=info.epoch)
        if cfg.eval_every and done % cfg.eval_every == 0 and done != steps:
            metrics = evaluate(model, tokenizer, splits, cfg, device, strategy=strategy)
            if writer:
                writer.log("eval", done, **metrics)
            if hooks.on_eval:
                hooks.on_eval({"step": done, **metrics})
            log(f"step {done}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))

    def save(done: int, _pausing: bool) -> None:
        _save(cfg, out_dir, done, model, optimizer, scheduler, hooks, result, strategy)

    try:
        _done, stopped = trainer.run(start_step, steps, batches,
                                     LoopHooks(after_step=after_step, save=save, should_stop=hooks.should_stop),
                                     save_every=cfg.save_every)
    finally:
        progress.close()
    result.steps = strategy.progress(result.steps)  # a parameter server's steps, not this rank's last
    loss_val = last_loss[0]
    result.final_loss = loss_val if loss_val == loss_val else None
    result.tokens_per_s = trainer.tokens_per_s()
    result.stopped = stopped
    result.strategy, result.optimizer_state_bytes = strategy.name, optimizer_state_bytes(optimizer)
    result.samples = result.steps * per_rank * world
    if stopped is None:
        result.eval = evaluate(model, tokenizer, splits, cfg, device, strategy=strategy)
        if writer:
            writer.log("eval", result.steps, **result.eval)
        if hooks.on_eval:
            hooks.on_eval({"step": result.steps, **result.eval})
        weights = strategy.model_state(model)  # every rank: a sharded model gathers its weights (None: unsharded)
        with strategy.whole_model(model):  # and what a saver reads from the modules (prompt tuning) is whole
            if is_main:
                adapter_dir = out_dir / f"{cfg.peft.method}_adapter"
                save_adapter(model, adapter_dir, tokenizer=tokenizer, weights=weights)
                result.adapter_dir = str(adapter_dir)
        # Every rank enters: the save ends in a barrier that all ranks must reach.
        _save(cfg, out_dir, result.steps, model, optimizer, scheduler, hooks, result, strategy)
    result.seconds = time.perf_counter() - t_start
    result.comm_bytes_sent, result.peak_rss_mb = strategy.bytes_sent, peak_rss_mb()
    result.checkpoint_bytes_sent = strategy.checkpoint_bytes_sent
    result.comm_wait_s, result.batch_rows = strategy.comm_wait_s, strategy.rows
    result.rounds = strategy.rounds
    result.strategy_metrics = strategy.metrics()
    result.last_step_loss = strategy.last_loss
    if writer:
        writer.close()
    if is_main:
        atomic_write_json(out_dir / "summary.json", result.to_dict())
        if result.eval:
            log("eval: " + ", ".join(f"{k} {v:.4f}" for k, v in result.eval.items()))
    return result


def _save(cfg, out_dir, step, model, optimizer, scheduler, hooks, result, strategy: Strategy) -> None:
    step = strategy.checkpoint_step(step)  # a parameter server's consistent state may be behind this rank
    rngs = strategy.gather_rng()  # every rank takes part; the main rank gets them all
    optim_state = strategy.optimizer_state(optimizer)  # likewise: a sharded optimizer gathers its parts
    weights = strategy.model_state(model)  # and a sharded model its trainable weights (None: read the model)
    if strategy.is_main:
        path = ckpt.save_checkpoint(out_dir, step, model, optimizer, scheduler,
                                    extra={"model": cfg.model, "peft": cfg.peft.method,
                                           "strategy": strategy.name, "world": strategy.world},
                                    keep_last=cfg.keep_last, rank_rng=rngs, strategy_state=strategy.state_dict(),
                                    optimizer_state=optim_state, model_state=weights)
        result.checkpoint_dir = str(path)
        if hooks.on_checkpoint:
            hooks.on_checkpoint(path, step)
    strategy.barrier()


def _printer():
    from rich.console import Console

    con = Console(stderr=True, highlight=False)
    return lambda msg: con.print(msg, markup=False)
