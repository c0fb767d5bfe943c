"""The methods HF peft implements (lora, ia3, prefix, prompt): applied with `get_peft_model`, loaded
with `PeftModel.from_pretrained`, saved with `save_pretrained` (the directories the ecosystem reads)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from smolforge.errors import SmolforgeError
from smolforge.models.peft.base import PeftMethodClass

if TYPE_CHECKING:
    from torch import nn

    from smolforge.config import PeftSpec


class PeftLibMethod(PeftMethodClass):
    """A method of the peft library; subclasses give its config (`peft_config`)."""

    recheckpoint: bool = False  # peft refuses it on a checkpointing model: switch off, apply, switch on

    def peft_config(self, model: "nn.Module", spec: "PeftSpec") -> Any:
        """The peft `PeftConfig` for `spec` on `model`."""
        raise NotImplementedError(self.name)

    def apply(self, model: "nn.Module", spec: "PeftSpec") -> "nn.Module":
        from peft import get_peft_model

        from smolforge.models import peft_methods as pm

        recheckpoint = self.recheckpoint and pm._is_checkpointing(model)
        if recheckpoint:
            pm._disable_checkpointing(model)
        try:
            with pm._quiet_peft():
                peft_model = get_peft_model(model, self.peft_config(model, spec))
            return pm.enable_gradient_checkpointing(peft_model) if recheckpoint else peft_model
        except ValueError as err:  # e.g. target modules not found
            raise SmolforgeError(f"cannot apply {spec.method}: {err}".splitlines()[0],
                                 fix="check target_modules in --peft-config against the model's module names") from err

    def merge(self, model: "nn.Module", *, plain: bool) -> "nn.Module":
        """Prompt-learning methods never fold, even for in-process use (peft has no merge for them)."""
        raise self.refusal("merge")

    def load(self, base: "nn.Module", adapter_dir: Path, *, is_trainable: bool) -> "nn.Module":
        from peft import PeftModel

        from smolforge.models.peft_methods import _quiet_peft

        try:
            with _quiet_peft():
                model = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=is_trainable)
        except (RuntimeError, ValueError, KeyError) as err:
            config = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
            raise SmolforgeError(f"cannot load {self.name} adapter {adapter_dir}: {err}".splitlines()[0],
                                 fix=f"load it onto the base model it was trained on "
                                     f"({config.get('base_model_name_or_path')})") from err
        if not is_trainable:  # peft leaves prompt-learning encoders trainable even in inference mode
            for p in model.parameters():
                p.requires_grad_(False)
        return model
