"""Parameter-efficient fine-tuning: one entry point for lora, prefix, prompt, ia3, adapter and none.

lora, prefix, prompt and ia3 go through HF peft, so their adapter directories are the ones the
rest of the ecosystem reads (peft itself; for LoRA also vLLM and llama.cpp's convert_lora_to_gguf). `adapter` is our own
Houlsby implementation (`smolforge.models.houlsby`), saved in the same layout. `none` is full
fine-tuning; its "adapter" directory is a complete model written by `save_pretrained`.

The engine, the distillation students and the split-learning client all call the same four
functions: `apply_peft`, `save_adapter`, `load_adapter`, `merge_adapter`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from smolforge.config import PeftSpec
from smolforge.errors import SmolforgeError
from smolforge.models import houlsby
from smolforge.models.tied import untie_for_merge
# Reading users' PEFT settings is its own module; these names stay importable from here.
from smolforge.models.peft_spec import METHODS, peft_spec_from_cli, peft_spec_from_config  # noqa: F401
from smolforge.paths import atomic_replace_dir


# peft's PeftType value -> our method name
_PEFT_TYPES = {
    "LORA": "lora",
    "PREFIX_TUNING": "prefix",
    "PROMPT_TUNING": "prompt",
    "IA3": "ia3",
    houlsby.PEFT_TYPE: "adapter",
}

# LoRA on GPT-2: its block projections are transformers' Conv1D (weights stored fan-in x fan-out).
_LORA_TARGETS = {"gpt2": ["c_attn", "c_proj", "c_fc"]}

# (IA)^3: scale keys, values and the MLP's input to the down projection.
_IA3_TARGETS: dict[str, tuple[list[str], list[str]]] = {
    "llama": (["k_proj", "v_proj", "down_proj"], ["down_proj"]),
    "qwen2": (["k_proj", "v_proj", "down_proj"], ["down_proj"]),
    "qwen3": (["k_proj", "v_proj", "down_proj"], ["down_proj"]),
    "mistral": (["k_proj", "v_proj", "down_proj"], ["down_proj"]),
    "gpt2": (["c_attn", "mlp.c_proj"], ["mlp.c_proj"]),
}



# --------------------------------------------------------------------------- helpers


def _unwrap(model: nn.Module) -> nn.Module:
    """Strip DDP/FSDP-style `.module` wrappers so we see the model itself."""
    while isinstance(model, torch.nn.parallel.DistributedDataParallel) or (
        type(model).__name__ in ("DistributedDataParallel", "FullyShardedDataParallel") and hasattr(model, "module")
    ):
        model = model.module
    return model


def _is_peft_model(model: nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def base_transformer(model: nn.Module) -> nn.Module:
    """The underlying transformers model (below any peft wrapper)."""
    model = _unwrap(model)
    if _is_peft_model(model):
        return model.get_base_model()
    return model


def model_method(model: nn.Module) -> str:
    """Which PEFT method a model in memory carries: one of METHODS."""
    model = _unwrap(model)
    if _is_peft_model(model):
        peft_type = str(getattr(model.peft_config[model.active_adapter].peft_type, "value",
                                model.peft_config[model.active_adapter].peft_type))
        return _PEFT_TYPES.get(peft_type, peft_type.lower())
    if houlsby.is_houlsby(model):
        return "adapter"
    return "none"


def virtual_token_offset(model: nn.Module) -> int:
    """How many positions prompt tuning prepends to `outputs.logits` (0 for every other method).

    Prompt tuning feeds its virtual tokens through the model as embeddings, so the logits are
    `num_virtual_tokens` longer than `input_ids`; code that lines logits up with labels itself
    (a hand-rolled loss, distillation against teacher logits) slices `logits[:, offset:]`.
    peft's own `labels=` loss already accounts for it (and also scores the first real token from
    the last virtual position). Prefix tuning does not lengthen the logits.
    """
    model = _unwrap(model)
    if model_method(model) != "prompt":
        return 0
    config = model.peft_config[model.active_adapter]
    return int(config.num_virtual_tokens) * int(getattr(config, "num_transformer_submodules", 1) or 1)


def adapter_dir(output_dir: str | Path, method: str) -> Path:
    """Where a run's adapter goes: `<output_dir>/<method>_adapter` (the seed projects' layout)."""
    return Path(output_dir) / f"{method}_adapter"


@contextlib.contextmanager
def _quiet_peft():
    """peft 0.21 reads transformers' deprecated `is_gradient_checkpointing`; that warning means nothing to users.
    Nor does its warning about a tied module in the adapter: merges untie it (`models/tied.py`)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        # a tied module in the adapter: smolforge unties at merge and says so once (models/tied.py)
        warnings.filterwarnings("ignore", message="Model has `tie_word_embeddings=True` and a tied layer")
        yield


def _model_type(model: nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def _has_conv1d(model: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return any(isinstance(m, Conv1D) for m in model.modules())


def _lora_config(model: nn.Module, spec: PeftSpec):
    from peft import LoraConfig

    targets: Any = spec.target_modules
    if targets is None:
        # peft's "all-linear" is every Linear/Conv1D except the output head.
        targets = _LORA_TARGETS.get(_model_type(model) or "", "all-linear")
    return LoraConfig(
        task_type="CAUSAL_LM",
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=targets,
        fan_in_fan_out=_has_conv1d(model),
        bias="none",
    )


def _ia3_config(model: nn.Module, spec: PeftSpec):
    from peft import IA3Config
    from peft.utils.constants import (
        TRANSFORMERS_MODELS_TO_IA3_FEEDFORWARD_MODULES_MAPPING as PEFT_FF,
        TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING as PEFT_TARGETS,
    )

    mtype = _model_type(model) or ""
    if mtype in _IA3_TARGETS:
        targets, feedforward = _IA3_TARGETS[mtype]
    elif mtype in PEFT_TARGETS:
        targets, feedforward = list(PEFT_TARGETS[mtype]), list(PEFT_FF.get(mtype, []))
    else:
        targets, feedforward = None, None
    if spec.target_modules is not None:
        given = [spec.target_modules] if isinstance(spec.target_modules, str) else list(spec.target_modules)
        # feedforward modules must be a subset of the targets: keep the family's ones the user kept
        feedforward = [m for m in (feedforward or []) if m in given]
        targets = given
    if targets is None:
        raise SmolforgeError(
            f"(IA)^3 has no default target modules for model type {mtype!r}",
            fix='name them: --peft-config \'{"target_modules": ["k_proj", "v_proj", "down_proj"]}\'',
        )
    return IA3Config(
        task_type="CAUSAL_LM",
        target_modules=list(targets),
        feedforward_modules=list(feedforward or []),
        fan_in_fan_out=_has_conv1d(model),
    )


def _peft_config(model: nn.Module, spec: PeftSpec):
    from peft import PrefixTuningConfig

    if spec.method == "lora":
        return _lora_config(model, spec)
    if spec.method == "ia3":
        return _ia3_config(model, spec)
    if spec.method == "prefix":
        return PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=spec.num_virtual_tokens)
    if spec.method == "prompt":
        return _prompt_config(model, spec)
    raise AssertionError(spec.method)


def _adapter_size(model: nn.Module, spec: PeftSpec) -> int:
    """Houlsby's bottleneck width: `adapter_size`, or hidden size / `reduction_factor` (how the seeds and
    AdapterHub size it, so one setting fits models of any width)."""
    if not spec.reduction_factor:
        return spec.adapter_size
    cfg = base_transformer(model).config
    hidden = getattr(cfg, "hidden_size", None) or cfg.n_embd
    return max(1, int(hidden) // spec.reduction_factor)


def _prompt_config(model: nn.Module, spec: PeftSpec):
    """Prompt tuning initialised as `spec.prompt_tuning_init` says (SAMPLE_VOCAB by default: see PeftSpec).

    TEXT reads the tokenizer from where the model was loaded (`name_or_path`: a preset's or a local
    model's directory, or a hub id already in the cache), so it needs nothing from the network.
    """
    from peft import PromptTuningConfig

    kwargs: dict[str, Any] = {"prompt_tuning_init": spec.prompt_tuning_init}
    if spec.prompt_tuning_init == "TEXT":
        kwargs.update(prompt_tuning_init_text=spec.prompt_tuning_init_text,
                      tokenizer_name_or_path=getattr(_unwrap(model), "name_or_path", None) or None)
        if kwargs["tokenizer_name_or_path"] is None:
            raise SmolforgeError("prompt_tuning_init TEXT needs the model's tokenizer, and this model does not say "
                                 "where it was loaded from", fix="use prompt_tuning_init SAMPLE_VOCAB, or load the "
                                 "model from a directory or hub id")
    return PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=spec.num_virtual_tokens, **kwargs)


# --------------------------------------------------------------------------- public API


def apply_peft(model: nn.Module, spec: PeftSpec) -> nn.Module:
    """Return `model` ready to train with `spec.method`; only that method's parameters are trainable.

    For peft methods the result is a `peft.PeftModel` around `model`; for `adapter` and `none`
    it is `model` itself (adapters added in place for `adapter`).
    """
    if spec.method not in METHODS:
        raise SmolforgeError(f"unknown PEFT method {spec.method!r}", fix=f"use one of {', '.join(METHODS)}")
    model = _unwrap(model)
    if model_method(model) != "none":
        raise SmolforgeError("this model already carries a PEFT adapter",
                             fix="apply PEFT to a freshly loaded base model")
    if spec.method == "none":
        for p in model.parameters():
            p.requires_grad_(True)
        return model
    if spec.method == "adapter":
        return houlsby.apply_houlsby(model, _adapter_size(model, spec))
    from peft import get_peft_model

    # peft refuses prefix tuning on a checkpointing model; switch it off, apply, switch it back on
    recheckpoint = spec.method == "prefix" and _is_checkpointing(model)
    if recheckpoint:
        _disable_checkpointing(model)
    try:
        with _quiet_peft():
            peft_model = get_peft_model(model, _peft_config(model, spec))
        return enable_gradient_checkpointing(peft_model) if recheckpoint else peft_model
    except ValueError as err:  # e.g. target modules not found
        raise SmolforgeError(f"cannot apply {spec.method}: {err}".splitlines()[0],
                             fix="check target_modules in --peft-config against the model's module names") from err


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
        method = model_method(model)
        if isinstance(weights, Path) and method != "none":  # an adapter's weights are small
            from safetensors.torch import load_file

            weights = load_file(str(weights))
        if isinstance(weights, Path):
            _save_full_model_file(model, weights, tmp)
        elif method == "adapter":
            houlsby.save_houlsby(model, tmp, state_dict=weights)
        else:  # safetensors; peft models write only the adapter
            model.save_pretrained(tmp, **({} if weights is None else {"state_dict": weights}))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if method != "none":
            (tmp / BASE_FILE).write_text(json.dumps(base_shape(model)), encoding="utf-8")
        atomic_replace_dir(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _save_full_model_file(model: nn.Module, weights_file: Path, out: Path) -> None:
    """What `save_pretrained` writes for a full model, with its weights already in `weights_file`."""
    config = model.config
    # FSDP swaps the model's class for a subclass (FSDPLlamaForCausalLM); the file names the model's own
    own = next(c for c in type(model).__mro__ if c.__module__.startswith("transformers."))
    architectures = config.architectures
    config.architectures = [own.__name__]
    try:
        config.save_pretrained(out)
    finally:
        config.architectures = architectures
    generation = getattr(model, "generation_config", None)
    if generation is not None and model.can_generate():
        generation.save_pretrained(out)
    shutil.move(str(weights_file), out / "model.safetensors")


def adapter_method(adapter_dir: str | Path) -> str:
    """The method an adapter directory holds (one of METHODS), read from its config files."""
    adapter_dir = Path(adapter_dir)
    cfg = adapter_dir / "adapter_config.json"
    if cfg.exists():
        try:
            peft_type = json.loads(cfg.read_text(encoding="utf-8")).get("peft_type")
        except (json.JSONDecodeError, AttributeError) as err:
            raise SmolforgeError(f"{cfg} is not valid JSON", fix="re-save the adapter, or restore the file") from err
        if peft_type in _PEFT_TYPES:
            return _PEFT_TYPES[peft_type]
        raise SmolforgeError(f"{cfg}: unsupported peft_type {peft_type!r}",
                             fix=f"smolforge reads {', '.join(sorted(_PEFT_TYPES))} adapters")
    if (adapter_dir / "config.json").exists():
        return "none"
    if not adapter_dir.exists():
        raise SmolforgeError(f"adapter directory {adapter_dir} does not exist", fix="check the --adapter path")
    raise SmolforgeError(f"{adapter_dir} holds neither adapter_config.json nor config.json",
                         fix="point --adapter at a directory written by `smolforge train` (<output-dir>/<method>_adapter)")


def load_adapter(base_model: nn.Module, adapter_dir: str | Path, *, is_trainable: bool = False) -> nn.Module:
    """`base_model` with the adapter in `adapter_dir` applied (for `none`, the saved full model).

    `is_trainable=True` leaves the adapter's parameters trainable, for resuming or further training.
    """
    adapter_dir = Path(adapter_dir)
    method = adapter_method(adapter_dir)
    base_model = _unwrap(base_model)
    if method != "none":
        check_base(base_model, adapter_dir)
    if method == "none":
        from transformers import AutoModelForCausalLM

        ref = next(base_model.parameters())
        model = AutoModelForCausalLM.from_pretrained(str(adapter_dir), dtype=ref.dtype).to(ref.device)
        for p in model.parameters():
            p.requires_grad_(is_trainable)
        return model
    if method == "adapter":
        return houlsby.load_houlsby(base_model, adapter_dir, is_trainable=is_trainable)
    from peft import PeftModel

    try:
        with _quiet_peft():
            model = PeftModel.from_pretrained(base_model, str(adapter_dir), is_trainable=is_trainable)
    except (RuntimeError, ValueError, KeyError) as err:
        base = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8")).get("base_model_name_or_path")
        raise SmolforgeError(f"cannot load {method} adapter {adapter_dir}: {err}".splitlines()[0],
                             fix=f"load it onto the base model it was trained on ({base})") from err
    if not is_trainable:  # peft leaves prompt-learning encoders trainable even in inference mode
        for p in model.parameters():
            p.requires_grad_(False)
    return model


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
    method = model_method(model)
    if method == "none":
        return model
    if method in ("lora", "ia3"):
        untie_for_merge(model)  # a delta on a tied head (or embedding) must not reach the other end
        return model.merge_and_unload()
    if method in ("prefix", "prompt"):
        raise SmolforgeError(
            f"cannot merge {method} tuning; keep the adapter",
            fix="load the base model with --adapter <dir> instead of merging, or train with --peft lora to get a mergeable adapter",
        )
    if not plain:
        return model
    raise SmolforgeError(
        "cannot merge Houlsby adapters into the base weights: they are extra layers, not weight deltas",
        fix="keep the adapter and load it with --adapter <dir>, or train with --peft lora to get a mergeable adapter",
    )


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
    Prefix tuning needs more, see `_prefix_survives_checkpointing`.
    """
    base = base_transformer(model)
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers < 5.23
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if model_method(model) != "none" and hasattr(base, "enable_input_require_grads"):
        if not getattr(base, "_require_grads_hooks", None) and not getattr(base, "_require_grads_hook", None):
            base.enable_input_require_grads()
    if getattr(base, "config", None) is not None:
        base.config.use_cache = False
    if model_method(model) == "prefix":
        _prefix_survives_checkpointing(_unwrap(model))
    return model


def _read_only_prefix_cache(cache: Any) -> Any:
    """Make each layer of peft's prefix cache return `cat(prefix, new)` without storing `new`.

    A checkpointed block runs its forward twice (forward, then the recompute in backward). With
    an ordinary DynamicCache the second run would append its keys again and see a longer
    sequence. Read-only layers give both runs the same keys, and the attention mask (computed once
    from the prefix length before any layer runs) is the same as without checkpointing.
    """
    from transformers.cache_utils import DynamicLayer

    read_only = _read_only_layer_class()
    for layer in getattr(cache, "layers", []):
        if type(layer) is DynamicLayer:
            layer.__class__ = read_only
        elif not isinstance(layer, read_only):
            raise SmolforgeError(
                f"prefix tuning with gradient checkpointing does not support {type(layer).__name__} cache layers",
                fix="turn gradient checkpointing off for this model, or use --peft lora / prompt",
            )
    return cache


def _prefix_survives_checkpointing(model: nn.Module) -> None:
    """Let prefix tuning's KV prefix pass through checkpointed blocks.

    peft hands the learned prefix to the model as a pre-filled KV cache, and transformers drops
    any cache a checkpointed block receives (because a block that writes to the cache would write
    twice). We make the training-time prefix cache read-only and tell the blocks it is safe to keep.
    """
    import types

    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    if not layers:
        raise SmolforgeError(
            "prefix tuning with gradient checkpointing needs a model whose blocks checkpoint themselves "
            "(transformers' GradientCheckpointingLayer)",
            fix="turn gradient checkpointing off for this model, or use --peft lora / prompt",
        )
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module._can_checkpoint_with_cache = True
        elif getattr(module, "gradient_checkpointing", False):
            # Backbones such as GPT2Model drop the cache themselves when this flag is on; the
            # blocks above do the checkpointing, so the backbone flag only has that effect.
            module.gradient_checkpointing = False
    if getattr(model, "_smolforge_prefix_ckpt", False):
        return
    original = model.get_prompt

    def get_prompt(self, *args, **kwargs):
        prompt = original(*args, **kwargs)
        if self.training:
            prompt = _read_only_prefix_cache(prompt)
        return prompt

    model.get_prompt = types.MethodType(get_prompt, model)
    model._smolforge_prefix_ckpt = True


@functools.cache
def _read_only_layer_class():
    from transformers.cache_utils import DynamicLayer

    class ReadOnlyPrefixLayer(DynamicLayer):
        """A DynamicLayer whose `update` returns prefix + new states and stores nothing."""

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                return key_states, value_states
            return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)

    return ReadOnlyPrefixLayer

