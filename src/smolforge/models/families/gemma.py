"""Gemma and Gemma 2: PEFT sites only (not cut into stages nor exported to GGUF here). Their published
templates raise "System role not supported" on a system turn (models/families/chat.py finds that)."""

from __future__ import annotations

from smolforge.models.families import register
from smolforge.models.families.base import Family


@register
class Gemma(Family):
    name = "gemma"
    model_types = ("gemma", "gemma2")
    houlsby_sites = ("self_attn.o_proj", "mlp.down_proj")
