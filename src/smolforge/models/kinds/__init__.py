"""Model kinds that are not language models, registered by name like the families (`--model mlp`).

A kind answers, in one place, what the training engine otherwise asks of a causal language model: how
the module is built for a dataset, how a batch of (features, labels) runs through it (`forward`), its
summed loss (`loss_sum`), which units of a batch carry that loss (`targets`, `units`, `rows`: the
`train.strategy.BatchLayout` the loop normalises by) and what is counted right (`correct`). The loop
and the strategies (ddp, zero1, diloco, sync-ps, async-ps) never ask which kind they train.

A new kind is one file here with a class decorated `@register`, and its import below.
"""

from __future__ import annotations

from smolforge.models.kinds.base import ModelKind

_KINDS: dict[str, type[ModelKind]] = {}


def register(cls: type[ModelKind]) -> type[ModelKind]:
    """Class decorator: `cls` answers for `--model cls.name`."""
    if cls.name in _KINDS:
        raise ValueError(f"model kind {cls.name!r} is registered twice")
    _KINDS[cls.name] = cls
    return cls


def model_kind(name: str | None) -> ModelKind | None:
    """The registered kind called `name` (an instance), or None: `name` is a language model's."""
    cls = _KINDS.get(name or "")
    return cls() if cls is not None else None


def kinds() -> list[str]:
    """The registered kinds' names, sorted."""
    return sorted(_KINDS)


from smolforge.models.kinds import mlp as _mlp  # noqa: E402,F401  (registers "mlp")
