"""Which engine computes `smolforge serve`'s tokens: a name -> loader registry, and the `auto` rule.

Why loaders of a `BatchModel` and nothing more: the engine thread (`engine.Engine`: queue, batches,
stop strings, sampling) and the HTTP side are the same for every engine; what differs is only where
the logits come from. So an engine is one function here that returns a `BatchModel` (batch.py) with a
tokenizer, a name and a context length, and the API never asks which one it got.

The `auto` rule (`AUTO_RULE`, shown by `serve --help`): llama.cpp on a CPU when the model exports to
GGUF (its family is one `models.export.gguf` writes) and llama-cpp-python is installed; torch for an
adapter (the GGUF cache holds base models), for a --dtype other than fp32 (the user asked for torch's
weights), on CUDA, and for a family GGUF export does not cover.
`--stages` is always torch (stage actors hold torch layers).
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from typing import Any, Callable

from smolforge.errors import SmolforgeError

DEFAULT_QUANT = "q8_0"
AUTO_RULE = ("auto: llamacpp on a CPU when the model's family exports to GGUF and llama-cpp-python is "
             "installed; torch with --adapter, with a --dtype other than fp32, on CUDA, or for other families")


@dataclass
class EngineSpec:
    """What an engine is asked to load: the `serve` options that concern the model."""

    model: str
    name: str
    adapter: str | None = None
    device: str = "auto"
    dtype: str = "fp32"
    quant: str | None = None  # llamacpp: a GGUF quantization (TEACHER_QUANTS); None: DEFAULT_QUANT
    threads: int | None = None  # None: the CPUs this process may use
    max_batch: int = 8

    @property
    def n_threads(self) -> int:
        return self.threads or len(os.sched_getaffinity(0))


@dataclass
class Loaded:
    """A loaded model for the engine thread, and the words the start-up line says of it."""

    model: Any  # a BatchModel with `name`, `tokenizer`, `max_positions`
    label: str


def load_torch(spec: EngineSpec, say: Callable[[str], None]) -> Loaded:
    """transformers on the chosen device and dtype (an adapter merged or applied)."""
    import torch

    from smolforge.serve.model import ServedModel

    if spec.quant is not None:
        raise SmolforgeError(f"--quant {spec.quant} is for the llamacpp engine", where="--engine torch",
                             fix="drop --quant (the torch engine takes --dtype), or use --engine llamacpp")
    if spec.threads:
        torch.set_num_threads(spec.threads)
    served = ServedModel.load(spec.model, spec.adapter, name=spec.name, device=spec.device, dtype=spec.dtype)
    return Loaded(served, f"torch, {served.device}, {spec.dtype}")


def _refuse_adapter(adapter: str) -> None:
    """The llamacpp engine serves a base model (its GGUF cache holds no adapters): refused, with the
    commands the adapter's method class says take it (the torch engine, stages, a merged GGUF export)."""
    from smolforge.models.names import check_adapter_dir
    from smolforge.models.peft import peft_method
    from smolforge.models.peft_methods import adapter_method

    path = check_adapter_dir(adapter)
    refused = peft_method(adapter_method(path)).refusal("serve:llamacpp", adapter=str(path))
    raise SmolforgeError("the llamacpp engine serves a base model: the GGUF cache holds no adapters",
                         where="--engine llamacpp", fix=refused.fix)


def load_llamacpp(spec: EngineSpec, say: Callable[[str], None]) -> Loaded:
    """The model's GGUF export (cached per node, as the llamacpp teacher's) in llama.cpp on the CPU."""
    from smolforge.serve.llamacpp import load_llamacpp as load

    quant = check_quant(spec.quant or DEFAULT_QUANT)
    if spec.adapter:  # the GGUF cache holds base models: the adapter's class names what takes it
        _refuse_adapter(spec.adapter)
    if spec.dtype != "fp32":
        raise SmolforgeError(f"--dtype {spec.dtype} is the torch engine's; the llamacpp engine takes --quant",
                             where="--engine llamacpp", fix="drop --dtype (e.g. --quant f16), or use --engine torch")
    if spec.device.startswith("cuda"):
        raise SmolforgeError(f"the llamacpp engine runs on the CPU, not --device {spec.device}",
                             where="--engine llamacpp", fix="use --device cpu, or --engine torch on CUDA")
    model = load(spec.model, name=spec.name, quant=quant, n_threads=spec.n_threads, max_batch=spec.max_batch, say=say)
    return Loaded(model, f"llama.cpp {quant}, {model.n_threads} thread{'s' * (model.n_threads != 1)}")


ENGINES: dict[str, Callable[[EngineSpec, Callable[[str], None]], Loaded]] = {
    "torch": load_torch,
    "llamacpp": load_llamacpp,
}


ENGINE_HELP = " | ".join(ENGINES) + f" | auto (default). {AUTO_RULE}"


def check_engine(name: str) -> str:
    """The name if an engine (or auto) has it; else one message with the closest name."""
    if name == "auto" or name in ENGINES:
        return name
    close = difflib.get_close_matches(name, [*ENGINES, "auto"], n=1)
    raise SmolforgeError(f"unknown engine {name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""),
                         where="--engine", fix=f"use one of {', '.join([*ENGINES, 'auto'])}")


def check_quant(quant: str) -> str:
    """The quantization if the GGUF cache makes it (`export.cache.TEACHER_QUANTS`, the one table); else one
    message naming --quant."""
    from smolforge.models.export.cache import check_quant as cache_makes

    return cache_makes(quant, "--quant")


def auto_engine(spec: EngineSpec) -> str:
    """The engine `auto` picks for this model (`AUTO_RULE`)."""
    if spec.adapter or spec.dtype != "fp32" or not _on_cpu(spec.device) or not _has_llama_cpp():
        return "torch"
    return "llamacpp" if exports_to_gguf(spec.model) else "torch"


def exports_to_gguf(model: str) -> bool:
    """Whether `models.export.gguf` writes this model's family (read from its config, no weights)."""
    import json

    from smolforge.models.export.gguf import family_of
    from smolforge.models.export.run import model_dir

    try:
        config = json.loads((model_dir(model) / "config.json").read_text(encoding="utf-8"))
        family_of(config)
    except (SmolforgeError, OSError, ValueError):
        return False
    return True


def _on_cpu(device: str) -> bool:
    if device != "auto":
        return device == "cpu"
    import torch

    return not torch.cuda.is_available()


def _has_llama_cpp() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def load_engine(name: str, spec: EngineSpec, say: Callable[[str], None] = lambda line: None) -> Loaded:
    """The model of engine `name` (auto: `auto_engine`'s choice)."""
    chosen = auto_engine(spec) if check_engine(name) == "auto" else name
    return ENGINES[chosen](spec, say)
