"""Prefix and prompt tuning (peft): learned key/value prefixes or virtual input tokens, not weight deltas.

Neither merges, exports nor serves (their virtual tokens do not fit the server's KV cache); both run
in `generate` and `eval`, which load the adapter with peft.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from smolforge.errors import SmolforgeError
from smolforge.models.peft import register
from smolforge.models.peft._peftlib import PeftLibMethod, unwrap

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
        prefix_survives_checkpointing(unwrap(model))


@register
class PromptTuning(PeftLibMethod):
    name = "prompt"
    label = "prompt tuning"
    peft_type = "PROMPT_TUNING"
    what_it_adds = "prompt tuning adds learned virtual tokens, not weight deltas"
    serve_why = _SERVE_WHY
    pipeline_trains = False

    def peft_config(self, model: "nn.Module", spec: "PeftSpec") -> Any:
        """Prompt tuning initialised as `spec.prompt_tuning_init` says (SAMPLE_VOCAB by default: see PeftSpec).

        TEXT reads the tokenizer from where the model was loaded (`name_or_path`: a preset's or a local
        model's directory, or a hub id already in the cache), so it needs nothing from the network.
        """
        from peft import PromptTuningConfig

        kwargs: dict[str, Any] = {"prompt_tuning_init": spec.prompt_tuning_init}
        if spec.prompt_tuning_init == "TEXT":
            kwargs.update(prompt_tuning_init_text=spec.prompt_tuning_init_text,
                          tokenizer_name_or_path=getattr(unwrap(model), "name_or_path", None) or None)
            if kwargs["tokenizer_name_or_path"] is None:
                raise SmolforgeError("prompt_tuning_init TEXT needs the model's tokenizer, and this model does not say "
                                     "where it was loaded from", fix="use prompt_tuning_init SAMPLE_VOCAB, or load the "
                                     "model from a directory or hub id")
        return PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=spec.num_virtual_tokens, **kwargs)

    def virtual_tokens(self, model: "nn.Module") -> int:
        """`num_virtual_tokens` per transformer submodule: the positions prepended to the logits."""
        config = model.peft_config[model.active_adapter]
        return int(config.num_virtual_tokens) * int(getattr(config, "num_transformer_submodules", 1) or 1)


def _read_only_prefix_cache(cache: Any) -> Any:
    """Make each layer of peft's prefix cache return `cat(prefix, new)` without storing `new`.

    A checkpointed block runs its forward twice (forward, then the recompute in backward). With
    an ordinary DynamicCache the second run would append its keys again and see a longer
    sequence. Read-only layers give both runs the same keys, and the attention mask (computed once
    from the prefix length before any layer runs) is the same as without checkpointing.
    """
    from transformers.cache_utils import DynamicLayer

    read_only = _read_only_layer_class()
    for layer in getattr(cache, "layers", []):
        if type(layer) is DynamicLayer:
            layer.__class__ = read_only
        elif not isinstance(layer, read_only):
            raise SmolforgeError(
                f"prefix tuning with gradient checkpointing does not support {type(layer).__name__} cache layers",
                fix="turn gradient checkpointing off for this model, or use --peft lora / prompt",
            )
    return cache


def prefix_survives_checkpointing(model: "nn.Module") -> None:
    """Let prefix tuning's KV prefix pass through checkpointed blocks.

    peft hands the learned prefix to the model as a pre-filled KV cache, and transformers drops
    any cache a checkpointed block receives (because a block that writes to the cache would write
    twice). We make the training-time prefix cache read-only and tell the blocks it is safe to keep.
    """
    import types

    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    if not layers:
        raise SmolforgeError(
            "prefix tuning with gradient checkpointing needs a model whose blocks checkpoint themselves "
            "(transformers' GradientCheckpointingLayer)",
            fix="turn gradient checkpointing off for this model, or use --peft lora / prompt",
        )
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module._can_checkpoint_with_cache = True
        elif getattr(module, "gradient_checkpointing", False):
            # Backbones such as GPT2Model drop the cache themselves when this flag is on; the
            # blocks above do the checkpointing, so the backbone flag only has that effect.
            module.gradient_checkpointing = False
    if getattr(model, "_smolforge_prefix_ckpt", False):
        return
    original = model.get_prompt

    def get_prompt(self, *args, **kwargs):
        prompt = original(*args, **kwargs)
        if self.training:
            prompt = _read_only_prefix_cache(prompt)
        return prompt

    model.get_prompt = types.MethodType(get_prompt, model)
    model._smolforge_prefix_ckpt = True


@functools.cache
def _read_only_layer_class():
    import torch
    from transformers.cache_utils import DynamicLayer

    class ReadOnlyPrefixLayer(DynamicLayer):
        """A DynamicLayer whose `update` returns prefix + new states and stores nothing."""

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                return key_states, value_states
            return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)

    return ReadOnlyPrefixLayer

