"""Model loading (HF id, local dir, Ollama name, tiny offline presets), PEFT methods and export.

The names below load on first use (PEP 562): importing a light submodule (`models.registry`,
`models.names`) must not import torch, so a CLI command can check its input in a second, not three.
"""

from importlib import import_module
from typing import Any

_WHERE = {"load_model": "loading", "load_tokenizer": "loading", "resolve_model": "loading",
          "OLLAMA_TO_HF": "registry", "ollama_to_hf": "registry"}

__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(import_module(f"smolforge.models.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'smolforge.models' has no attribute {name!r}")
