"""`--model mlp`: a two-layer perceptron classifier (default data: scikit-learn's handwritten digits)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from smolforge.models.kinds.base import ModelKind

HIDDEN = 128


class Mlp(nn.Sequential):
    """Linear -> ReLU -> Linear: features [rows, n_features] -> logits [rows, n_classes]."""

    def __init__(self, n_features: int, n_classes: int, hidden: int = HIDDEN):
        super().__init__(nn.Linear(n_features, hidden), nn.ReLU(), nn.Linear(hidden, n_classes))

    def save_pretrained(self, out: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """`out/model.safetensors` (what the run writes as its trained model; `state_dict`: gathered weights)."""
        from safetensors.torch import save_file

        weights = state_dict if state_dict is not None else self.state_dict()
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(Path(out) / "model.safetensors"))


class MlpKind(ModelKind):
    name = "mlp"

    def build(self, n_features: int, n_classes: int) -> nn.Module:
        return Mlp(n_features, n_classes)
