"""(IA)^3 (peft): learned vectors scaling keys, values and the MLP's input to the down projection."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from smolforge.models.peft import register
from smolforge.errors import SmolforgeError
from smolforge.models.peft._peftlib import PeftLibMethod, has_conv1d, model_type
from smolforge.models.peft.base import EXPORT_TARGETS

if TYPE_CHECKING:
    import torch
    from torch import nn

    from smolforge.config import PeftSpec


@register
class IA3(PeftLibMethod):
    name = "ia3"
    label = "(IA)^3"
    peft_type = "IA3"
    merges = True
    serves = frozenset({"torch", "stages"})
    exports = frozenset(EXPORT_TARGETS)
    aggregates = True
    neutral = 1.0  # a scale a student did not learn

    def peft_config(self, model: "nn.Module", spec: "PeftSpec") -> Any:
        """peft's IA3Config: the given targets, else the family's (`models/families`), else peft's table
        for the model type; feed-forward modules (scaled on their input) kept where the user kept them."""
        from peft import IA3Config
        from peft.utils.constants import (
            TRANSFORMERS_MODELS_TO_IA3_FEEDFORWARD_MODULES_MAPPING as PEFT_FF,
            TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING as PEFT_TARGETS,
        )

        from smolforge.models.families import family_of

        mtype = model_type(model) or ""
        known = family_of(mtype).ia3_targets
        targets: list[str] | None
        if known:
            targets, feedforward = list(known[0]), list(known[1])
        elif mtype in PEFT_TARGETS:
            targets, feedforward = list(PEFT_TARGETS[mtype]), list(PEFT_FF.get(mtype, []))
        else:
            targets, feedforward = None, []
        if spec.target_modules is not None:
            given = [spec.target_modules] if isinstance(spec.target_modules, str) else list(spec.target_modules)
            # feedforward modules must be a subset of the targets: keep the family's ones the user kept
            feedforward = [m for m in feedforward if m in given]
            targets = given
        if targets is None:
            raise SmolforgeError(f"(IA)^3 has no default target modules for model type {mtype!r}",
                                 fix='name them: --peft-config \'{"target_modules": ["k_proj", "v_proj", "down_proj"]}\'')
        return IA3Config(task_type="CAUSAL_LM", target_modules=targets, feedforward_modules=feedforward,
                         fan_in_fan_out=has_conv1d(model))

    def merge(self, model: "nn.Module", *, plain: bool) -> "nn.Module":
        return model.merge_and_unload()

    def fold(self, w: "torch.Tensor", parts: "dict[str, torch.Tensor]", config: dict[str, Any]) -> "torch.Tensor":
        """Columns (feed-forward modules: the input) or rows of [out, in] `w` scaled by the learned vector."""
        return w * parts["ia3_l"]

    def fold_bias(self, bias: "torch.Tensor", parts: "dict[str, torch.Tensor] | None", weight: str,
                  config: dict[str, Any]) -> "torch.Tensor":
        """The bias of the modules scaled row-wise is scaled too (peft's merge does the same)."""
        if parts and not _is_feedforward(weight, config):
            return (bias.float() * parts["ia3_l"].reshape(bias.shape)).to(bias.dtype)
        return bias


def _is_feedforward(module_weight: str, config: dict) -> bool:
    module = module_weight[: -len(".weight")]
    return any(module == f or module.endswith("." + f) for f in (config.get("feedforward_modules") or []))
