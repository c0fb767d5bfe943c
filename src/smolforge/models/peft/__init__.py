"""The PEFT methods, one class each, registered by `@register` (see `base.PeftMethodClass`).

A new method is one module here with its class and one line in `_MODULES`, plus its name in
`config.PeftMethod` (what `--peft` takes: `peft_spec.METHODS`). Modules are imported on the first
lookup, and none imports torch at import time, so the CLI asks capabilities in milliseconds.
"""

from __future__ import annotations

import importlib
from typing import TypeVar

from smolforge.errors import SmolforgeError
from smolforge.models.peft.base import EXPORT_TARGETS, ENGINES, PeftMethodClass, accepts  # noqa: F401

# the registry: one line per method module (each registers its class with @register)
_MODULES = (
    "smolforge.models.peft.full",
    "smolforge.models.peft.lora",
    "smolforge.models.peft.ia3",
    "smolforge.models.peft.virtual_tokens",  # prefix and prompt tuning
    "smolforge.models.peft.houlsby",
)

FULL = "none"  # full fine-tuning's name (`full.FullFineTuning`): what a model without an adapter carries

_REGISTRY: dict[str, type[PeftMethodClass]] = {}
_loaded = False
C = TypeVar("C", bound=type[PeftMethodClass])


def register(cls: C) -> C:
    """Class decorator: make `cls` the method named `cls.name`."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"PEFT method {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def _load() -> dict[str, type[PeftMethodClass]]:
    global _loaded
    if not _loaded:
        for module in _MODULES:
            importlib.import_module(module)
        _loaded = True
    return _REGISTRY


def all_methods() -> list[type[PeftMethodClass]]:
    """Every registered method class, in `peft_spec.METHODS` order where named there."""
    from smolforge.models.peft_spec import METHODS

    registry = _load()
    return sorted(registry.values(), key=lambda c: (METHODS.index(c.name) if c.name in METHODS else len(METHODS), c.name))


def peft_method(name: str) -> PeftMethodClass:
    """The method called `name` (one of `peft_spec.METHODS`); a SmolforgeError for any other."""
    registry = _load()
    if name not in registry:
        raise SmolforgeError(f"unknown PEFT method {name!r}", fix=f"use one of {', '.join(sorted(registry))}")
    return registry[name]()


def by_peft_type(peft_type: str) -> PeftMethodClass | None:
    """The method whose adapter_config.json says `peft_type` (peft's PeftType value), or None."""
    for cls in _load().values():
        if cls.peft_type is not None and cls.peft_type == peft_type:
            return cls()
    return None


def peft_types() -> list[str]:
    """The peft_type values smolforge reads."""
    return sorted(c.peft_type for c in _load().values() if c.peft_type is not None)
