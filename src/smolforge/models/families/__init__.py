"""One class per model family, registered by a decorator: every path asks `family_of(...)` (see base.py).

A new family is one file here with a class decorated `@register`, and its import below.
"""

from __future__ import annotations

from typing import Any

from smolforge.models.families.base import Family, Generic, config_get
from smolforge.models.families.chat import ChatAbilities, abilities
from smolforge.models.families.stops import cut_at_stop, stop_ids, stop_texts, turn_end_id

_BY_TYPE: dict[str, type[Family]] = {}


def register(cls: type[Family]) -> type[Family]:
    """Class decorator: `cls` answers for each of its `model_types`."""
    for model_type in cls.model_types:
        if model_type in _BY_TYPE:
            raise ValueError(f"model type {model_type!r} is registered twice ({_BY_TYPE[model_type].__name__}, "
                             f"{cls.__name__})")
        _BY_TYPE[model_type] = cls
    return cls


def family_of(source: Any) -> Family:
    """The family of a model type (str), an HF config, a config.json dict or a model (its `.config`)."""
    if source is not None and not isinstance(source, (str, dict)) and hasattr(source, "config") \
            and not hasattr(source, "model_type"):
        source = source.config
    model_type = source if isinstance(source, str) or source is None else config_get(source, "model_type")
    return _BY_TYPE.get(model_type or "", Generic)(model_type)


def registered() -> dict[str, type[Family]]:
    """model type -> family class (a copy)."""
    return dict(_BY_TYPE)


def stage_families() -> list[str]:
    """The model types that can be cut into stages, sorted."""
    return sorted(t for t, cls in _BY_TYPE.items() if cls.stages)


def gguf_families() -> list[str]:
    """The model types GGUF export writes, sorted."""
    return sorted(t for t, cls in _BY_TYPE.items() if cls.gguf_arch)


# the families (each registers itself on import)
from smolforge.models.families import gemma, gpt2, llama, phi3, qwen2  # noqa: E402,F401

__all__ = ["ChatAbilities", "Family", "Generic", "abilities", "cut_at_stop", "family_of", "gguf_families", "register",
           "registered", "stage_families", "stop_ids", "stop_texts", "turn_end_id"]
