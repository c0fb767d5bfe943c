"""Training a registered model kind that is not a language model (`models.kinds`: `--model mlp`).

The same driver, loop and strategies as a fine-tuning run (`train.engine`); what differs is handed to the
driver as parameters, never asked of it: the data source (feature rows in a seeded order, sliced per
rank), the forward and loss (the kind's) and the batch layout (every row carries one loss term). The
evaluation reports the held-out rows' mean loss and accuracy, each rank doing its shard. The run itself
is assembled by `train.engine.train_kind` (which `engine.train` hands a registered kind's name to).
"""

from __future__ import annotations

from typing import Any

import torch

from smolforge.data.tabular import Tabular
from smolforge.models.kinds.base import ModelKind
from smolforge.train.driver import OrderedSource
from smolforge.train.strategy import Strategy


class RowSource(OrderedSource):
    """A driver `Source` over feature rows: the engine's seeded order, each step's rows sliced per rank."""

    def __init__(self, data: Tabular, order: Any, steps: int, batch_size: int, strategy: Strategy):
        """`order`: the engine's `SampleOrder` over the training rows (its `per_step`, `step_rows`)."""
        super().__init__(order, steps, batch_size, strategy)
        self.data = data

    def batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of `step`: {"features": [rows, n_features], "labels": [rows]}."""
        mine = torch.tensor(self.my_rows(step), dtype=torch.long)
        return [{"features": self.data.train_x[idx], "labels": self.data.train_y[idx]}
                for idx in mine.split(self.batch_size)]

    def step_tokens(self, step: int) -> float:
        """Loss-carrying units of the whole global step: its rows."""
        return float(self.rows_per_step)


def evaluate_rows(kind: ModelKind, model: torch.nn.Module, data: Tabular, batch_size: int, device: torch.device,
                  strategy: Strategy) -> dict[str, float]:
    """Held-out mean loss and accuracy (fraction of rows classified right), every rank's shard summed;
    {} where the strategy gives this rank no held-out rows to count."""
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
    if not total:  # a rank the strategy leaves out of evaluation (a parameter server's worker but the first)
        return {}
    return {"eval_loss": loss_sum / total, "accuracy": correct / total}
