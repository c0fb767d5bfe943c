"""`Family`: everything a path needs to know about one kind of model, in one class.

A family class answers, for the model types it registers (`model_types`):
- generation: the stop set (`stop_ids`: generation config EOS ids, tokenizer EOS, the chat template's
  end of turn), the chat template's abilities (`chat`: system role, tools, time, end of turn) and the
  tool-call text format (`tool_calls`: Hermes' `<tool_call>` JSON, Llama 3's JSON; toolcalls.py);
- structure: where the decoder layers live and what surrounds them (`layers_prefix`, `final_norm`,
  `rotary`, the extra embeddings a first stage holds and how it embeds), whether the head is tied by
  default (`tied`), whether the model can be cut into stages (`stages`);
- PEFT: default LoRA targets (`lora_targets`: None = every linear layer, peft's "all-linear"), split
  learning's (`split_lora_targets`), whether LoRA's weights are stored fan-in × fan-out (`fan_in_fan_out`:
  GPT-2's Conv1D), (IA)³'s targets and Houlsby adapters' sites;
- export: the GGUF architecture (`gguf_arch`, None: no GGUF export), its hyper-parameters, the tensor
  layout llama.cpp expects (`gguf_fix`) and whether a tied head is written explicitly (`gguf_untie`).

Every path asks `family_of(config)` (models/families/__init__.py) and nothing else; a model type no
class registers gets `Generic`, whose answers come from the model's own config and template.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from smolforge.errors import SmolforgeError
from smolforge.models.families import chat as _chat
from smolforge.models.families import stops as _stops
from smolforge.models.families.toolcalls import HERMES, ToolCallFormat

if TYPE_CHECKING:
    import torch
    from torch import nn

LLAMA_LIKE_LORA = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def config_get(config: Any, key: str, default: Any = None) -> Any:
    """A config value from an HF config object or a config.json dict."""
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default)


class Family:
    """The base answers; a family overrides what differs (see the module doc)."""

    name: ClassVar[str] = "generic"
    model_types: ClassVar[tuple[str, ...]] = ()
    # structure
    layers_prefix: ClassVar[str | None] = None  # path of the decoder layer list in the *ForCausalLM model
    stages: ClassVar[bool] = False  # can be cut into pipeline/serving/split stages (models/partition.py)
    tied_default: ClassVar[bool] = False  # tie_word_embeddings when the config does not say
    # PEFT
    lora_targets: ClassVar[tuple[str, ...] | None] = None  # None: every linear layer ("all-linear")
    split_lora_targets: ClassVar[tuple[str, ...] | None] = None
    fan_in_fan_out: ClassVar[bool] = False
    ia3_targets: ClassVar[tuple[tuple[str, ...], tuple[str, ...]] | None] = None  # (targets, feed-forward)
    houlsby_sites: ClassVar[tuple[str, ...] | None] = None  # attention-output and MLP-output suffixes
    # export
    gguf_arch: ClassVar[str | None] = None  # gguf.MODEL_ARCH member name
    gguf_untie: ClassVar[bool] = False  # write output.weight from the embedding when the head is tied
    # chat: how the model writes a tool call (models/families/toolcalls.py); Hermes' `<tool_call>` by default
    tool_calls: ClassVar[ToolCallFormat] = HERMES

    def __init__(self, model_type: str | None = None):
        self.model_type = model_type or (self.model_types[0] if self.model_types else None)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.model_type!r})"

    # ------------------------------------------------------------------ generation and chat
    @staticmethod
    def stop_ids(tokenizer: Any, source: Any = None) -> frozenset[int]:
        """Every token id that ends a generation (models/families/stops.py)."""
        return _stops.stop_ids(tokenizer, source)

    @staticmethod
    def chat(tokenizer: Any) -> _chat.ChatAbilities:
        """The chat template's abilities (models/families/chat.py)."""
        return _chat.abilities(tokenizer)

    # ------------------------------------------------------------------ structure
    def tied(self, config: Any) -> bool:
        """Whether the output head shares the input embedding matrix."""
        value = config_get(config, "tie_word_embeddings")
        return self.tied_default if value is None else bool(value)

    def check_stages(self) -> None:
        """Refuse a family that cannot be cut into stages."""
        if not self.stages:
            from smolforge.models.families import stage_families

            raise SmolforgeError(
                f"cutting a model into stages does not support model type {self.model_type!r}",
                fix=f"use a model of the {', '.join(stage_families())} families (e.g. the tiny-llama preset)")

    def final_norm(self, model: "nn.Module") -> "nn.Module":
        return model.model.norm

    def rotary(self, model: "nn.Module") -> "nn.Module | None":
        return model.model.rotary_emb

    def extra_embeddings(self, model: "nn.Module") -> dict[str, "nn.Module"]:
        """Modules a first stage holds besides the token embedding (GPT-2: learned positions, dropout)."""
        return {}

    def embed(self, stage: Any, input_ids: "torch.Tensor", position_ids: "torch.Tensor") -> "torch.Tensor":
        """A first stage's embedding of `input_ids` [B, T] -> hidden states [B, T, H]."""
        return stage.embed(input_ids)

    def position_parameters(self, model: "nn.Module") -> list["nn.Module"]:
        """Embedding modules beyond the token embedding, counted with a first stage's bytes."""
        return list(self.extra_embeddings(model).values())[:1]

    def run_layers(self, stage: Any, h: "torch.Tensor", masks: dict, position_ids: "torch.Tensor",
                   cache: Any) -> "torch.Tensor":
        """The stage's decoder layers over hidden states [B, T, H], as the HF model calls them (rotary
        embeddings computed once from the positions that travel with every call)."""
        position_embeddings = stage.rotary_emb(h, position_ids=position_ids)
        for i in stage.layer_ids:
            h = stage.layers[str(i)](h, attention_mask=masks[stage.layer_type(i)],
                                     position_embeddings=position_embeddings, position_ids=position_ids,
                                     past_key_values=cache, use_cache=cache is not None)
        return h

    # ------------------------------------------------------------------ export
    def check_gguf(self, config: dict) -> None:
        """Refuse a model llama.cpp would run differently (before anything is written)."""
        if self.gguf_arch is None:
            from smolforge.models.families import gguf_families

            raise SmolforgeError(f"GGUF export supports the {', '.join(gguf_families())} families, "
                                 f"not {self.model_type!r}",
                                 fix="export with --to hf and convert that directory with llama.cpp's "
                                     "convert_hf_to_gguf.py")

    def gguf_hparams(self, writer: Any, config: dict) -> None:
        """Write the architecture's GGUF keys."""
        raise NotImplementedError

    def gguf_fix(self, name: str, tensor: "torch.Tensor", config: dict) -> "torch.Tensor":
        """An HF tensor in the layout llama.cpp expects."""
        return tensor

    def gguf_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape `gguf_fix` gives a tensor of `shape` (read from a header, before any data)."""
        return shape

    def gguf_extra_tensors(self, config: dict) -> dict[str, "torch.Tensor"]:
        """Tensors llama.cpp needs that the checkpoint does not hold (GGUF name -> tensor)."""
        return {}


class Generic(Family):
    """A model type no class registers: the answers that need no structure (stops, chat, tied)."""

    name = "generic"
