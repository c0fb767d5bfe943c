"""The methods HF peft implements (lora, ia3, prefix, prompt): applied with `get_peft_model`, loaded
with `PeftModel.from_pretrained`, saved with `save_pretrained` (the directories the ecosystem reads)."""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from smolforge.errors import SmolforgeError
from smolforge.models.peft.base import PeftMethodClass

if TYPE_CHECKING:
    from torch import nn

    from smolforge.config import PeftSpec


def unwrap(model: "nn.Module") -> "nn.Module":
    """Strip DDP/FSDP-style `.module` wrappers so we see the model itself."""
    import torch

    while isinstance(model, torch.nn.parallel.DistributedDataParallel) or (
        type(model).__name__ in ("DistributedDataParallel", "FullyShardedDataParallel") and hasattr(model, "module")
    ):
        model = model.module
    return model


def is_peft_model(model: "nn.Module") -> bool:
    """Whether `model` is a peft `PeftModel` (a wrapper around the transformers model)."""
    from peft import PeftModel

    return isinstance(model, PeftModel)


def base_transformer(model: "nn.Module") -> "nn.Module":
    """The underlying transformers model (below any peft wrapper)."""
    model = unwrap(model)
    if is_peft_model(model):
        return model.get_base_model()
    return model


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """peft 0.21 reads transformers' deprecated `is_gradient_checkpointing`; that warning means nothing to users.
    Nor does its warning about a tied module in the adapter: merges untie it, and `train` says so once
    (`models/tied.py`)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message="Model has `tie_word_embeddings=True` and a tied layer")
        yield


def model_type(model: "nn.Module") -> str | None:
    """The transformers `config.model_type` of `model` (None for a model without one)."""
    return getattr(getattr(model, "config", None), "model_type", None)


def has_conv1d(model: "nn.Module") -> bool:
    """Whether the model's projections are transformers' Conv1D (GPT-2: weights stored fan-in x fan-out)."""
    from transformers.pytorch_utils import Conv1D

    return any(isinstance(m, Conv1D) for m in model.modules())


class PeftLibMethod(PeftMethodClass):
    """A method of the peft library; subclasses give its config (`peft_config`)."""

    def peft_config(self, model: "nn.Module", spec: "PeftSpec") -> Any:
        """The peft `PeftConfig` for `spec` on `model`."""
        raise NotImplementedError(self.name)

    def apply(self, model: "nn.Module", spec: "PeftSpec") -> "nn.Module":
        from peft import get_peft_model

        try:
            with quiet_peft():
                return get_peft_model(model, self.peft_config(model, spec))
        except ValueError as err:  # e.g. target modules not found
            raise SmolforgeError(f"cannot apply {spec.method}: {err}".splitlines()[0],
                                 fix="check target_modules in --peft-config against the model's module names") from err

    def merge(self, model: "nn.Module", *, plain: bool) -> "nn.Module":
        """Prompt-learning methods never fold, even for in-process use (peft has no merge for them)."""
        raise self.refusal("merge")

    def load(self, base: "nn.Module", adapter_dir: Path, *, is_trainable: bool) -> "nn.Module":
        from peft import PeftModel

        try:
            with quiet_peft():
                model = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=is_trainable)
        except (RuntimeError, ValueError, KeyError) as err:
            config = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
            raise SmolforgeError(f"cannot load {self.name} adapter {adapter_dir}: {err}".splitlines()[0],
                                 fix=f"load it onto the base model it was trained on "
                                     f"({config.get('base_model_name_or_path')})") from err
        if not is_trainable:  # peft leaves prompt-learning encoders trainable even in inference mode
            for p in model.parameters():
                p.requires_grad_(False)
        return model
