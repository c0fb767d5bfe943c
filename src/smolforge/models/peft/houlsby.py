"""Houlsby adapters (`--peft adapter`, `smolforge.models.houlsby`): bottleneck layers added after the
attention and MLP outputs. Extra layers, not weight deltas: served and aggregated, never merged."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from smolforge.models.peft import register
from smolforge.models.peft._peftlib import base_transformer
from smolforge.models.peft.base import PeftMethodClass

if TYPE_CHECKING:
    import torch
    from torch import nn

    from smolforge.config import PeftSpec


@register
class Houlsby(PeftMethodClass):
    name = "adapter"
    label = "Houlsby adapters"
    peft_type = "HOULSBY"  # houlsby.PEFT_TYPE (that module imports torch)
    what_it_adds = "Houlsby adapters are extra layers, not weight deltas"
    serves = frozenset({"torch", "stages"})
    aggregates = True
    factored = True  # down and up projections, trained together
    neutral = 0.0  # an adapter output a student did not learn

    def apply(self, model: "nn.Module", spec: "PeftSpec") -> "nn.Module":
        from smolforge.models import houlsby

        return houlsby.apply_houlsby(model, _adapter_size(model, spec))

    def load(self, base: "nn.Module", adapter_dir: Path, *, is_trainable: bool) -> "nn.Module":
        from smolforge.models import houlsby

        return houlsby.load_houlsby(base, adapter_dir, is_trainable=is_trainable)

    def save(self, model: "nn.Module", out: Path, weights: "dict[str, torch.Tensor] | None") -> None:
        from smolforge.models import houlsby

        houlsby.save_houlsby(model, out, state_dict=weights)


def _adapter_size(model: "nn.Module", spec: "PeftSpec") -> int:
    """Houlsby's bottleneck width: `adapter_size`, or hidden size / `reduction_factor` (how the seeds and
    AdapterHub size it, so one setting fits models of any width)."""
    if not spec.reduction_factor:
        return spec.adapter_size
    cfg = base_transformer(model).config
    hidden = getattr(cfg, "hidden_size", None) or cfg.n_embd
    return max(1, int(hidden) // spec.reduction_factor)
