"""The interface of a model kind (`models.kinds`): a module, its batches, its loss and its metric."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

Batch = dict[str, torch.Tensor]


class ModelKind:
    """A model that is not a causal language model: a classifier over feature rows by default.

    Batches are {"features": float [rows, n_features], "labels": long [rows]}; every row carries one
    loss term, so `targets`, `units` and `rows` all count rows. A kind whose batches differ overrides them.
    """

    name: ClassVar[str] = ""
    adapters: ClassVar[bool] = False
    """Whether a PEFT method applies (`--peft`, `--lora-r`, `--lora-alpha`); False: every parameter trains."""
    sequences: ClassVar[bool] = False
    """Whether its rows are token sequences (`--max-length`, `--packing`); False: feature vectors."""

    def build(self, n_features: int, n_classes: int) -> nn.Module:
        """The untrained module (float32, on CPU), drawn from torch's global RNG."""
        raise NotImplementedError(self.name)

    def forward(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Logits [rows, n_classes]."""
        return model(batch["features"])

    def loss_sum(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Cross-entropy summed over the batch's rows (fp32 scalar)."""
        return nn.functional.cross_entropy(logits.float(), batch["labels"], reduction="sum")

    def correct(self, logits: torch.Tensor, batch: Batch) -> int:
        """Rows whose arg-max class is their label."""
        return int((logits.argmax(-1) == batch["labels"]).sum())

    @staticmethod
    def targets(batch: Batch) -> int:
        """Loss-carrying units of a batch: its rows."""
        return int(batch["labels"].shape[0])

    units = targets  # throughput counts rows
    rows = targets
