"""(IA)^3 (peft): learned vectors scaling keys, values and the MLP's input to the down projection."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from smolforge.models.peft import register
from smolforge.models.peft._peftlib import PeftLibMethod
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
        from smolforge.models.peft_methods import _ia3_config

        return _ia3_config(model, spec)

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
