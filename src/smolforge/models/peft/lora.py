"""LoRA (peft): W + B @ A * alpha / r (alpha / sqrt(r) with rsLoRA) on the target linears."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from smolforge.errors import SmolforgeError
from smolforge.models.peft import register
from smolforge.models.peft._peftlib import PeftLibMethod, has_conv1d, model_type
from smolforge.models.peft.base import EXPORT_TARGETS

if TYPE_CHECKING:
    import torch
    from torch import nn

    from smolforge.config import PeftSpec


# A LoRA's tensors per target: lora_A/lora_B (Linear, Conv1D) or lora_embedding_A/B (an Embedding)
LORA_PARTS = ("A.weight", "B.weight", "embedding_A", "embedding_B")


@register
class LoRA(PeftLibMethod):
    name = "lora"
    label = "LoRA"
    peft_type = "LORA"
    merges = True
    serves = frozenset({"torch", "stages"})
    exports = frozenset(EXPORT_TARGETS)
    aggregates = True
    low_rank = True
    factored = True
    split_trains = True

    def peft_config(self, model: "nn.Module", spec: "PeftSpec") -> Any:
        """peft's LoraConfig: the given targets, else the family's (`models/families`), else peft's
        "all-linear" (every Linear/Conv1D except the output head)."""
        from peft import LoraConfig

        from smolforge.models.families import family_of

        targets: Any = spec.target_modules
        if targets is None:
            targets = list(family_of(model_type(model)).lora_targets or ()) or "all-linear"
        return LoraConfig(task_type="CAUSAL_LM", r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                          target_modules=targets, fan_in_fan_out=has_conv1d(model), bias="none")

    def merge(self, model: "nn.Module", *, plain: bool) -> "nn.Module":
        return model.merge_and_unload()

    def check_tensor(self, key: str, kind: str, weights: Path) -> None:
        if kind not in LORA_PARTS:
            raise SmolforgeError(f"{weights}: {key} is a LoRA tensor export cannot merge",
                                 fix="retrain with LoRA on linear or embedding layers (smolforge train --peft lora)")

    def fold(self, w: "torch.Tensor", parts: "dict[str, torch.Tensor]", config: dict[str, Any]) -> "torch.Tensor":
        """W + B @ A * scale; an Embedding's LoRA (peft's lora_embedding_A/B) as (B @ A)^T, [vocab, dim]."""
        r = config["r"]
        scale = config["lora_alpha"] / (r ** 0.5 if config.get("use_rslora") else r)
        if "embedding_A" in parts:
            return w + (parts["embedding_B"] @ parts["embedding_A"]).T * scale
        return w + (parts["B.weight"] @ parts["A.weight"]) * scale
