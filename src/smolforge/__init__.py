"""smolforge: train, fine-tune and distill small language models on the machines you already have."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["Client", "Orchestrator", "ResourceConfig", "TaskConfig", "__version__", "create_distributed_training"]

# Lazy: `import smolforge` stays light (no Ray, torch or httpx until these are used).
_LAZY = {
    "Client": ("smolforge.client", "Client"),
    "Orchestrator": ("smolforge.orchestrator", "Orchestrator"),
    "create_distributed_training": ("smolforge.orchestrator", "create_distributed_training"),
    "TaskConfig": ("smolforge.cluster.control.specs", "TaskConfig"),
    "ResourceConfig": ("smolforge.cluster.control.specs", "ResourceConfig"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'smolforge' has no attribute {name!r}")
