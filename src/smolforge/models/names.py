"""What a user's model and adapter names point at, checked without loading anything (no torch): a command can
refuse a missing directory in a second, before it imports the libraries that load models."""

from __future__ import annotations

from pathlib import Path

from smolforge.errors import SmolforgeError
from smolforge.models import kinds, tiny, twins


def built_from_code(name: str) -> bool:
    """A preset, a twin or a model kind (`--model mlp`): every node builds it on first use from code (no
    files to hold or send), so placement treats it as held everywhere."""
    return tiny.is_preset(name) or twins.is_twin(name) or kinds.is_kind(name)


def check_local_model(name: str) -> Path | None:
    """The directory `name` names (None for a preset, an HF id or an Ollama name); a directory without
    config.json, or a path that does not exist, is a SmolforgeError."""
    if tiny.is_preset(name) or kinds.is_kind(name):
        return None
    if twins.is_twin(name):
        twins.parse(name)  # an unknown twin fails here, listing the known ones
        return None
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise SmolforgeError(
                f"model directory {path} has no config.json",
                fix="point --model at a directory written by save_pretrained, an HF id, or a preset "
                f"({', '.join(tiny.PRESETS)})",
            )
        return path
    if name.startswith((".", "/", "~")):
        raise SmolforgeError(f"model directory {name} does not exist", fix="check the path")
    return None


def check_adapter_dir(adapter: str) -> Path:
    """The adapter directory, which must exist (what is in it is checked when it loads)."""
    path = Path(adapter).expanduser()
    if not path.exists():
        raise SmolforgeError(f"adapter directory {path} does not exist",
                             fix="point --adapter at a <method>_adapter/ directory written by `smolforge train`")
    return path
