"""Qwen2 / Qwen2.5 (and Qwen3's PEFT sites): Llama's layout, NEOX rope (no permutation in GGUF)."""

from __future__ import annotations

from typing import Any

from smolforge.models.families import register
from smolforge.models.families.base import Family
from smolforge.models.families.llama import LlamaLike, llama_like_hparams


@register
class Qwen2(LlamaLike):
    name = "qwen2"
    model_types = ("qwen2",)
    gguf_arch = "QWEN2"

    def gguf_hparams(self, writer: Any, config: dict) -> None:
        llama_like_hparams(writer, config, "QWEN2")


@register
class Qwen3(Family):
    """Qwen3: Llama's projections (PEFT sites); not cut into stages nor exported to GGUF here."""

    name = "qwen3"
    model_types = ("qwen3",)
    ia3_targets = (("k_proj", "v_proj", "down_proj"), ("down_proj",))
    houlsby_sites = ("self_attn.o_proj", "mlp.down_proj")
