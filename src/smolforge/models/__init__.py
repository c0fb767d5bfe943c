"""Model loading (HF id, local dir, Ollama name, tiny offline presets), PEFT methods and export."""

from smolforge.models.loading import load_model, load_tokenizer, resolve_model
from smolforge.models.registry import OLLAMA_TO_HF, ollama_to_hf

__all__ = ["load_model", "load_tokenizer", "resolve_model", "OLLAMA_TO_HF", "ollama_to_hf"]
