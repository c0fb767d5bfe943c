"""The one driver around the `Trainer`: the sequence every run on this machine takes.

A fine-tuning run (`smolforge train`), a data-parallel rank and a distillation student are the same
run: optimizer → resume → the loop (progress, metrics, periodic eval, checkpoints) → eval → adapter
(→ final checkpoint) → summary. They differ in two parameters and in what they record:

- the data: a `Source` (`engine.SampleSource`: a seeded order over a loaded dataset;
  `distill.student.StreamSource`: teacher shards still being written), which also says how many
  steps the run has and what a checkpoint must keep to replay it (a student's shard order);
- the loss (`LossSum`: token cross-entropy; KD + CE);
- the settings a run reads (`RunSettings`, made from a `TrainConfig` or a `StudentConfig`), the
  hooks it reports through (`RunHooks`) and the result it writes as `summary.json` (`summarize`).

Loading stays with the callers (a fine-tuning run reads its data before the model, so bad data fails
in a second; a student seeds only a model it builds itself). The split-learning client keeps its own
loop (`smolforge.split.trainer`): its step and checkpoints span two processes; it shares `SampleSource`.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generic, Protocol, TypeVar

import torch

from smolforge.errors import SmolforgeError
from smolforge.models.loading import pick_device
from smolforge.models.peft_methods import save_adapter
from smolforge.paths import atomic_write_json
from smolforge.telemetry.progress import StepProgress
from smolforge.telemetry.writers import MetricsWriter
from smolforge.train import checkpoint as ckpt
from smolforge.train.loop import Forward, LoopHooks, LossSum, StepStats, Trainer, make_optimizer, plain_forward
from smolforge.train.resume_point import SAMPLES_KEY, STATE_KEY, StepMeaning, resume_point
from smolforge.train.schedule import make_scheduler
from smolforge.train.strategy import TOKENS, Batch, BatchLayout, Strategy

R = TypeVar("R")


THREADS_ENV = "SMOLFORGE_NUM_THREADS"  # torch threads of a run given no --num-threads (default: its CPUs)


def available_cpus() -> int:
    """The torch threads a run takes when not told (`--num-threads`): $SMOLFORGE_NUM_THREADS when set
    (a whole number ≥ 1; processes this one starts inherit it), else the CPUs this process may use
    (its affinity; the CPU count on macOS). Two threads on a core another process keeps busy spin in
    OpenMP's waits, so a process beside others (a test's CLI run next to its own Ray workers) is told 1.
    Raises SmolforgeError (exit 2) for a value that is not a whole number ≥ 1."""
    given = os.environ.get(THREADS_ENV, "").strip()
    if given:
        if not given.isdigit() or int(given) < 1:
            raise SmolforgeError(f"{THREADS_ENV}={given!r}: not a whole number ≥ 1",
                                 fix=f"e.g. {THREADS_ENV}=1, or unset it to use every CPU this process may use")
        return int(given)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def prepare_process(num_threads: int | None, device: str, strategy: Strategy) -> torch.device:
    """Torch's threads (default: the CPUs this process may use) and the device this rank trains on."""
    torch.set_num_threads(num_threads or available_cpus())
    return strategy.device_for(pick_device(device))


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


class Source(Protocol):
    """Where a run's micro-batches come from."""

    steps: int  # the run's optimizer steps
    rows_per_step: int  # every rank's rows of one step together

    def batches(self, step: int) -> list[Batch]:
        """This rank's micro-batches of `step` (may raise `StopRequested` while it waits for data)."""

    def epoch(self, done: int) -> float:
        """Epochs done after `done` steps."""

    def note(self) -> str:
        """Appended to the progress line (a student: the shards arrived so far)."""

    def replay_state(self) -> dict[str, Any]:
        """What a checkpoint keeps so that a resumed run sees the same rows (a student: its shard order)."""


class OrderedSource:
    """The base of a `Source` over a seeded row order (`engine.SampleOrder`: `per_step`, `step_rows`,
    `steps_per_epoch`), each step's rows sliced per rank: the fine-tune's token rows (`engine.SampleSource`)
    and a model kind's feature rows (`kind_run.RowSource`). A subclass makes `batches` from `my_rows`."""

    def __init__(self, order: Any, steps: int, batch_size: int, strategy: Strategy):
        self.order, self.steps, self.batch_size, self.strategy = order, steps, batch_size, strategy
        self.rows_per_step = order.per_step

    def my_rows(self, step: int) -> list[int]:
        """This rank's row indices of `step` (equal slices unless a strategy balances them by speed)."""
        first, count = self.strategy.rows_for(step, self.rows_per_step)
        return self.order.step_rows(step)[first:first + count]

    def epoch(self, done: int) -> float:
        return done / self.order.steps_per_epoch

    def note(self) -> str:
        return ""

    def replay_state(self) -> dict[str, Any]:
        return {}  # the order is a pure function of (seed, step)


@dataclass
class RunSettings:
    """What the driver reads of a run's config (`TrainConfig`, `StudentConfig`: each says how)."""

    output_dir: str
    peft_method: str
    lr: float
    weight_decay: float
    scheduler: str
    warmup_steps: int
    min_lr_ratio: float
    precision: str
    max_grad_norm: float | None
    save_every: int
    keep_last: int
    resume: bool
    optimizer: str = "adamw"
    eval_every: int = 0  # evaluate every N steps (0: at the end only)
    log_every: int = 1  # metrics lines every N steps (and the last)
    quiet: bool = True
    label: str = "train"  # the progress bar's
    final_checkpoint: bool = True  # a run saves its final state; a student's product is its adapter only
    checkpoint_meta: dict[str, Any] = field(default_factory=dict)  # what every checkpoint's state.json names
    # what a step of this run is (recorded in every checkpoint, checked on resume: `train.resume_point`);
    # None: a source that replays its own order (a student's shards) and is only told the step
    step_meaning: StepMeaning | None = None
    resume_new_data: bool = False  # continue a checkpoint over changed training rows (`--resume-new-data`)


@dataclass
class RunHooks:
    on_step: Callable[[StepInfo], None] | None = None
    # {"step": N, **metrics, "eval_s": the evaluation's seconds on this rank}, periodic and final
    on_eval: Callable[[dict], None] | None = None
    on_checkpoint: Callable[[Path, int, bool], None] | None = None  # (path, step, pausing)
    should_stop: Callable[[], str | None] | None = None  # "pause" | "cancel" | None, asked on rank 0
    on_resume: Callable[[Path, int], None] | None = None  # (checkpoint, step) restored
    on_start: Callable[[int, int], None] | None = None  # (first step, steps): the loop starts


@dataclass
class Outcome:
    """What the driver measured; `summarize` turns it into the run's result."""

    steps: int
    start_step: int = 0
    final_loss: float | None = None
    stopped: str | None = None
    tokens_per_s: float = 0.0
    eval: dict[str, Any] = field(default_factory=dict)
    adapter_dir: str | None = None
    checkpoint_dir: str | None = None
    resumed_from: str | None = None
    resume_note: str | None = None  # the one line a resume said about its position (None: nothing to say)
    optimizer: torch.optim.Optimizer | None = None
    start_samples: int = 0  # rows trained before `start_step` (the checkpoint's data position), every rank
    rows_per_step: int = 0  # every rank's rows of one step

    def samples_at(self, step: int) -> int:
        """Rows trained once `step` steps are done: the resumed position plus this process's steps."""
        return self.start_samples + (step - self.start_step) * self.rows_per_step


@dataclass
class Run(Generic[R]):
    """One run for the driver: the built model, the two parameters, and what the run records."""

    settings: RunSettings
    model: torch.nn.Module
    tokenizer: Any
    device: torch.device
    strategy: Strategy
    source: Callable[[Path | None], Source]  # made once the resume point is known (a student replays its order)
    loss_sum: LossSum
    evaluate: Callable[[], dict[str, Any]]  # every rank calls it (a sharded eval reduces across them)
    summarize: Callable[[Outcome], R]  # the result (with `to_dict()`), written as summary.json by the main rank
    # step -> its loss tokens, every rank's rows, when the data can count them (`engine.SampleSource`): a rank
    # that computes its part alone (a parameter server's worker) normalises by them (`Strategy.step_targets`)
    step_tokens: Callable[[int], float] | None = None
    hooks: RunHooks = field(default_factory=RunHooks)
    metrics: Callable[[int], MetricsWriter | None] = lambda start: None  # (first step) -> the main rank's writer
    log: Callable[[str], None] = lambda msg: None
    forward: Forward = plain_forward  # (model, batch) -> logits: a language model's, or a model kind's
    layout: BatchLayout = TOKENS  # which units of a batch carry the loss (tokens; a classifier's rows)


class Driver(Generic[R]):
    """Drives one `Run`: `run()` returns its result. Pieces are methods, in the order they happen."""

    def __init__(self, run: Run[R]):
        self.r, self.s = run, run.settings
        self.strategy, self.model = run.strategy, run.model
        self.out_dir = Path(self.s.output_dir)
        self.writer: MetricsWriter | None = None
        self.last_loss = float("nan")

    def run(self) -> R:
        self._prepare()
        self.progress = StepProgress(self.source.steps, self.s.label, quiet=self.s.quiet or not self.strategy.is_main,
                                     completed=self.outcome.start_step)
        try:
            _done, stopped = self.trainer.run(self.outcome.start_step, self.source.steps, self.source.batches,
                                              LoopHooks(after_step=self._after_step, save=self._save,
                                                        should_stop=self.r.hooks.should_stop),
                                              save_every=self.s.save_every)
        finally:
            self.progress.close()
        o = self.outcome
        o.steps = self.strategy.progress(o.steps)  # a parameter server's steps, not this rank's last
        o.final_loss = self.last_loss if self.last_loss == self.last_loss else None
        o.tokens_per_s, o.stopped = self.trainer.tokens_per_s(), stopped
        if stopped is None:
            self._finish()
        if self.writer:
            self.writer.close()
        result = self.r.summarize(o)
        if self.strategy.is_main:
            atomic_write_json(self.out_dir / "summary.json", result.to_dict())  # type: ignore[attr-defined]
        return result

    def _prepare(self) -> None:
        """Source, optimizer and schedule; the newest valid checkpoint restored when resuming; the trainer."""
        s, strategy = self.s, self.strategy
        latest = ckpt.latest_checkpoint(self.out_dir) if s.resume else None
        self.source = self.r.source(latest)
        self.optimizer = make_optimizer(self.model, s.lr, s.weight_decay, self.r.device, strategy, s.optimizer)
        self.scheduler = make_scheduler(self.optimizer, self.source.steps, s.warmup_steps, s.scheduler, s.min_lr_ratio)
        start, rows = 0, self.source.rows_per_step
        o = self.outcome = Outcome(steps=0, optimizer=self.optimizer, rows_per_step=rows)
        if latest is not None:
            # asked before any tensor is read: a checkpoint whose steps mean other samples is refused at once
            point = resume_point(ckpt.read_state(latest), s.step_meaning, rows, s.resume_new_data)
            ckpt.load_checkpoint(latest, self.model, self.optimizer, self.scheduler, strategy=strategy)
            start, o.start_samples, o.resumed_from, o.resume_note = point.step, point.samples, str(latest), point.note
            if point.note:
                self.r.log(point.note)
            if self.r.hooks.on_resume:
                self.r.hooks.on_resume(latest, start)
        self.trainer = Trainer(self.model, self.optimizer, self.scheduler, loss_sum=self.r.loss_sum,
                               device=self.r.device, strategy=strategy, precision=s.precision,
                               max_grad_norm=s.max_grad_norm, step_tokens=self.r.step_tokens,
                               forward=self.r.forward, layout=self.r.layout)
        begin = strategy.start_at(start)  # a member joining a running group starts where the others are
        if begin != start:
            with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": on purpose here
                warnings.simplefilter("ignore")
                for _ in range(begin - start):
                    self.scheduler.step()
            self.r.log(f"joined the group at step {begin}")
            o.start_samples += (begin - start) * rows
            start = begin
        o.start_step = o.steps = start
        self.writer = self.r.metrics(start) if strategy.is_main else None
        if self.r.hooks.on_start:
            self.r.hooks.on_start(start, self.source.steps)

    def _after_step(self, done: int, stats: StepStats) -> None:
        """Progress, the step hook, metrics lines and a periodic eval."""
        self.last_loss, self.outcome.steps = stats.loss, done
        steps = self.source.steps
        tps = self.trainer.tokens_per_s()
        info = StepInfo(step=done, max_steps=steps, loss=stats.loss, lr=stats.lr, grad_norm=stats.grad_norm,
                        tokens_per_s=tps, samples_done=self.outcome.samples_at(done),
                        samples_total=self.outcome.samples_at(steps),
                        epoch=self.source.epoch(done))
        self.progress.update(done, f"loss {stats.loss:.4f} · {tps:,.0f} tok/s{self.source.note()}")
        if self.r.hooks.on_step:
            self.r.hooks.on_step(info)
        if self.writer and (done % self.s.log_every == 0 or done == steps):
            self.writer.log("train", done, loss=stats.loss, lr=stats.lr, grad_norm=stats.grad_norm, tokens_per_s=tps,
                            epoch=info.epoch)
        if self.s.eval_every and done % self.s.eval_every == 0 and done != steps:
            metrics = self._evaluate(done)
            self.r.log(f"step {done}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))

    def _evaluate(self, step: int) -> dict[str, Any]:
        """The held-out metrics at `step`, logged; the hook also gets `eval_s`, the evaluation's wall seconds
        on this rank (its share of a collective's wait included): what a time-to-loss figure leaves out."""
        t0 = time.perf_counter()
        metrics = self.r.evaluate()
        spent = time.perf_counter() - t0
        if self.writer:
            self.writer.log("eval", step, **metrics)
        if self.r.hooks.on_eval:
            self.r.hooks.on_eval({"step": step, **metrics, "eval_s": round(spent, 4)})
        return metrics

    def _save(self, step: int, pausing: bool) -> None:
        """A checkpoint: every rank takes part (gathers), the main rank writes; ends in a barrier."""
        strategy = self.strategy
        step = strategy.checkpoint_step(step)  # a parameter server's consistent state may be behind this rank
        rngs = strategy.gather_rng()  # every rank takes part; the main rank gets them all
        # likewise: a sharded optimizer gathers its parts (state it streams to disk starts in the output dir)
        optim_state = strategy.optimizer_state(self.optimizer, spool_dir=self.out_dir)
        # and a sharded model its trainable weights (None: read the model)
        weights = strategy.model_state(self.model, spool_dir=self.out_dir)
        if strategy.is_main:
            path = ckpt.save_checkpoint(self.out_dir, step, self.model, self.optimizer, self.scheduler,
                                        extra={**self.source.replay_state(), **self.s.checkpoint_meta,
                                               **self._position(step)},
                                        keep_last=self.s.keep_last, rank_rng=rngs,
                                        strategy_state=strategy.state_dict(), optimizer_state=optim_state,
                                        model_state=weights)
            self.outcome.checkpoint_dir = str(path)
            if self.r.hooks.on_checkpoint:
                self.r.hooks.on_checkpoint(path, step, pausing)
        strategy.barrier()

    def _position(self, step: int) -> dict[str, Any]:
        """What a checkpoint at `step` records of the data position and of what a step means."""
        if self.s.step_meaning is None:
            return {}
        return {SAMPLES_KEY: self.outcome.samples_at(step), STATE_KEY: self.s.step_meaning.to_state()}

    def _finish(self) -> None:
        """Every step taken: the final eval, the adapter, and (a fine-tuning run) the final checkpoint."""
        o, strategy = self.outcome, self.strategy
        o.eval = self._evaluate(o.steps)
        # every rank: a sharded model gathers its weights (None: unsharded)
        weights = strategy.model_state(self.model, spool_dir=self.out_dir)
        with strategy.whole_model(self.model):  # and what a saver reads from the modules (prompt tuning) is whole
            if strategy.is_main:
                adapter_dir = self.out_dir / f"{self.s.peft_method}_adapter"
                save_adapter(self.model, adapter_dir, tokenizer=self.r.tokenizer, weights=weights)
                o.adapter_dir = str(adapter_dir)
        if self.s.final_checkpoint:
            self._save(o.steps, False)  # every rank enters: the save ends in a barrier that all must reach
        else:
            strategy.barrier()


def drive(run: Run[R]) -> R:
    """Run `run` to its end (or its pause or cancel); returns its result, also written as summary.json."""
    return Driver(run).run()
