"""Which dtype a model's weights are loaded in: `--dtype auto|bf16|fp16|fp32`.

fp32 is the default (today's behaviour): every command loads in fp32 unless told otherwise, so a
full fine-tune (`--peft none`) never silently trains bf16 master weights whose small updates round
away, and results do not change with the machine. `auto` takes the checkpoint's own dtype
(config.json `dtype`/`torch_dtype`) where the device runs it well: on a GPU a declared bf16 (where
the GPU supports it) or fp16; on a CPU a declared bf16 only where `models.cpu_bf16` measured bf16
matmuls to be fast (`SMOLFORGE_CPU_BF16=0|1` overrides, as for `precision: auto`); fp32 otherwise,
and whenever the checkpoint says fp32 or nothing.

fp16 on a CPU is refused for training (no loss scaling there, and CPU fp16 kernels are slow or
missing for backward) and allowed for inference (serve, teacher, export, eval, generate).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from smolforge.config import DTYPE_CHOICES, DTYPE_HELP, normalise_dtype  # noqa: F401  (the vocabulary, one place)
from smolforge.errors import SmolforgeError

if TYPE_CHECKING:
    import torch

def parse_dtype(value: str | None, where: str = "--dtype") -> str:
    """The one check for a dtype given outside a pydantic spec (a CLI flag): a choice, or one message."""
    if value is None:
        return "fp32"
    choice = normalise_dtype(value)
    if choice not in DTYPE_CHOICES:
        raise SmolforgeError(f"{value!r} is not a dtype", where=where,
                             fix=f"use one of {', '.join(DTYPE_CHOICES)} (e.g. {where} bf16)")
    return choice


def torch_dtype(name: str) -> "torch.dtype":
    """'bf16' → torch.bfloat16 (and fp16, fp32); `auto` is resolved before this, by pick_dtype."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def checkpoint_dtype(resolved: str) -> str:
    """The dtype a checkpoint declares ('bf16', 'fp16' or 'fp32'); 'fp32' when it declares none."""
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(resolved)
    except (OSError, ValueError):
        return "fp32"  # load_model reports the real problem with its own message
    declared = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    name = str(declared).replace("torch.", "") if declared is not None else ""
    return {"bfloat16": "bf16", "float16": "fp16"}.get(name, "fp32")


def auto_dtype(declared: str, device: "torch.device") -> str:
    """`auto`: the declared dtype where `device` runs it well, else fp32 (see the module docstring)."""
    import torch

    if declared == "fp32":
        return "fp32"
    if device.type == "cuda":
        if declared == "bf16":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
        return declared
    if declared == "bf16" and device.type == "cpu":
        from smolforge.models.cpu_bf16 import cpu_prefers_bf16

        return "bf16" if cpu_prefers_bf16() else "fp32"
    return "fp32"  # fp16 on a CPU, or another device: fp32 is the safe reading


def pick_dtype(choice: str, resolved: str, device: "torch.device", *, training: bool = False) -> "torch.dtype":
    """The torch dtype to load `resolved` in for `choice` on `device`; refuses fp16 training on a CPU."""
    choice = parse_dtype(choice)
    name = auto_dtype(checkpoint_dtype(resolved), device) if choice == "auto" else choice
    if name == "fp16" and training and device.type == "cpu":
        raise SmolforgeError("dtype fp16 cannot train on a CPU (no loss scaling, slow or missing fp16 kernels)",
                             where="--dtype", fix="use --dtype bf16 (or fp32) on a CPU; fp16 is for serving there")
    return torch_dtype(name)
