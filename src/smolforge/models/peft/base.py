"""What a PEFT method is to smolforge: one class per method, declaring what it can do and doing it.

Torch-free at import (the CLI asks the capabilities in milliseconds); each method imports torch,
peft and transformers inside the bodies that need them. The registry is `smolforge.models.peft`.

Capabilities, and who asks them:
- `merges`: folds into the base weights (export's streaming merge, serve's in-memory merge, a
  pipeline stage that loads its tensors merged: `models/stage_load.py`).
- `serves`: the serve engines that take the adapter as `--adapter` (`ENGINES`).
- `exports`: the export targets (`EXPORT_TARGETS`; each needs a merge).
- `aggregates`: distillation students of this method can be merged into one adapter.
- `pipeline_trains`, `split_trains`: `--strategy pipeline`, split learning.
Every refusal built from them (`refusal`) has a fix naming the commands that do accept the adapter.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from smolforge.errors import SmolforgeError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from smolforge.config import PeftSpec

ENGINES = ("torch", "llamacpp", "stages")  # `serve --engine torch`, `--engine llamacpp`, `serve --stages N`
EXPORT_TARGETS = ("hf", "gguf", "ollama")  # `export --to`


class PeftMethodClass:
    """One PEFT method: its name (one of `peft_spec.METHODS`), capabilities and operations.

    Subclasses set the class attributes and override the operations they support; the defaults
    refuse or do nothing, so a new method declares only what it is.
    """

    name: ClassVar[str]
    label: ClassVar[str]  # how a message names it: "LoRA", "prefix tuning"
    peft_type: ClassVar[str | None] = None  # adapter_config.json's peft_type; None: the directory is a full model
    full_model: ClassVar[bool] = False  # its "adapter" is a whole model (full fine-tuning)
    merges: ClassVar[bool] = False
    serves: ClassVar[frozenset[str]] = frozenset()  # of ENGINES
    exports: ClassVar[frozenset[str]] = frozenset()  # of EXPORT_TARGETS
    aggregates: ClassVar[bool] = False
    pipeline_trains: ClassVar[bool] = True
    split_trains: ClassVar[bool] = False
    what_it_adds: ClassVar[str] = ""  # what the method learns, when it is not a weight delta (the refusals' why)
    serve_why: ClassVar[str] = ""  # why the serve engines that refuse it do (else `what_it_adds`)
    # distill/aggregate.py: the value a tensor missing from one student contributes (IA3's scale 1,
    # Houlsby's 0); None for methods aggregated otherwise (LoRA: re-factorised; a full model)
    neutral: ClassVar[float | None] = None
    low_rank: ClassVar[bool] = False  # its deltas are B @ A pairs (re-factorised when aggregated)
    # what it adds is a product of two trained factors (LoRA's B @ A, Houlsby's up(act(down x))): a step
    # that moves each factor by k times moves their product by up to k^2 (`parallel/auto_choice.py`: an outer
    # step's amplification is damped for it in a short run)
    factored: ClassVar[bool] = False
    recheckpoint: ClassVar[bool] = False  # peft refuses it on a checkpointing model: `apply_peft` switches
    # checkpointing off, applies it, and switches it back on

    # ------------------------------------------------------------------ in memory

    def apply(self, model: "nn.Module", spec: "PeftSpec") -> "nn.Module":
        """`model` ready to train with this method; only its parameters are trainable."""
        raise NotImplementedError(self.name)

    def load(self, base: "nn.Module", adapter_dir: Path, *, is_trainable: bool) -> "nn.Module":
        """`base` with the adapter saved in `adapter_dir` applied."""
        raise NotImplementedError(self.name)

    def save(self, model: "nn.Module", out: Path, weights: "dict[str, torch.Tensor] | None") -> None:
        """Write the adapter's files into the (empty, temporary) directory `out`; `weights` by parameter
        name when the model holds only shards of them, else they are read from the model."""
        model.save_pretrained(out, **({} if weights is None else {"state_dict": weights}))

    def merge(self, model: "nn.Module", *, plain: bool) -> "nn.Module":
        """A transformers model with the adapter folded into its weights; `plain=False` lets a method
        that cannot fold return the model as is (in-process inference keeps its modules)."""
        if plain:
            raise self.refusal("merge")
        return model

    def virtual_tokens(self, model: "nn.Module") -> int:
        """How many positions the method prepends to `outputs.logits` (prompt tuning; else 0)."""
        return 0

    def after_checkpointing(self, model: "nn.Module") -> None:
        """What the method needs once activation checkpointing is on (prefix tuning's read-only cache)."""

    # ------------------------------------------------------------------ streaming merge (models/export/merge.py)

    def check_tensor(self, key: str, kind: str, weights: Path) -> None:
        """Refuse a saved tensor the streaming merge cannot fold (`kind`: the part after the module name)."""

    def fold(self, w: "torch.Tensor", parts: "dict[str, torch.Tensor]", config: dict[str, Any]) -> "torch.Tensor":
        """The float32 weight `w` ([out, in]) with the adapter's `parts` for it folded in."""
        raise self.refusal("merge")

    def fold_bias(self, bias: "torch.Tensor", parts: "dict[str, torch.Tensor] | None", weight: str,
                  config: dict[str, Any]) -> "torch.Tensor":
        """The base bias of `weight`'s module with the adapter folded in (most methods leave it)."""
        return bias

    # ------------------------------------------------------------------ refusals

    def uses(self, adapter: str = "DIR", base: str = "BASE") -> list[str]:
        """The commands that accept this adapter, as a user would type them (paths shell-quoted)."""
        import shlex

        adapter, base = shlex.quote(adapter), shlex.quote(base)
        found = [f"smolforge generate --model {base} --adapter {adapter} --prompt Hello",
                 f"smolforge eval --model {base} --adapter {adapter} --data FILE"]
        if "torch" in self.serves:
            found.append(f"smolforge serve --model {base} --adapter {adapter}")
        if "stages" in self.serves:
            found.append(f"smolforge serve --stages 2 --model {base} --adapter {adapter}")
        if self.exports:
            found.append(f"smolforge export --model {base} --adapter {adapter} --to {sorted(self.exports)[0]}")
        return found

    def refusal(self, action: str, where: str | None = None, adapter: str = "DIR", base: str = "BASE") -> SmolforgeError:
        """The error for `action` on this method's adapter: what cannot be done, why, and the commands
        that do take it. `action`: "merge", "export" or "export:<target>", "aggregate", "pipeline",
        "split" or "serve:<engine>" (targets: EXPORT_TARGETS, engines: ENGINES)."""
        kind, _, arg = action.partition(":")
        why = self.what_it_adds or f"{self.label} is not a weight delta"
        what = {"merge": f"cannot merge {self.label}; keep the adapter: {why}",
                "export": f"cannot export {self.label}{' to ' + arg if arg else ''}: {why}, and a plain Hugging Face, "
                          "GGUF or Ollama model holds only weights",
                "aggregate": f"cannot aggregate {self.label} adapters: {why}, and averaging them does not give "
                             "a model that knows what each student learned",
                "pipeline": f"the pipeline strategy cannot train {self.label}: what it learns is not layers a "
                            "stage could hold",
                "split": f"split learning trains LoRA, not {self.label}",
                "serve": f"the {arg} engine cannot serve {self.label}"
                         + (f": {self.serve_why or why}" if self.what_it_adds else "")}[kind]
        others = [m.name for m in _accepting(action)]
        if kind in ("pipeline", "split"):  # a training setting: name the methods it trains, or the other road
            other_road = {"pipeline": f"or train {self.label} without --strategy pipeline",
                          "split": "or train it with `smolforge train`"}[kind]
            return SmolforgeError(what, where=where, fix=f"use --peft {' / '.join(others)}, {other_road}")
        fix = "keep the adapter and use it with " + ", or ".join(f"`{c}`" for c in self.uses(adapter, base))
        others = [name for name in others if not _full(name)]
        if others and kind != "serve":
            fix += f"; or train with --peft {' / '.join(others)} to get an adapter that {kind}s"
        return SmolforgeError(what, where=where, fix=fix)


def _accepting(action: str) -> list[type[PeftMethodClass]]:
    from smolforge.models.peft import all_methods

    return [m for m in all_methods() if accepts(m, action)]


def _full(name: str) -> bool:
    from smolforge.models.peft import peft_method

    return peft_method(name).full_model


def accepts(method: "type[PeftMethodClass] | PeftMethodClass", action: str) -> bool:
    """Whether `method` can do `action` (as `PeftMethodClass.refusal` names actions)."""
    if action.startswith("serve:"):
        return action.split(":", 1)[1] in method.serves
    if action.startswith("export:"):
        return action.split(":", 1)[1] in method.exports
    return {"merge": method.merges, "export": bool(method.exports), "aggregate": method.aggregates,
            "pipeline": method.pipeline_trains, "split": method.split_trains}[action]
