"""Prefix and prompt tuning (peft): learned key/value prefixes or virtual input tokens, not weight deltas.

Neither merges, exports nor serves (their virtual tokens do not fit the server's KV cache); both run
in `generate` and `eval`, which load the adapter with peft.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from smolforge.models.peft import register
from smolforge.models.peft._peftlib import PeftLibMethod

if TYPE_CHECKING:
    from torch import nn

    from smolforge.config import PeftSpec

_SERVE_WHY = "its virtual tokens do not fit the server's KV cache"


@register
class PrefixTuning(PeftLibMethod):
    name = "prefix"
    label = "prefix tuning"
    peft_type = "PREFIX_TUNING"
    what_it_adds = "prefix tuning adds learned key/value prefixes, not weight deltas"
    serve_why = _SERVE_WHY
    pipeline_trains = False
    recheckpoint = True

    def peft_config(self, model: "nn.Module", spec: "PeftSpec") -> Any:
        from peft import PrefixTuningConfig

        return PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=spec.num_virtual_tokens)

    def after_checkpointing(self, model: "nn.Module") -> None:
        from smolforge.models.peft_methods import _prefix_survives_checkpointing, _unwrap

        _prefix_survives_checkpointing(_unwrap(model))


@register
class PromptTuning(PeftLibMethod):
    name = "prompt"
    label = "prompt tuning"
    peft_type = "PROMPT_TUNING"
    what_it_adds = "prompt tuning adds learned virtual tokens, not weight deltas"
    serve_why = _SERVE_WHY
    pipeline_trains = False

    def peft_config(self, model: "nn.Module", spec: "PeftSpec") -> Any:
        from smolforge.models.peft_methods import _prompt_config

        return _prompt_config(model, spec)

    def virtual_tokens(self, model: "nn.Module") -> int:
        """`num_virtual_tokens` per transformer submodule: the positions prepended to the logits."""
        config = model.peft_config[model.active_adapter]
        return int(config.num_virtual_tokens) * int(getattr(config, "num_transformer_submodules", 1) or 1)
