"""Phi-3: fused qkv_proj and gate_up_proj inside Llama-like layers; its chat turns end with `<|end|>`,
which its generation config lists but its tokenizer's eos (`<|endoftext|>`) is not."""

from __future__ import annotations

from typing import Any

from smolforge.models.families import register
from smolforge.models.families.llama import LlamaLike
from smolforge.models.families.rope import rope_params, write_rope_scaling


@register
class Phi3(LlamaLike):
    name = "phi3"
    model_types = ("phi3",)
    split_lora_targets = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # fused projections: one LoRA each
    ia3_targets = None  # peft's own mapping
    gguf_arch = "PHI3"

    def gguf_hparams(self, writer: Any, config: dict) -> None:
        """As convert_hf_to_gguf.py's Phi3MiniModel writes it: Llama's keys plus the original context
        length and the sliding window (0: none). Its fused qkv_proj and gate_up_proj keep their layout
        (llama.cpp's `attn_qkv` and `ffn_up` of twice the width); its rope is NEOX, so no permutation.
        Long-context rope (`longrope`, the 128k models) is refused by `write_rope_scaling`."""
        w, cfg = writer, config
        heads = cfg["num_attention_heads"]
        w.add_context_length(cfg["max_position_embeddings"])
        w.add_rope_scaling_orig_ctx_len(int(cfg.get("original_max_position_embeddings")
                                            or cfg["max_position_embeddings"]))
        w.add_embedding_length(cfg["hidden_size"])
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_block_count(cfg["num_hidden_layers"])
        w.add_head_count(heads)
        w.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        w.add_rope_dimension_count(int(cfg.get("partial_rotary_factor", 1.0) * cfg["hidden_size"]) // heads)
        w.add_rope_freq_base(float(rope_params(cfg)["rope_theta"]))
        w.add_sliding_window(int(cfg.get("sliding_window") or 0))
        write_rope_scaling(w, cfg, "PHI3")
