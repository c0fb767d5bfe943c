"""A PeftSpec from PEFT settings as people write them: `--peft` with `--peft-config JSON` and the
`--lora-*` flags, or a method and a dict in Python (the seeds' `peft_config` / `lora_config`).

Apart from `peft_methods` (which applies, saves and loads adapters) because it is about reading
and checking user input: no torch, so the CLI and job specs check PEFT flags in milliseconds.
"""

from __future__ import annotations

import json
import shlex
from typing import Any, get_args

from smolforge.config import PeftMethod, PeftSpec, validate
from smolforge.errors import SmolforgeError

METHODS: tuple[str, ...] = get_args(PeftMethod)  # what --peft takes and its help names (config.PeftMethod)

# The methods whose adapters `smolforge serve` runs unmerged (its KV cache holds the prompt's own
# positions): weight deltas and Houlsby's extra layers. Prefix and prompt tuning put learned virtual
# tokens in front of the cache, which peft's own generation does: `smolforge generate --adapter` runs
# every method. Each refusal's fix names the command that takes the adapter (`unmerged_command`).
SERVED_UNMERGED: tuple[str, ...] = ("none", "lora", "ia3", "adapter")


def unmerged_command(method: str, model: str, adapter: str) -> str:
    """The command that runs an adapter of `method` on `model` without merging it: serve where it can,
    else generate (one reply per call)."""
    model, adapter = shlex.quote(model), shlex.quote(adapter)
    if method in SERVED_UNMERGED:
        return f"smolforge serve --model {model} --adapter {adapter}"
    return f"smolforge generate --model {model} --adapter {adapter} --prompt Hello"

# --peft-config keys people write (peft's own names included) -> PeftSpec fields
_CLI_ALIASES = {
    "lora_r": "r",
    "rank": "r",
    "lora_alpha": "alpha",
    "lora_dropout": "dropout",
    "bottleneck": "adapter_size",
    "bottleneck_size": "adapter_size",
}


def peft_spec_from_cli(peft: str, peft_config_json: str | None = None, lora_r: int | None = None,
                       lora_alpha: float | None = None, lora_dropout: float | None = None) -> PeftSpec:
    """Build a PeftSpec from `--peft`, `--peft-config JSON` and `--lora-r/--lora-alpha/--lora-dropout`.

    The explicit flags win over the JSON, so `--peft-config` can hold a team default that a
    single run then adjusts.
    """
    if peft not in METHODS:
        raise SmolforgeError(f"unknown --peft {peft!r}", fix=f"use one of {', '.join(METHODS)}")
    loaded: Any = {}
    if peft_config_json:
        try:
            loaded = json.loads(peft_config_json)
        except json.JSONDecodeError as err:
            raise SmolforgeError(
                f"--peft-config is not valid JSON: {err.msg} at column {err.colno}",
                fix='write a JSON object with double quotes, e.g. --peft-config \'{"r": 8, "alpha": 16, "dropout": 0.05}\'',
            ) from err
        if not isinstance(loaded, dict):
            raise SmolforgeError(
                f"--peft-config must be a JSON object, got {type(loaded).__name__}",
                fix='write key/value pairs in braces, e.g. --peft-config \'{"r": 8, "alpha": 16}\'',
            )
    flags = {k: v for k, v in (("r", lora_r), ("alpha", lora_alpha), ("dropout", lora_dropout)) if v is not None}
    return peft_spec_from_config(peft, loaded, where="--peft-config", flags=flags, method_from="--peft")


def peft_spec_from_config(method: str, config: dict[str, Any] | None, where: str = "peft_config",
                          flags: dict[str, Any] | None = None, method_from: str = "peft_type") -> PeftSpec:
    """A PeftSpec from a method and a settings dict as people write it: PeftSpec's own names, peft's
    (`lora_r`, `lora_alpha`, ...) or the seeds' (`r/alpha/dropout`, `num_virtual_tokens`,
    `prompt_tuning_init(_text)`, `reduction_factor`). `flags` (explicit settings) win over the dict.
    One function for `--peft-config` and the Python API, so both accept the same keys."""
    data: dict[str, Any] = {}
    for key, value in (config or {}).items():
        key = _CLI_ALIASES.get(key, key)
        if key in data:
            raise SmolforgeError(f"{where} sets {key!r} twice", fix="keep one spelling of that key")
        data[key] = value
    if "method" in data and data["method"] != method:
        raise SmolforgeError(f"{where} says method {data['method']!r} but {method_from} is {method!r}",
                             fix=f"drop 'method' from {where}, or make the two agree")
    data.update(flags or {}, method=method)
    return validate(PeftSpec, data, where=where)
