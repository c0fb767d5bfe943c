"""The training engine: fine-tuning on a loaded dataset, which is also each rank of a data-parallel group.

`train` loads the tokenizer, the data and the model, then hands the run to the one driver
(`smolforge.train.driver`) with its data source (`SampleSource`) and its loss (token cross-entropy);
a distillation student is the same driver with a shard stream and KD + CE.

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
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from smolforge.config import TrainConfig
from smolforge.data.collate import collate
from smolforge.data.encode import IGNORE, fold_note
from smolforge.data.splits import Splits
from smolforge.data.tabular import load_tabular
from smolforge.errors import SmolforgeError
from smolforge.models.kinds import model_kind
from smolforge.models.kinds.base import ModelKind
from smolforge.models.loading import load_model, load_tokenizer
from smolforge.models.peft import FULL
from smolforge.models.peft_methods import apply_peft, enable_gradient_checkpointing, trainable_summary
from smolforge.models.tied import tied_change
from smolforge.rundir import check_run_dir, record
from smolforge.telemetry.memory import peak_rss_mb
from smolforge.telemetry.sinks import run_name
from smolforge.telemetry.writers import MetricsWriter
from smolforge.train import checkpoint as ckpt
from smolforge.train.driver import (  # noqa: F401  (StepInfo, available_cpus: re-exported, callers import them here)
    OrderedSource,
    Outcome,
    Run,
    RunHooks,
    RunSettings,
    StepInfo,
    available_cpus,
    drive,
    prepare_process,
)
from smolforge.train.evaluate import eval_loss_sums, exact_match_counts, perplexity, token_loss_sum
from smolforge.train.kind_run import RowSource, evaluate_rows
from smolforge.train.loop import optimizer_state_bytes
from smolforge.train.rendering import load_checked_splits
from smolforge.train.resume_point import StepMeaning, data_fingerprint
from smolforge.train.step_loss import StepLoss
from smolforge.train.strategy import BatchLayout, Strategy


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
    checkpoint_bytes_read: int = 0  # read from the checkpoint it resumed from (a sharded strategy: its shards)
    comm_wait_s: float = 0.0  # time this process spent waiting in collectives
    batch_rows: list[int] | None = None  # rows per rank of the last step when balanced (None: equal slices)
    rounds: int | None = None  # outer steps, for strategies that have them (DiLoCo)
    strategy_metrics: dict[str, float] = field(default_factory=dict)  # Strategy.metrics(): staleness, waits...
    samples: int = 0  # sequences trained on, every rank together
    peak_rss_mb: float = 0.0
    # this rank's raw part of the last global step it counted in: a job's final_loss merges every rank's
    # (`train.step_loss.final_loss`), where `final_loss` above is this rank's own view of its last step
    last_step_loss: StepLoss | None = None
    # the tied weights the adapter changes (e.g. ["lm_head.weight"]): merging unties them (models/tied.py)
    untied: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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


def steps_for(max_steps: int | None, epochs: float, order: SampleOrder) -> int:
    """A run's optimizer steps: `max_steps` when set, else `epochs` over the order (at least one)."""
    if max_steps:
        return max_steps
    return max(1, math.ceil(epochs * order.steps_per_epoch))


def total_steps(cfg: TrainConfig, order: SampleOrder) -> int:
    return steps_for(cfg.max_steps, cfg.epochs, order)


def build_model(cfg: TrainConfig, device: torch.device, tokenizer=None, strategy: Strategy | None = None):
    """Tokenizer and the PEFT-wrapped model on device (`strategy` loads it: a pipeline rank, its stage only)."""

    tokenizer = tokenizer or load_tokenizer(cfg.model)
    # a pipeline plans its stages' activations from the run's batch (`run`)
    model = (strategy.load_model(cfg.model, device=device, dtype=cfg.dtype, run=cfg) if strategy is not None
             else load_model(cfg.model, device=device, dtype=cfg.dtype, training=True))
    model = apply_peft(model, cfg.peft)  # peft keeps LoRA/IA3 weights in fp32 on a bf16/fp16 base
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    model.to(device)
    return tokenizer, model


def evaluate(model, tokenizer, splits: Splits, cfg: TrainConfig, device, accuracy: bool = True,
             strategy: Strategy | None = None) -> dict[str, Any]:
    """Eval loss/perplexity (and accuracy where answers exist), each rank doing its shard."""
    strategy = strategy or Strategy()
    examples = splits.eval_examples if accuracy and cfg.eval_accuracy else []
    sums = strategy.eval_sums(model, splits.eval, examples or [], tokenizer, batch_size=cfg.batch_size * 2,
                              max_new_tokens=cfg.max_new_tokens, device=device)  # a pipeline: through its stages
    if sums is None:
        sums = _eval_sums_whole(model, tokenizer, splits.eval, examples or [], cfg, device, strategy)
    loss_sum, count, correct, total = sums
    out: dict[str, Any] = {}
    if count:
        out["eval_loss"] = loss_sum / count
        out["perplexity"] = perplexity(out["eval_loss"])
    if total:
        out["accuracy"] = correct / total
    return out


def _eval_sums_whole(model, tokenizer, rows: list, examples: list, cfg: TrainConfig, device,
                     strategy: Strategy) -> list[float]:
    """Each rank its shard, on whole weights; the sums over every rank."""
    rows = strategy.shard(rows)
    with strategy.whole_model(model):  # ranks make different numbers of forwards: none may be a collective
        loss_sum, count = eval_loss_sums(model, rows, tokenizer.pad_token_id, cfg.batch_size * 2, device)
        correct = total = 0
        if examples:
            correct, total = exact_match_counts(model, tokenizer, strategy.shard(examples), cfg.max_new_tokens, 64,
                                                device)
    return strategy.reduce([loss_sum, count, correct, total], device)


def run_outputs(cfg: TrainConfig) -> tuple[str, ...]:
    """The top-level names a training run writes in its --output-dir (recorded in its manifest)."""
    return ("checkpoints", f"{cfg.peft.method}_adapter", "summary.json", "metrics.jsonl", "tensorboard", "wandb")


def refuse_used_output_dir(cfg: TrainConfig, run_kind: str = "train") -> None:
    """Claim --output-dir for a `run_kind` run (`rundir`): a directory whose manifest names another kind
    of run (a demo's, an export's) is refused, nothing deleted. A fresh run into a directory holding
    another run's checkpoints would lose either way: pruning keeps the highest steps (the old run's),
    deleting the new checkpoints, and a later --resume would continue the old run. So it is refused too."""
    run = check_run_dir(cfg.output_dir, run_kind)
    if not cfg.resume:
        old = ckpt.list_checkpoints(cfg.output_dir)
        if old:
            raise SmolforgeError(f"{cfg.output_dir} already holds checkpoints of a run (up to {old[-1].name})",
                                 where="--output-dir",
                                 fix="pass --resume to continue that run, or choose a new --output-dir "
                                     "(nothing was deleted)")
    record(run, run_outputs(cfg))


class SampleSource(OrderedSource):
    """The engine's data (a driver `Source`): a seeded order over a loaded dataset, each step's rows
    sliced per rank (equal slices unless a strategy balances them by speed)."""

    def __init__(self, rows: list, order: SampleOrder, steps: int, batch_size: int, pad_id: int, strategy: Strategy):
        super().__init__(order, steps, batch_size, strategy)
        self.rows, self.pad_id = rows, pad_id

    def batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        mine = self.my_rows(step)
        return [collate([self.rows[i] for i in mine[j:j + self.batch_size]], self.pad_id)
                for j in range(0, len(mine), self.batch_size)]

    def step_tokens(self, step: int) -> float:
        """Loss tokens of the whole global step (what `target_tokens` counts on its collated rows)."""
        return float(sum(sum(1 for t in self.rows[i]["labels"][1:] if t != IGNORE) for i in self.order.step_rows(step)))


def step_meaning(cfg: TrainConfig, strategy: Strategy, rows: list) -> StepMeaning:
    """What one step of this run is (`train.resume_point`): its rows per step and how they are made, the
    order's seed, and the training rows as encoded."""
    return StepMeaning(rows_per_step=cfg.batch_size * cfg.grad_accum * strategy.world, batch_size=cfg.batch_size,
                       grad_accum=cfg.grad_accum, world=strategy.world, seed=cfg.seed, max_length=cfg.data.max_length,
                       packing=cfg.data.packing, data_rows=len(rows), data_sha256=data_fingerprint(rows))


def run_settings(cfg: TrainConfig, strategy: Strategy, meaning: StepMeaning | None = None) -> RunSettings:
    """What the driver reads of a `TrainConfig` (`meaning`: what a step of it is, `step_meaning`)."""
    return RunSettings(output_dir=cfg.output_dir, peft_method=cfg.peft.method, lr=cfg.lr, weight_decay=cfg.weight_decay,
                       scheduler=cfg.scheduler, warmup_steps=cfg.warmup_steps, min_lr_ratio=cfg.min_lr_ratio,
                       precision=cfg.precision, max_grad_norm=cfg.max_grad_norm, save_every=cfg.save_every,
                       keep_last=cfg.keep_last, resume=cfg.resume, optimizer=cfg.optimizer, eval_every=cfg.eval_every,
                       log_every=cfg.log_every, quiet=cfg.quiet or not strategy.is_main, label="train",
                       checkpoint_meta={"model": cfg.model, "peft": cfg.peft.method, "strategy": strategy.name,
                                        "world": strategy.world},
                       step_meaning=meaning, resume_new_data=cfg.resume_new_data)


def train(cfg: TrainConfig, hooks: TrainHooks | None = None, *, splits: Splits | None = None,
          model=None, tokenizer=None, strategy: Strategy | None = None, examples=None,
          run_kind: str = "train") -> TrainResult:
    """Run training as cfg says; returns the summary. Pass splits/model/tokenizer to reuse loaded ones,
    or `examples` (read_spec(cfg.data), read by a caller that checked the data before loading torch).

    `run_kind` is the kind its --output-dir's manifest records (`rundir`: `demo` for the fine-tune demo).
    `strategy` shares the work with other ranks (smolforge.parallel.strategies); default: one process.
    The run itself is the one driver's (`smolforge.train.driver`): this loads, then hands it the data
    source (`SampleSource`) and the loss (token cross-entropy).
    """

    kind = model_kind(cfg.model)  # a registered kind that is not a language model (`--model mlp`)
    if kind is not None:
        return train_kind(cfg, kind, hooks, strategy)
    hooks = hooks or TrainHooks()
    strategy = strategy or Strategy()
    t_start = time.perf_counter()
    device = prepare_process(cfg.num_threads, cfg.device, strategy)
    torch.manual_seed(cfg.seed)
    tokenizer, splits, model = _load(cfg, device, strategy, splits, model, tokenizer, examples, run_kind)
    if hooks.on_model:
        hooks.on_model(model)
    trainable, total_params = trainable_summary(model)
    log = (lambda *a: None) if cfg.quiet or not strategy.is_main else _printer()
    log(f"model {cfg.model}: trainable params: {trainable:,} || all params: {total_params:,} || "
        f"trainable%: {100 * trainable / max(1, total_params):.2f}")
    untie = tied_change(model)
    if untie is not None:
        log(untie.message())
    st = splits.stats
    log(f"data: {st['train_sequences']} train / {st['eval_sequences']} eval sequences ({st['format']}); "
        f"truncated {st['truncated']}, skipped lines {st['skipped_lines']}, dropped {st['dropped_no_target']}")
    if splits.folded:
        log(fold_note(splits.folded, cfg.model))
    meaning = step_meaning(cfg, strategy, splits.train)
    order = SampleOrder(len(splits.train), meaning.rows_per_step, cfg.seed)
    source = SampleSource(splits.train, order, total_steps(cfg, order), cfg.batch_size, tokenizer.pad_token_id, strategy)

    def summarize(o: Outcome) -> TrainResult:
        result = TrainResult(output_dir=str(Path(cfg.output_dir)), adapter_dir=o.adapter_dir, steps=o.steps,
                             final_loss=o.final_loss, eval=o.eval, tokens_per_s=o.tokens_per_s,
                             trainable_params=trainable, total_params=total_params, stopped=o.stopped,
                             checkpoint_dir=o.checkpoint_dir,
                             data=splits.stats | {"resumed_from": o.resumed_from, "resume_note": o.resume_note},
                             samples=o.samples_at(o.steps),  # what was trained: the resumed position, then ours
                             untied=list(untie.changed) if untie is not None else [])
        _strategy_figures(result, strategy, o.optimizer)
        result.seconds = time.perf_counter() - t_start
        if result.eval:
            log("eval: " + ", ".join(f"{k} {v:.4f}" for k, v in result.eval.items()))
        return result

    return drive(Run(
        settings=run_settings(cfg, strategy, meaning), model=model, tokenizer=tokenizer, device=device, strategy=strategy,
        source=lambda _latest: source, loss_sum=lambda logits, m: token_loss_sum(logits, m["labels"])[0],
        step_tokens=source.step_tokens,
        evaluate=lambda: evaluate(model, tokenizer, splits, cfg, device, strategy=strategy), summarize=summarize,
        hooks=RunHooks(on_step=hooks.on_step, on_eval=hooks.on_eval, should_stop=hooks.should_stop,
                       on_checkpoint=(lambda path, step, _pausing: hooks.on_checkpoint(path, step))
                       if hooks.on_checkpoint else None,
                       on_resume=lambda path, step: log(f"resumed from {path} at step {step}")),
        metrics=lambda start: MetricsWriter(Path(cfg.output_dir), tensorboard=cfg.tensorboard is not False,
                                            append=start > 0, wandb=cfg.wandb,
                                            run_name=run_name("single", "trainer", 0, cfg.lr, cfg.batch_size),
                                            config=cfg.model_dump(mode="json")),
        log=log))


def train_kind(cfg: TrainConfig, kind: ModelKind, hooks: TrainHooks | None = None,
               strategy: Strategy | None = None) -> TrainResult:
    """Train `kind` on the feature-row dataset `cfg.data.path` names (`data.tabular`: "digits") under
    `strategy`; every parameter trains (whatever cfg.peft says: the run is a full one, its weights written
    to `none_adapter/model.safetensors`). Returns the summary, held-out `accuracy` and `eval_loss` in `eval`.
    Raises SmolforgeError for an unknown dataset name."""
    cfg = cfg.model_copy(update={"peft": cfg.peft.model_copy(update={"method": FULL})})
    hooks, strategy = hooks or TrainHooks(), strategy or Strategy()
    t_start = time.perf_counter()
    device = prepare_process(cfg.num_threads, cfg.device, strategy)
    torch.manual_seed(cfg.seed)
    refuse_used_output_dir(cfg)
    data = load_tabular(str(cfg.data.path))  # `--dataset digits`: a name every node resolves (data.tabular)
    model = kind.build(data.n_features, data.n_classes).to(device)
    if hooks.on_model:
        hooks.on_model(model)
    params = sum(p.numel() for p in model.parameters())
    meaning = StepMeaning(rows_per_step=cfg.batch_size * cfg.grad_accum * strategy.world, batch_size=cfg.batch_size,
                          grad_accum=cfg.grad_accum, world=strategy.world, seed=cfg.seed, max_length=data.n_features,
                          packing=False, data_rows=len(data.train_y), data_sha256=data.fingerprint())
    order = SampleOrder(len(data.train_y), meaning.rows_per_step, cfg.seed)
    source = RowSource(data, order, total_steps(cfg, order), cfg.batch_size, strategy)
    settings = run_settings(cfg, strategy, meaning)

    def summarize(o: Outcome) -> TrainResult:
        result = TrainResult(output_dir=str(Path(cfg.output_dir)), adapter_dir=o.adapter_dir, steps=o.steps,
                             final_loss=o.final_loss, eval=o.eval, tokens_per_s=o.tokens_per_s,
                             trainable_params=params, total_params=params, stopped=o.stopped,
                             checkpoint_dir=o.checkpoint_dir, samples=o.samples_at(o.steps),
                             data=data.stats() | {"resumed_from": o.resumed_from, "resume_note": o.resume_note})
        _strategy_figures(result, strategy, o.optimizer)
        result.seconds = time.perf_counter() - t_start
        return result

    return drive(Run(
        settings=settings, model=model, tokenizer=None, device=device, strategy=strategy,
        source=lambda _latest: source, loss_sum=kind.loss_sum, forward=kind.forward, step_tokens=source.step_tokens,
        layout=BatchLayout(targets=kind.targets, units=kind.units, rows=kind.rows),
        evaluate=lambda: evaluate_rows(kind, model, data, cfg.batch_size * 4, device, strategy), summarize=summarize,
        hooks=RunHooks(on_step=hooks.on_step, on_eval=hooks.on_eval, should_stop=hooks.should_stop,
                       on_checkpoint=(lambda path, step, _pausing: hooks.on_checkpoint(path, step))
                       if hooks.on_checkpoint else None),
        metrics=lambda start: MetricsWriter(Path(cfg.output_dir), tensorboard=cfg.tensorboard is not False,
                                            append=start > 0, wandb=cfg.wandb)))


def _load(cfg: TrainConfig, device: torch.device, strategy: Strategy, splits: Splits | None, model, tokenizer,
          examples, run_kind: str = "train") -> tuple[Any, Splits, torch.nn.Module]:
    """Tokenizer, data, then the model: bad data fails in a second, not after a model load."""
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.model)
    refuse_used_output_dir(cfg, run_kind)
    if splits is None:
        splits = load_checked_splits(cfg.data, tokenizer, read=examples)
    if not splits.train:  # every answer cut off by max_length: refuse, not a modulo by zero rows later
        raise SmolforgeError(
            f"no training example keeps an answer token within max_length {cfg.data.max_length} "
            f"({splits.train_stats.dropped_no_target} dropped: the prompt, with the chat template, fills it)",
            where=str(cfg.data.path), fix="raise --max-length (data.max_length)")
    if model is None:
        tokenizer, model = build_model(cfg, device, tokenizer, strategy)
    return tokenizer, splits, model


def _strategy_figures(result: TrainResult, strategy: Strategy, optimizer) -> None:
    """What the strategy counted while training (bytes, waits, rows, rounds, its own metrics)."""
    result.strategy, result.optimizer_state_bytes = strategy.name, optimizer_state_bytes(optimizer)
    result.comm_bytes_sent, result.peak_rss_mb = strategy.bytes_sent, peak_rss_mb()
    result.checkpoint_bytes_sent = strategy.checkpoint_bytes_sent
    result.checkpoint_bytes_read = strategy.checkpoint_bytes_read
    result.comm_wait_s, result.batch_rows = strategy.comm_wait_s, strategy.rows
    result.rounds = strategy.rounds
    result.strategy_metrics = strategy.metrics()
    result.last_step_loss = strategy.last_loss


def _printer():
    from rich.console import Console

    con = Console(stderr=True, highlight=False)
    return lambda msg: con.print(msg, markup=False)
