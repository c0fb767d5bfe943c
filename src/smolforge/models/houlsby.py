"""Houlsby bottleneck adapters, our own small implementation.

HF peft has no Houlsby adapters and AdapterHub does not support transformers 5, so this module
adds them itself. Each transformer block gets two adapters, one on the attention output
projection and one on the MLP output projection (before the residual add, as in Houlsby et al.
2019): `y = x + up(act(down(x)))`. `up` starts at zero, so an untrained adapter is exactly the
identity and training starts from the base model's behaviour.

Why forward hooks rather than wrapper modules: the adapter is registered as a child named
`houlsby` of the projection it follows and applied by a forward hook on that projection. The
base model's own parameter names stay untouched (`...o_proj.weight`), so nothing that reads the
base state dict, ties weights or tensor-parallelises by name is surprised. The hook is a plain
module-level function, so the model still deep-copies and pickles.

On disk an adapter looks like a peft one: `adapter_config.json` (`"peft_type": "HOULSBY"`, base
model name, sizes, where the adapters sit) and `adapter_model.safetensors` holding only the adapter
tensors under their full model names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from smolforge.errors import SmolforgeError
from smolforge.models.families import family_of, registered

PEFT_TYPE = "HOULSBY"
CHILD = "houlsby"
FORMAT_VERSION = 1

# Where the adapters go is the family's `houlsby_sites` (models/families); families without them are
# tried with every pattern in turn.
FALLBACK_PATTERNS: tuple[tuple[str, ...], ...] = (
    ("self_attn.o_proj", "mlp.down_proj"),
    ("attn.c_proj", "mlp.c_proj"),
)


def houlsby_families() -> list[str]:
    """The model types whose families name the adapters' sites, sorted."""
    return sorted(t for t, cls in registered().items() if cls.houlsby_sites)


class BottleneckAdapter(nn.Module):
    """`x + up(act(down(x)))`: a residual bottleneck whose `up` starts at zero (identity)."""

    def __init__(self, hidden_size: int, adapter_size: int, *, init_std: float = 1e-2,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.down = nn.Linear(hidden_size, adapter_size, device=device, dtype=dtype)
        self.up = nn.Linear(adapter_size, hidden_size, device=device, dtype=dtype)
        self.act = nn.GELU()
        with torch.no_grad():
            nn.init.normal_(self.down.weight, std=init_std)
            nn.init.zeros_(self.down.bias)
            nn.init.zeros_(self.up.weight)
            nn.init.zeros_(self.up.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.up(self.act(self.down(x)))


def _apply_child_adapter(module: nn.Module, args: Any, output: Any) -> Any:
    """Forward hook: run the projection's output through its `houlsby` child."""
    adapter = getattr(module, CHILD)
    if isinstance(output, tuple):  # no projection we target returns one, but stay safe
        return (adapter(output[0]),) + output[1:]
    return adapter(output)


def _out_features(module: nn.Module) -> int:
    if isinstance(module, nn.Linear):
        return module.out_features
    if hasattr(module, "nf"):  # transformers' GPT-2 Conv1D stores (in, out) and names out `nf`
        return int(module.nf)
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    raise SmolforgeError(f"cannot tell the output width of {type(module).__name__}",
                         fix="use --peft lora for this model family")


def find_targets(model: nn.Module, patterns: tuple[str, ...] | None = None) -> tuple[tuple[str, ...], list[str]]:
    """The (suffix patterns, full module names) that get an adapter in this model."""
    names = [n for n, _ in model.named_modules()]
    family = family_of(getattr(model, "config", None))
    model_type = family.model_type
    if patterns is not None:
        candidates: tuple[tuple[str, ...], ...] = (tuple(patterns),)
    elif family.houlsby_sites:
        candidates = (family.houlsby_sites,)
    else:
        candidates = FALLBACK_PATTERNS
    for pats in candidates:
        found = [n for n in names if any(n.endswith("." + p) or n == p for p in pats)]
        found = [n for n in found if not n.endswith("." + CHILD)]
        if found and all(any(n.endswith(p) for n in found) for p in pats):
            return pats, found
    raise SmolforgeError(
        f"Houlsby adapters do not know where to go in model type {model_type!r}",
        fix=f"use --peft lora (any family), or a model of the families {', '.join(houlsby_families())}",
    )


def is_houlsby(model: nn.Module) -> bool:
    return any(isinstance(m, BottleneckAdapter) for m in model.modules())


def apply_houlsby(model: nn.Module, adapter_size: int, *, patterns: tuple[str, ...] | None = None,
                  init_std: float = 1e-2, freeze_base: bool = True) -> nn.Module:
    """Add adapters to `model` in place and return it; only adapter parameters stay trainable."""
    if is_houlsby(model):
        raise SmolforgeError("this model already has Houlsby adapters",
                             fix="apply adapters to a fresh base model")
    pats, targets = find_targets(model, patterns)
    modules = dict(model.named_modules())
    if freeze_base:
        for p in model.parameters():
            p.requires_grad_(False)
    for name in targets:
        proj = modules[name]
        ref = next(proj.parameters())
        adapter = BottleneckAdapter(_out_features(proj), adapter_size, init_std=init_std,
                                    device=ref.device, dtype=ref.dtype)
        proj.add_module(CHILD, adapter)
        proj.register_forward_hook(_apply_child_adapter)
    model._smolforge_houlsby = {  # read back by save_houlsby
        "adapter_size": adapter_size,
        "target_patterns": list(pats),
        "target_modules": targets,
        "init_std": init_std,
    }
    return model


def remove_houlsby(model: nn.Module) -> nn.Module:
    """Take every adapter and its hook off `model` again (in place), leaving the base model as it was."""
    for module in list(model.modules()):
        if isinstance(getattr(module, CHILD, None), BottleneckAdapter):
            for key, hook in list(module._forward_hooks.items()):
                if hook is _apply_child_adapter:
                    del module._forward_hooks[key]
            delattr(module, CHILD)
    if hasattr(model, "_smolforge_houlsby"):
        del model._smolforge_houlsby
    return model


def adapter_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Only the adapter tensors, under their full names in `model` (taken from `state_dict` when given)."""
    marker = f".{CHILD}."
    return {k: v for k, v in (model.state_dict() if state_dict is None else state_dict).items() if marker in f".{k}"}


def save_houlsby(model: nn.Module, out_dir: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """Write adapter_config.json + adapter_model.safetensors into an existing directory (the weights
    from `state_dict` when given: a sharded model's, gathered)."""
    from safetensors.torch import save_file

    info = getattr(model, "_smolforge_houlsby", None)
    if info is None:
        raise SmolforgeError("model has no Houlsby adapters to save", fix="call apply_peft with method 'adapter' first")
    out_dir = Path(out_dir)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in adapter_state_dict(model, state_dict).items()}
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = getattr(model, "config", None)
    first = next(m for m in model.modules() if isinstance(m, BottleneckAdapter))
    payload = {
        "peft_type": PEFT_TYPE,
        "format_version": FORMAT_VERSION,
        "base_model_name_or_path": getattr(config, "_name_or_path", None) or getattr(config, "name_or_path", None),
        "model_type": getattr(config, "model_type", None),
        "hidden_size": first.down.in_features,
        "activation": "gelu",
        "num_adapters": len(info["target_modules"]),
        **info,
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def load_houlsby(base_model: nn.Module, adapter_dir: str | Path, *, is_trainable: bool = False) -> nn.Module:
    """Put the saved adapters onto `base_model` (in place) with exactly the saved weights."""
    from safetensors.torch import load_file

    adapter_dir = Path(adapter_dir)
    config = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    if config.get("peft_type") != PEFT_TYPE:
        raise SmolforgeError(f"{adapter_dir} is not a Houlsby adapter (peft_type {config.get('peft_type')!r})",
                             fix="load it with smolforge.models.peft_methods.load_adapter")
    base = config.get("base_model_name_or_path")
    saved_type = config.get("model_type")
    model_type = getattr(getattr(base_model, "config", None), "model_type", None)
    if saved_type and model_type and saved_type != model_type:
        raise SmolforgeError(
            f"adapter in {adapter_dir} was trained on a {saved_type} model, but this base model is {model_type}",
            fix=f"load it onto the base model it was trained on ({base})",
        )
    try:
        model = apply_houlsby(base_model, int(config["adapter_size"]), patterns=tuple(config["target_patterns"]),
                              init_std=float(config.get("init_std", 1e-2)))
    except SmolforgeError as err:
        raise SmolforgeError(f"adapter in {adapter_dir} does not fit this base model: {err.what}",
                             fix=f"load it onto the base model it was trained on ({base})") from err
    expected = adapter_state_dict(model)
    ref = next(iter(expected.values()))
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"), device=str(ref.device))
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong_shape = sorted(k for k in set(expected) & set(tensors) if expected[k].shape != tensors[k].shape)
    if missing or unexpected or wrong_shape:
        remove_houlsby(model)
        raise SmolforgeError(
            f"adapter in {adapter_dir} does not fit this base model "
            f"(missing {len(missing)}, unexpected {len(unexpected)}, wrong shape {len(wrong_shape)} tensors)",
            fix=f"load it onto the base model it was trained on ({base})",
        )
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in tensors.items()}, strict=False)
    for name, p in model.named_parameters():
        p.requires_grad_(is_trainable and f".{CHILD}." in f".{name}")
    return model
