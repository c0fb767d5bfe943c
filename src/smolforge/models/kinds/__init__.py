"""Model kinds that are not language models, registered by name like the strategies (`--model mlp`).

A kind answers, in one place, what the training engine otherwise asks of a causal language model: how
the module is built for a dataset, how a batch of (features, labels) runs through it (`forward`), its
summed loss (`loss_sum`), which units of a batch carry that loss (`targets`, `units`, `rows`: the
`train.strategy.BatchLayout` the loop normalises by) and what is counted right (`correct`). The loop
and the strategies (ddp, zero1, diloco, sync-ps, async-ps) never ask which kind they train.

A new kind is one module here with a `ModelKind` subclass (`base.py`) and its line in `KINDS`. Reading
the names imports neither torch nor the kind (placement and job checks ask `is_kind` on the coordinator).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from smolforge.models.kinds.base import ModelKind

KINDS: dict[str, str] = {"mlp": "mlp:MlpKind"}
"""--model name -> "module:Class" under smolforge.models.kinds (imported when the kind is asked for)."""


def is_kind(name: str | None) -> bool:
    """Whether `name` is a registered model kind (built from code on every node: nothing to hold or send)."""
    return (name or "") in KINDS


def model_kind(name: str | None) -> ModelKind | None:
    """The registered kind called `name` (an instance), or None: `name` is a language model's."""
    if not is_kind(name):
        return None
    module, cls = KINDS[str(name)].split(":")
    return getattr(import_module(f"smolforge.models.kinds.{module}"), cls)()
