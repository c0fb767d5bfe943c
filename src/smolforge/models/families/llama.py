"""Llama (Llama 2/3.x, TinyLlama, SmolLM2) and Mistral: rotary decoder layers under `model.layers`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from smolforge.models.families import register
from smolforge.models.families.base import LLAMA_LIKE_LORA, Family
from smolforge.models.families.rope import rope_params, llama3_rope_factors, write_rope_scaling
from smolforge.models.families.toolcalls import LLAMA_JSON

if TYPE_CHECKING:
    import torch


def permute_rope_rows(w: "torch.Tensor", n_head: int) -> "torch.Tensor":
    """HF rotate-half rope rows -> llama.cpp's interleaved pairs (convert_hf_to_gguf's LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_like_hparams(w: Any, cfg: dict, arch: str, llama3_as_tensor: bool = False) -> None:
    """Llama's GGUF keys (Qwen2 writes the same ones), as convert_hf_to_gguf.py's LlamaModel."""
    heads = cfg["num_attention_heads"]
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    w.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    w.add_rope_freq_base(float(rope_params(cfg)["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    write_rope_scaling(w, cfg, arch, llama3_as_tensor)


class LlamaLike(Family):
    """What Llama, Qwen2 and Phi-3 share: layers, final norm and rotary embedding under `model`."""

    layers_prefix = "model.layers"
    stages = True
    split_lora_targets = LLAMA_LIKE_LORA
    ia3_targets = (("k_proj", "v_proj", "down_proj"), ("down_proj",))
    houlsby_sites = ("self_attn.o_proj", "mlp.down_proj")


@register
class Llama(LlamaLike):
    """Llama's q/k rows are permuted for llama.cpp's interleaved (NORM) rope; Llama 3's rope scaling
    travels as a `rope_freqs` tensor."""

    name = "llama"
    model_types = ("llama",)
    gguf_arch = "LLAMA"
    tool_calls = LLAMA_JSON  # Llama 3.x's JSON tool calling: {"name": ..., "parameters": {...}}

    def gguf_hparams(self, writer: Any, config: dict) -> None:
        llama_like_hparams(writer, config, "LLAMA", llama3_as_tensor=True)

    def gguf_fix(self, name: str, tensor: "torch.Tensor", config: dict) -> "torch.Tensor":
        heads = config["num_attention_heads"]
        if name.endswith("q_proj.weight"):
            return permute_rope_rows(tensor, heads)
        if name.endswith("k_proj.weight"):
            return permute_rope_rows(tensor, config.get("num_key_value_heads") or heads)
        return tensor

    def gguf_extra_tensors(self, config: dict) -> dict[str, "torch.Tensor"]:
        if rope_params(config)["kind"] == "llama3":
            return {"rope_freqs.weight": llama3_rope_factors(config)}
        return {}


@register
class Mistral(Family):
    """Mistral: Llama's projections (PEFT sites); not cut into stages nor exported to GGUF here."""

    name = "mistral"
    model_types = ("mistral",)
    ia3_targets = (("k_proj", "v_proj", "down_proj"), ("down_proj",))
    houlsby_sites = ("self_attn.o_proj", "mlp.down_proj")
