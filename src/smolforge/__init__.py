"""smolforge: train, fine-tune and distill small language models on the machines you already have."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
