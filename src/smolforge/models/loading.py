"""Load a causal LM and its tokenizer from a preset, a local directory, an HF id or an Ollama name.

Everything ends in `from_pretrained` on a directory or hub id, so the path users take with a real
model is the path the tests take with a tiny one.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

from smolforge.errors import SmolforgeError
from smolforge.models import tiny, twins
from smolforge.models.names import check_local_model
from smolforge.models.registry import ollama_to_hf

if TYPE_CHECKING:  # torch loads in the functions that use it: resolve_model checks a name without it
    import torch


# from_pretrained is not thread-safe (concurrent loads fail with "Cannot copy out of meta tensor"),
# and servers and actors load models from worker threads.
_LOAD_LOCK = threading.RLock()


def resolve_model(name: str, aliases: dict[str, str] | None = None) -> str:
    """Map a user's model name to something `from_pretrained` takes: a directory or an HF id."""
    if tiny.is_preset(name):
        return str(tiny.preset_dir(name))
    if twins.is_twin(name):  # config-exact twin of a published family, built on first use
        return str(twins.twin_dir(name))
    path = check_local_model(name)
    if path is not None:
        return str(path)
    hf = ollama_to_hf(name, aliases)
    if hf:
        return hf
    if ":" in name and "/" not in name:
        raise SmolforgeError(
            f"unknown Ollama model name {name!r}",
            fix="add it to the alias table (models.aliases in your config, or SMOLFORGE_MODEL_ALIASES=file.yaml) "
            "mapping it to a Hugging Face id",
        )
    return name


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes") or os.environ.get(
        "TRANSFORMERS_OFFLINE", "0"
    ).lower() in ("1", "true", "yes")


def _hub_error(name: str, resolved: str, err: Exception) -> SmolforgeError:
    if _offline():
        fix = (f"HF_HUB_OFFLINE is set and {resolved} is not in the local cache: download it once "
               f"with network access (`huggingface-cli download {resolved}`), or pass a local directory")
    else:
        fix = (f"check the name and your network; for gated models run `huggingface-cli login`; "
               f"or download {resolved} elsewhere and pass its directory")
    return SmolforgeError(f"cannot load model {name!r} ({resolved}): {type(err).__name__}: {err}".splitlines()[0], fix=fix)


def load_tokenizer(name: str, aliases: dict[str, str] | None = None, *, local_only: bool = False):
    """The tokenizer of `name` (a pad token set to eos when it has none); `local_only`: from files this
    machine has, never a download. Raises SmolforgeError when it cannot be loaded."""
    from transformers import AutoTokenizer

    resolved = resolve_model(name, aliases)
    try:
        tok = AutoTokenizer.from_pretrained(resolved, local_files_only=local_only)
    except (OSError, ValueError) as err:
        raise _hub_error(name, resolved, err) from err
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def tokenizer_here(name: str, aliases: dict[str, str] | None = None):
    """The tokenizer `load_tokenizer` would give for `name` when this machine can tell without a
    download (a preset or twin, built on first use; a local directory; an HF id in the local cache),
    else None (an Ollama tag or HF id only the workers hold, a GGUF file). Reads tokenizer files, not
    weights: what a submit-time check can afford."""
    try:
        return load_tokenizer(name, aliases, local_only=True)
    except SmolforgeError:
        return None


def load_model(name: str, *, device: str | torch.device = "cpu", dtype: torch.dtype | str | None = None,
               aliases: dict[str, str] | None = None, training: bool = False):
    """The model in train-ready form: on `device`, with `dtype` (fp32 by default).

    `dtype` is a torch dtype or a `--dtype` choice (auto|bf16|fp16|fp32, see models.dtypes);
    `training` makes a choice that cannot train on `device` (fp16 on a CPU) an error."""
    import torch
    from transformers import AutoModelForCausalLM

    resolved = resolve_model(name, aliases)
    if isinstance(dtype, str):
        from smolforge.models.dtypes import pick_dtype

        dtype = pick_dtype(dtype, resolved, torch.device(device), training=training)
    try:
        with _LOAD_LOCK:
            model = AutoModelForCausalLM.from_pretrained(resolved, dtype=dtype or torch.float32)
    except (OSError, ValueError) as err:
        raise _hub_error(name, resolved, err) from err
    return model.to(device)


def pick_device(device: str = "auto") -> torch.device:
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SmolforgeError("--device cuda asked for, but no CUDA GPU is visible", fix="use --device cpu or auto")
    return torch.device(device)
