"""Parameter-efficient fine-tuning: one entry point for lora, prefix, prompt, ia3, adapter and none.

lora, prefix, prompt and ia3 go through HF peft, so their adapter directories are the ones the
rest of the ecosystem reads (peft itself; for LoRA also vLLM and llama.cpp's convert_lora_to_gguf). `adapter` is our own
Houlsby implementation (`smolforge.models.houlsby`), saved in the same layout. `none` is full
fine-tuning; its "adapter" directory is a complete model written by `save_pretrained`.

The engine, the distillation students and the split-learning client all call the same four
functions: `apply_peft`, `save_adapter`, `load_adapter`, `merge_adapter`. Each asks the method's
class (`smolforge.models.peft`: one class per method, what it can do and how); this module is their
public face, with what a model in memory carries (`model_method`) and activation checkpointing.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from smolforge.config import PeftSpec
from smolforge.errors import SmolforgeError
from smolforge.models import houlsby
from smolforge.models.peft import FULL, by_peft_type, peft_method, peft_types
from smolforge.models.peft._peftlib import base_transformer, is_peft_model as _is_peft_model, unwrap as _unwrap
# Reading users' PEFT settings is its own module; these names stay importable from here.
from smolforge.models.peft_spec import METHODS, peft_spec_from_cli, peft_spec_from_config  # noqa: F401
from smolforge.models.tied import untie_for_merge
from smolforge.paths import atomic_replace_dir


# --------------------------------------------------------------------------- helpers


def model_method(model: nn.Module) -> str:
    """Which PEFT method a model in memory carries: one of METHODS."""
    model = _unwrap(model)
    if _is_peft_model(model):
        peft_type = str(getattr(model.peft_config[model.active_adapter].peft_type, "value",
                                model.peft_config[model.active_adapter].peft_type))
        known = by_peft_type(peft_type)
        return known.name if known is not None else peft_type.lower()
    if houlsby.is_houlsby(model):
        return peft_method_of_type(houlsby.PEFT_TYPE)
    return FULL


def peft_method_of_type(peft_type: str) -> str:
    """The method name whose adapter_config.json says `peft_type`."""
    known = by_peft_type(peft_type)
    assert known is not None, peft_type
    return known.name


def carries_adapter(model: nn.Module) -> bool:
    """Whether the model in memory carries an adapter (any method but full fine-tuning)."""
    return not peft_method(model_method(model)).full_model


def virtual_token_offset(model: nn.Module) -> int:
    """How many positions prompt tuning prepends to `outputs.logits` (0 for every other method).

    Prompt tuning feeds its virtual tokens through the model as embeddings, so the logits are
    `num_virtual_tokens` longer than `input_ids`; code that lines logits up with labels itself
    (a hand-rolled loss, distillation against teacher logits) slices `logits[:, offset:]`.
    peft's own `labels=` loss already accounts for it (and also scores the first real token from
    the last virtual position). Prefix tuning does not lengthen the logits.
    """
    model = _unwrap(model)
    return peft_method(model_method(model)).virtual_tokens(model)


def adapter_dir(output_dir: str | Path, method: str) -> Path:
    """Where a run's adapter goes: `<output_dir>/<method>_adapter` (the seed projects' layout)."""
    return Path(output_dir) / f"{method}_adapter"


# --------------------------------------------------------------------------- public API


def apply_peft(model: nn.Module, spec: PeftSpec) -> nn.Module:
    """Return `model` ready to train with `spec.method`; only that method's parameters are trainable.

    For peft methods the result is a `peft.PeftModel` around `model`; for `adapter` and `none`
    it is `model` itself (adapters added in place for `adapter`).
    """
    kind = peft_method(spec.method)
    model = _unwrap(model)
    if carries_adapter(model):
        raise SmolforgeError("this model already carries a PEFT adapter",
                             fix="apply PEFT to a freshly loaded base model")
    # a method peft refuses on a checkpointing model (prefix): checkpointing off, apply, back on
    recheckpoint = kind.recheckpoint and _is_checkpointing(model)
    if recheckpoint:
        _disable_checkpointing(model)
    applied = kind.apply(model, spec)
    return enable_gradient_checkpointing(applied) if recheckpoint else applied


def trainable_summary(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; shared (tied) tensors are counted once."""
    trainable = total = 0
    for p in _unwrap(model).parameters():
        total += p.numel()
        if p.requires_grad:
            trainable += p.numel()
    return trainable, total


def trainable_message(model: nn.Module) -> str:
    """`trainable params: 12,288 || all params: 881,792 || trainable%: 1.39` (peft's wording)."""
    trainable, total = trainable_summary(model)
    pct = 100.0 * trainable / total if total else 0.0
    return f"trainable params: {trainable:,} || all params: {total:,} || trainable%: {pct:.2f}"


BASE_FILE = "base_model.json"  # the shape of the base an adapter was trained on, checked when it is loaded
BASE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")


def base_shape(model: nn.Module) -> dict[str, Any]:
    """What must match for an adapter to mean anything on a base: architecture, vocabulary, sizes."""
    cfg = getattr(_unwrap(model), "config", None)
    shape = {k: getattr(cfg, k, None) for k in BASE_KEYS}
    return {**shape, "name_or_path": getattr(cfg, "name_or_path", None)}


def check_base(base_model: nn.Module, adapter_dir: Path) -> None:
    """Refuse an adapter on a base of another shape. LoRA on same-sized layers of another family
    loads without an error and gives nonsense (a tiny-llama adapter on tiny-qwen2: perplexity 1844)."""
    path = adapter_dir / BASE_FILE
    if not path.is_file():
        return  # an adapter written elsewhere (plain peft): nothing recorded to check
    trained = json.loads(path.read_text(encoding="utf-8"))
    here = base_shape(base_model)
    diff = [f"{k} {trained.get(k)} vs {here[k]}" for k in BASE_KEYS
            if trained.get(k) is not None and here[k] is not None and trained.get(k) != here[k]]
    if diff:
        raise SmolforgeError(f"the adapter in {adapter_dir} was trained on another base model "
                             f"({trained.get('name_or_path')}): {', '.join(diff)}",
                             fix=f"load it onto the base it was trained on ({trained.get('name_or_path')})")


def save_adapter(model: nn.Module, out_dir: str | Path, tokenizer=None,
                 weights: dict[str, torch.Tensor] | Path | None = None) -> Path:
    """Write the model's adapter (or the full model for `none`) to `out_dir`, atomically.

    `weights`: the trainable weights by parameter name when the model holds only shards of them
    (FSDP: `Strategy.model_state` gathered them), or the safetensors file they were streamed into;
    else they are read from the model. A full model's streamed file becomes its `model.safetensors`
    as it is (moved, never loaded whole): its names are the parameters', a tied weight once, which
    are the names `save_pretrained` writes.

    Everything is written to a temp directory next to `out_dir` and swapped into place, so a
    crash never leaves a half-written adapter where a reader could find it.
    """
    model = _unwrap(model)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        kind = peft_method(model_method(model))
        if isinstance(weights, Path) and not kind.full_model:  # an adapter's weights are small
            from safetensors.torch import load_file

            weights = load_file(str(weights))
        kind.save(model, tmp, weights)  # safetensors; peft models write only the adapter
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if not kind.full_model:
            (tmp / BASE_FILE).write_text(json.dumps(base_shape(model)), encoding="utf-8")
        atomic_replace_dir(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def adapter_method(adapter_dir: str | Path) -> str:
    """The method an adapter directory holds (one of METHODS), read from its config files."""
    adapter_dir = Path(adapter_dir)
    cfg = adapter_dir / "adapter_config.json"
    if cfg.exists():
        try:
            peft_type = json.loads(cfg.read_text(encoding="utf-8")).get("peft_type")
        except (json.JSONDecodeError, AttributeError) as err:
            raise SmolforgeError(f"{cfg} is not valid JSON", fix="re-save the adapter, or restore the file") from err
        known = by_peft_type(peft_type) if isinstance(peft_type, str) else None
        if known is not None:
            return known.name
        raise SmolforgeError(f"{cfg}: unsupported peft_type {peft_type!r}",
                             fix=f"smolforge reads {', '.join(peft_types())} adapters")
    if (adapter_dir / "config.json").exists():
        return FULL
    if not adapter_dir.exists():
        raise SmolforgeError(f"adapter directory {adapter_dir} does not exist", fix="check the --adapter path")
    raise SmolforgeError(f"{adapter_dir} holds neither adapter_config.json nor config.json",
                         fix="point --adapter at a directory written by `smolforge train` (<output-dir>/<method>_adapter)")


def load_adapter(base_model: nn.Module, adapter_dir: str | Path, *, is_trainable: bool = False) -> nn.Module:
    """`base_model` with the adapter in `adapter_dir` applied (for `none`, the saved full model).

    `is_trainable=True` leaves the adapter's parameters trainable, for resuming or further training.
    """
    adapter_dir = Path(adapter_dir)
    kind = peft_method(adapter_method(adapter_dir))
    base_model = _unwrap(base_model)
    if not kind.full_model:
        check_base(base_model, adapter_dir)
    return kind.load(base_model, adapter_dir, is_trainable=is_trainable)


def merge_adapter(model: nn.Module, *, plain: bool = True) -> nn.Module:
    """A transformers model with the adapter folded into its weights (lora, ia3).

    An adapter that changes a module tied to another (a LoRA on `lm_head` of a tied model) is folded
    into an untied model (`models/tied.py`): the result gives the unmerged adapter's outputs.

    Houlsby adapters add layers and cannot be folded into the base weights: with `plain=False`
    the model is returned as is (adapter modules kept, fine for in-process inference); with the
    default `plain=True` that is an error, because a "merged" directory written from it would
    silently lose the adapters when reloaded with `from_pretrained`.
    """
    model = _unwrap(model)
    kind = peft_method(model_method(model))
    if kind.merges:
        untie_for_merge(model)  # a delta on a tied head (or embedding) must not reach the other end
    return kind.merge(model, plain=plain)


def _is_checkpointing(model: nn.Module) -> bool:
    base = base_transformer(model)
    flag = getattr(type(base), "is_activation_checkpointing", None)
    if isinstance(flag, property):
        return bool(base.is_activation_checkpointing)
    return any(getattr(m, "gradient_checkpointing", False) for m in base.modules())


def _disable_checkpointing(base: nn.Module) -> None:
    if hasattr(base, "activation_checkpointing_disable"):
        base.activation_checkpointing_disable()
    else:  # transformers < 5.23
        base.gradient_checkpointing_disable()


def enable_gradient_checkpointing(model: nn.Module) -> nn.Module:
    """Turn on activation checkpointing so it works with every method; call it after `apply_peft`.

    Non-reentrant checkpointing is used, which back-propagates into adapters even when the
    block's inputs do not require grad; the embedding output is also made to require grad
    (transformers' `enable_input_require_grads`) for code paths that still checkpoint reentrantly.
    The KV cache is switched off: it is useless in training and conflicts with recomputation.
    A method may need more (`after_checkpointing`: prefix tuning's read-only prefix cache).
    """
    base = base_transformer(model)
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers < 5.23
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if carries_adapter(model) and hasattr(base, "enable_input_require_grads"):
        if not getattr(base, "_require_grads_hooks", None) and not getattr(base, "_require_grads_hook", None):
            base.enable_input_require_grads()
    if getattr(base, "config", None) is not None:
        base.config.use_cache = False
    peft_method(model_method(model)).after_checkpointing(model)
    return model
