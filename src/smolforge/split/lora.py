"""LoRA on model parts, initialised the same wherever the part lives.

Each side of a split run injects HF peft LoRA layers into its own parts (`inject_adapter_in_model`
works on any module). peft draws the initial A matrices from the global RNG, so the values would
depend on which process builds which layers in which order. `seeded_init` instead draws each A
from a generator seeded by (run seed, full-model module name): the client's bottom/top, the
server's trunk and a one-process model with LoRA on every layer start from identical weights,
which is what makes split training comparable, step for step, with local training.

Adapter files use peft's layout (`adapter_config.json` + `adapter_model.safetensors`, keys
`base_model.model.<module>.lora_A.weight`), so `smolforge.models.peft_methods.load_adapter`, peft
itself and the exporters read them.
"""

from __future__ import annotations

import hashlib
import math
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from smolforge.config import PeftSpec
from smolforge.errors import SmolforgeError
from smolforge.models.families import family_of, stage_families
from smolforge.models.peft import peft_method
from smolforge.paths import atomic_replace_dir

ADAPTER = "default"
def targets(spec: PeftSpec, model_type: str) -> list[str]:
    if spec.target_modules:
        return [spec.target_modules] if isinstance(spec.target_modules, str) else list(spec.target_modules)
    found = family_of(model_type).split_lora_targets
    if not found:
        raise SmolforgeError(f"split learning has no default LoRA targets for model type {model_type!r}",
                             fix="name them in the PEFT settings (target_modules), or use a model of the "
                                 f"{', '.join(stage_families())} families")
    return list(found)


def lora_config(spec: PeftSpec, model_type: str):
    from peft import LoraConfig

    return LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                      target_modules=targets(spec, model_type), fan_in_fan_out=family_of(model_type).fan_in_fan_out,
                      bias="none", task_type="CAUSAL_LM")


def _name_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def seeded_init(module: nn.Module, seed: int, canonical: Callable[[str], str] = lambda n: n) -> int:
    """Re-draw every LoRA A (kaiming-uniform, peft's default) from a per-module seed; B = 0.

    `canonical` maps the module's own names to full-model names. Returns how many layers it set.
    """
    from peft.tuners.lora import LoraLayer

    count = 0
    with torch.no_grad():
        for name, layer in module.named_modules():
            if not isinstance(layer, LoraLayer):
                continue
            for adapter, a in layer.lora_A.items():
                g = torch.Generator().manual_seed(_name_seed(seed, canonical(name)))
                w = torch.empty(a.weight.shape, dtype=torch.float32)
                nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=g)
                a.weight.copy_(w.to(a.weight.dtype))
                nn.init.zeros_(layer.lora_B[adapter].weight)
                count += 1
    return count


def apply_lora(part: nn.Module, spec: PeftSpec, seed: int, canonical: Callable[[str], str]) -> list[nn.Parameter]:
    """Freeze `part`, inject LoRA into its target linears, seed-init them; returns the LoRA params.

    A part without target modules (a bottom that is only the embeddings) gets none and trains
    nothing, which is correct: it has no LoRA to train.
    """
    from peft import inject_adapter_in_model

    model_type = part.arch.model_type
    for p in part.parameters():
        p.requires_grad_(False)
    kind = peft_method(spec.method)
    if not kind.split_trains:
        raise kind.refusal("split", where="--peft")
    if not any(_is_target(n, targets(spec, model_type)) for n, _ in part.named_modules()):
        return []
    try:
        inject_adapter_in_model(lora_config(spec, model_type), part, adapter_name=ADAPTER)
    except ValueError as err:
        raise SmolforgeError(f"cannot apply LoRA: {err}".splitlines()[0],
                             fix="check the target modules against the model's module names") from err
    seeded_init(part, seed, canonical)
    params = []
    for name, p in part.named_parameters():
        trainable = "lora_" in name
        p.requires_grad_(trainable)
        if trainable:
            params.append(p)
    return params


def _is_target(name: str, names: list[str]) -> bool:
    """peft's rule for a list of names: the module name equals one or ends with `.<one>`."""
    return any(name == t or name.endswith("." + t) for t in names)


def lora_state(module: nn.Module, canonical: Callable[[str], str]) -> dict[str, torch.Tensor]:
    """LoRA weights keyed by full-model names (`model.layers.3.self_attn.q_proj.lora_A.default.weight`)."""
    return {canonical(n): p.detach().cpu().float().clone() for n, p in module.named_parameters() if "lora_" in n}


def load_lora_state(module: nn.Module, state: dict[str, torch.Tensor], canonical: Callable[[str], str]) -> None:
    """Copy weights from `lora_state` output back in; every LoRA parameter must be present."""
    params = {canonical(n): p for n, p in module.named_parameters() if "lora_" in n}
    missing = sorted(set(params) - set(state))
    if missing:
        raise SmolforgeError(f"LoRA checkpoint lacks {len(missing)} weights (first: {missing[0]})",
                             fix="resume with the same model, split points and LoRA settings it was saved with")
    with torch.no_grad():
        for name, p in params.items():
            value = state[name]
            if value.shape != p.shape:
                raise SmolforgeError(f"LoRA weight {name} has shape {list(value.shape)}, model needs {list(p.shape)}",
                                     fix="resume with the same --lora-rank the run was started with")
            p.copy_(value.to(p.device, p.dtype))


def peft_key(name: str) -> str:
    """Our key -> peft's file key: drop the adapter name, add peft's `base_model.model.` prefix."""
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".")


def save_peft_adapter(state: dict[str, torch.Tensor], spec: PeftSpec, model_type: str, base_model: str,
                      out_dir: str | Path, tokenizer=None) -> Path:
    """Write `state` (full-model names) as a peft LoRA adapter directory, atomically."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        cfg = lora_config(spec, model_type)
        cfg.base_model_name_or_path = base_model
        cfg.save_pretrained(str(tmp))
        tensors = {peft_key(k): v.contiguous() for k, v in sorted(state.items())}
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        atomic_replace_dir(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
