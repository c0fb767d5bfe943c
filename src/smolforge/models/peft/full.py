"""Full fine-tuning (`--peft none`): every weight trains; its "adapter" directory is a whole model."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from smolforge.models.peft import FULL, register
from smolforge.models.peft.base import EXPORT_TARGETS, PeftMethodClass

if TYPE_CHECKING:
    import torch
    from torch import nn

    from smolforge.config import PeftSpec


@register
class FullFineTuning(PeftMethodClass):
    name = FULL
    label = "a full fine-tune"
    full_model = True
    merges = True  # its directory is the new base
    serves = frozenset({"torch", "stages"})
    exports = frozenset(EXPORT_TARGETS)
    aggregates = True

    def apply(self, model: "nn.Module", spec: "PeftSpec") -> "nn.Module":
        for p in model.parameters():
            p.requires_grad_(True)
        return model

    def load(self, base: "nn.Module", adapter_dir: Path, *, is_trainable: bool) -> "nn.Module":
        """The saved full model, in `base`'s dtype and on its device (`base` supplies only those)."""
        from transformers import AutoModelForCausalLM

        ref = next(base.parameters())
        model = AutoModelForCausalLM.from_pretrained(str(adapter_dir), dtype=ref.dtype).to(ref.device)
        for p in model.parameters():
            p.requires_grad_(is_trainable)
        return model

    def save(self, model: "nn.Module", out: Path, weights: "dict[str, torch.Tensor] | Path | None") -> None:
        """`save_pretrained`, or, with `weights` a streamed safetensors file, what it would write around
        that file (moved, never loaded whole)."""
        if isinstance(weights, Path):
            _save_full_model_file(model, weights, out)
        else:
            super().save(model, out, weights)

    def merge(self, model: "nn.Module", *, plain: bool) -> "nn.Module":
        return model


def _save_full_model_file(model: "nn.Module", weights_file: Path, out: Path) -> None:
    """What `save_pretrained` writes for a full model, with its weights already in `weights_file`."""
    config = model.config
    # FSDP swaps the model's class for a subclass (FSDPLlamaForCausalLM); the file names the model's own
    own = next(c for c in type(model).__mro__ if c.__module__.startswith("transformers."))
    architectures = config.architectures
    config.architectures = [own.__name__]
    try:
        config.save_pretrained(out)
    finally:
        config.architectures = architectures
    generation = getattr(model, "generation_config", None)
    if generation is not None and model.can_generate():
        generation.save_pretrained(out)
    shutil.move(str(weights_file), out / "model.safetensors")
