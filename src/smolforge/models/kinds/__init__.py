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

from pydantic import BaseModel

from smolforge.errors import SmolforgeError

if TYPE_CHECKING:
    from smolforge.config import TrainConfig
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


# The settings a kind's declared capability governs: (capability on ModelKind, setting path, flags, why not).
GOVERNED: tuple[tuple[str, str, str, str], ...] = (
    ("adapters", "peft", "--peft/--lora-r/--lora-alpha", "it trains every parameter (there is no adapter)"),
    ("sequences", "data.max_length", "--max-length", "its rows are feature vectors, with no sequence to cut"),
    ("sequences", "data.packing", "--packing", "its rows are feature vectors, with no sequence to pack"),
)


def given_settings(spec: BaseModel, prefix: str = "") -> set[str]:
    """The dotted paths of the settings a validated spec was given (pydantic's `model_fields_set`, nested
    sections walked), not those it took a default for: {"peft", "peft.method", "data.max_length", ...}."""
    paths: set[str] = set()
    for name in spec.model_fields_set:
        paths.add(prefix + name)
        value = getattr(spec, name)
        if isinstance(value, BaseModel):
            paths |= given_settings(value, f"{prefix}{name}.")
    return paths


def refuse_unused(cfg: TrainConfig, prefix: str = "train.") -> None:
    """Refuse, by name, settings `cfg` was given that its model kind declares it cannot use (`GOVERNED`:
    `--peft` for a kind without `adapters`, `--max-length` for one without `sequences`), rather than
    ignore them. A language model (no registered kind) takes them all. Ask this of a spec as the user
    gave it (submit, the CLI), not of one rebuilt from a dump (that names every default as given).

    Raises SmolforgeError (exit 2) naming each flag and its setting path (under `prefix`: a job spec's)."""
    kind = model_kind(cfg.model)
    if kind is None:
        return
    given = given_settings(cfg)
    unused = [(flags, prefix + path, why) for capability, path, flags, why in GOVERNED
              if not getattr(kind, capability) and path in given]
    if unused:
        named = ", ".join(f"{flags} ({path})" for flags, path, _ in unused)
        raise SmolforgeError(f"{named} do{'es' if len(unused) == 1 else ''} not apply: "
                             + "; ".join(sorted({why for _, _, why in unused})),
                             where=f"--model {cfg.model}", field=tuple(unused[0][1][len(prefix):].split(".")),
                             fix=f"drop {'it' if len(unused) == 1 else 'them'} (a model kind that is not a "
                                 "language model trains whole, on feature rows)")
