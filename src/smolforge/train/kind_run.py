"""Training a registered model kind that is not a language model (`models.kinds`: `--model mlp`).

The same driver, loop and strategies as a fine-tuning run (`train.engine`); what differs is handed to the
driver as parameters, never asked of it: the data source (feature rows in a seeded order, sliced per
rank), the forward and loss (the kind's) and the batch layout (every row carries one loss term). The
evaluation reports the held-out rows' mean loss and accuracy, each rank doing its shard.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from smolforge.config import TrainConfig
from smolforge.data.tabular import Tabular, load_tabular
from smolforge.models.kinds.base import ModelKind
from smolforge.telemetry.writers import MetricsWriter
from smolforge.train.driver import Outcome, Run, RunHooks, drive, prepare_process
from smolforge.train.engine import (SampleOrder, TrainHooks, TrainResult, _strategy_figures, refuse_used_output_dir,
                                    run_settings, total_steps)
from smolforge.train.resume_point import StepMeaning
from smolforge.train.strategy import BatchLayout, Strategy


class RowSource:
    """A driver `Source` over feature rows: the engine's seeded order, each step's rows sliced per rank."""

    def __init__(self, data: Tabular, order: SampleOrder, steps: int, batch_size: int, strategy: Strategy):
        self.data, self.order, self.steps, self.batch_size, self.strategy = data, order, steps, batch_size, strategy
        self.rows_per_step = order.per_step

    def batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of `step`: {"features": [rows, n_features], "labels": [rows]}."""
        first, count = self.strategy.rows_for(step, self.rows_per_step)
        mine = torch.tensor(self.order.step_rows(step)[first:first + count], dtype=torch.long)
        return [{"features": self.data.train_x[idx], "labels": self.data.train_y[idx]}
                for idx in mine.split(self.batch_size)]

    def step_tokens(self, step: int) -> float:
        """Loss-carrying units of the whole global step: its rows."""
        return float(self.rows_per_step)

    def epoch(self, done: int) -> float:
        return done / self.order.steps_per_epoch

    def note(self) -> str:
        return ""

    def replay_state(self) -> dict[str, Any]:
        return {}  # the order is a pure function of (seed, step)


def evaluate_rows(kind: ModelKind, model: torch.nn.Module, data: Tabular, batch_size: int, device: torch.device,
                  strategy: Strategy) -> dict[str, float]:
    """Held-out mean loss and accuracy (fraction of rows classified right), every rank's shard summed."""
    idx = strategy.shard(list(range(len(data.eval_y))))
    loss_sum = correct = 0.0
    with strategy.whole_model(model), torch.no_grad():
        was_training = model.training
        model.eval()
        for part in torch.tensor(idx, dtype=torch.long).split(max(1, batch_size)):
            batch = {"features": data.eval_x[part].to(device), "labels": data.eval_y[part].to(device)}
            logits = kind.forward(model, batch)
            loss_sum += float(kind.loss_sum(logits, batch))
            correct += kind.correct(logits, batch)
        model.train(was_training)
    loss_sum, correct, total = strategy.reduce([loss_sum, correct, float(len(idx))], device)
    return {"eval_loss": loss_sum / max(1.0, total), "accuracy": correct / max(1.0, total)}


def train_kind(cfg: TrainConfig, kind: ModelKind, hooks: TrainHooks | None = None,
               strategy: Strategy | None = None) -> TrainResult:
    """Train `kind` on the dataset `cfg.data.path` names (default: the kind's) under `strategy`; every
    parameter trains (cfg.peft is not asked). Returns the summary, held-out accuracy in `eval`."""
    hooks, strategy = hooks or TrainHooks(), strategy or Strategy()
    t_start = time.perf_counter()
    device = prepare_process(cfg.num_threads, cfg.device, strategy)
    torch.manual_seed(cfg.seed)
    refuse_used_output_dir(cfg)
    data = load_tabular(str(cfg.data.path) if cfg.data.path not in (None, "", "bundled") else kind.default_dataset)
    model = kind.build(data.n_features, data.n_classes).to(device)
    if hooks.on_model:
        hooks.on_model(model)
    params = sum(p.numel() for p in model.parameters())
    meaning = StepMeaning(rows_per_step=cfg.batch_size * cfg.grad_accum * strategy.world, batch_size=cfg.batch_size,
                          grad_accum=cfg.grad_accum, world=strategy.world, seed=cfg.seed, max_length=data.n_features,
                          packing=False, data_rows=len(data.train_y), data_sha256=data.fingerprint())
    order = SampleOrder(len(data.train_y), meaning.rows_per_step, cfg.seed)
    source = RowSource(data, order, total_steps(cfg, order), cfg.batch_size, strategy)
    strategy.step_tokens = source.step_tokens
    settings = run_settings(cfg, strategy, meaning)
    settings.peft_method = "none"  # the whole module trains: its weights are what the run writes

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
        source=lambda _latest: source, loss_sum=kind.loss_sum, forward=kind.forward,
        layout=BatchLayout(targets=kind.targets, units=kind.units, rows=kind.rows),
        evaluate=lambda: evaluate_rows(kind, model, data, cfg.batch_size * 4, device, strategy), summarize=summarize,
        hooks=RunHooks(on_step=hooks.on_step, on_eval=hooks.on_eval, should_stop=hooks.should_stop,
                       on_checkpoint=(lambda path, step, _pausing: hooks.on_checkpoint(path, step))
                       if hooks.on_checkpoint else None),
        metrics=lambda start: MetricsWriter(Path(cfg.output_dir), tensorboard=cfg.tensorboard is not False,
                                            append=start > 0, wandb=cfg.wandb)))
