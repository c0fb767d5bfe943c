"""GPT-2: blocks under `transformer.h`, learned positions added in the first stage, Conv1D weights
stored fan-in × fan-out (LoRA's `fan_in_fan_out`, transposed for GGUF), a head tied by default."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from smolforge.errors import SmolforgeError
from smolforge.models.families import register
from smolforge.models.families.base import Family

if TYPE_CHECKING:
    import torch
    from torch import nn

CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")  # what llama.cpp's GPT-2 graph computes


@register
class GPT2(Family):
    name = "gpt2"
    model_types = ("gpt2",)
    layers_prefix = "transformer.h"
    stages = True
    tied_default = True
    lora_targets = ("c_attn", "c_proj", "c_fc")
    split_lora_targets = ("c_attn", "c_proj", "c_fc")
    fan_in_fan_out = True
    ia3_targets = (("c_attn", "mlp.c_proj"), ("mlp.c_proj",))
    houlsby_sites = ("attn.c_proj", "mlp.c_proj")
    gguf_arch = "GPT2"
    gguf_untie = True

    def final_norm(self, model: "nn.Module") -> "nn.Module":
        return model.transformer.ln_f

    def rotary(self, model: "nn.Module") -> "nn.Module | None":
        return None

    def extra_embeddings(self, model: "nn.Module") -> dict[str, "nn.Module"]:
        return {"wpe": model.transformer.wpe, "drop": model.transformer.drop}

    def embed(self, stage: Any, input_ids: "torch.Tensor", position_ids: "torch.Tensor") -> "torch.Tensor":
        h = stage.embed(input_ids)
        return stage.drop(h + stage.wpe(position_ids).to(h.device))

    def run_layers(self, stage: Any, h: "torch.Tensor", masks: dict, position_ids: "torch.Tensor",
                   cache: Any) -> "torch.Tensor":
        for i in stage.layer_ids:
            h = stage.layers[str(i)](h, cache, masks["full_attention"], None, encoder_attention_mask=None,
                                     use_cache=cache is not None, position_ids=position_ids)
        return h

    def check_gguf(self, config: dict) -> None:
        act = config.get("activation_function", "gelu_new")
        if act not in GELU_TANH:
            raise SmolforgeError(f"GPT-2 with activation {act!r} has no llama.cpp equivalent", fix="export with --to hf")

    def gguf_hparams(self, writer: Any, config: dict) -> None:
        w, cfg = writer, config
        w.add_context_length(cfg["n_positions"])
        w.add_embedding_length(cfg["n_embd"])
        w.add_block_count(cfg["n_layer"])
        w.add_feed_forward_length(cfg.get("n_inner") or 4 * cfg["n_embd"])
        w.add_head_count(cfg["n_head"])
        w.add_layer_norm_eps(cfg["layer_norm_epsilon"])

    def gguf_fix(self, name: str, tensor: "torch.Tensor", config: dict) -> "torch.Tensor":
        return tensor.T.contiguous() if name.endswith(CONV1D) else tensor

    def gguf_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape[::-1] if name.endswith(CONV1D) else shape
