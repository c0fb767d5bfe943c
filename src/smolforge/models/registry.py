"""Ollama-style names → Hugging Face checkpoints.

Users know models by their Ollama names; training needs the HF weights. The table is extendable
from config (`models.aliases` in a YAML config, or `SMOLFORGE_MODEL_ALIASES` pointing at a YAML/JSON
file) so a new model does not need a release.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

OLLAMA_TO_HF: dict[str, str] = {
    "qwen2.5:0.5b": "Qwen/Qwen2.5-0.5B-Instruct",
    "qwen2.5:1.5b": "Qwen/Qwen2.5-1.5B-Instruct",
    "qwen2.5:3b": "Qwen/Qwen2.5-3B-Instruct",
    "qwen2.5:7b": "Qwen/Qwen2.5-7B-Instruct",
    "qwen2.5:14b": "Qwen/Qwen2.5-14B-Instruct",
    "qwen2.5-coder:0.5b": "Qwen/Qwen2.5-Coder-0.5B-Instruct",
    "qwen2.5-coder:1.5b": "Qwen/Qwen2.5-Coder-1.5B-Instruct",
    "qwen2.5-coder:7b": "Qwen/Qwen2.5-Coder-7B-Instruct",
    "qwen2:0.5b": "Qwen/Qwen2-0.5B-Instruct",
    "qwen2:1.5b": "Qwen/Qwen2-1.5B-Instruct",
    "qwen2:7b": "Qwen/Qwen2-7B-Instruct",
    "llama3.2:1b": "meta-llama/Llama-3.2-1B-Instruct",
    "llama3.2:3b": "meta-llama/Llama-3.2-3B-Instruct",
    "llama3.1:8b": "meta-llama/Llama-3.1-8B-Instruct",
    "tinyllama": "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
    "tinyllama:1.1b": "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
    "smollm2:135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "smollm2:360m": "HuggingFaceTB/SmolLM2-360M-Instruct",
    "smollm2:1.7b": "HuggingFaceTB/SmolLM2-1.7B-Instruct",
    "phi3:mini": "microsoft/Phi-3-mini-4k-instruct",
    "gemma2:2b": "google/gemma-2-2b-it",
    "mistral:7b": "mistralai/Mistral-7B-Instruct-v0.3",
}


def _user_aliases() -> dict[str, str]:
    path = os.environ.get("SMOLFORGE_MODEL_ALIASES")
    if not path:
        return {}
    text = Path(path).read_text(encoding="utf-8")
    data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    return {str(k): str(v) for k, v in (data or {}).items()}


def ollama_to_hf(name: str, extra: dict[str, str] | None = None) -> str | None:
    """The HF id for an Ollama name, or None. `name:latest` is the same as `name`."""
    table = {**OLLAMA_TO_HF, **_user_aliases(), **(extra or {})}
    key = name.strip().lower()
    if key.endswith(":latest"):
        key = key[: -len(":latest")]
    return table.get(key)
