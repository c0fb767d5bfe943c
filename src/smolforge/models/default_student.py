"""The default student of `launch --mode teacher_student|hybrid` given no `--student`: the smallest
model of the teacher's family that a node holds (the seeds imply one: SOLLOL's guide distils
Llama-2-13b into TinyLlama students without naming them).

A model's family and size come from its config: a preset's or twin's from the code that builds it,
anything else from its directory or the local Hugging Face cache (`model_config`); a held model whose
config is not on this machine is left out. Sizes are parameter counts of the model built on the meta
device (`stage_costs.model_info`: no memory used).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

from smolforge.models.families import family_of


def model_config(model: str, local_dir: str | None = None) -> dict | None:
    """The model's config.json as a dict: a preset's or twin's from the code that builds it (nothing is
    built), else from `local_dir` (where this machine's scan found it), its directory or the local Hugging
    Face cache; None when it is not on this machine."""
    from smolforge.models import tiny, twins
    from smolforge.models.loading import resolve_model

    if local_dir and (Path(local_dir) / "config.json").is_file():
        return _read(Path(local_dir) / "config.json")
    if tiny.is_preset(model):
        family, sizes = tiny.PRESETS[model]
        return {"model_type": family, "vocab_size": tiny.TOKENIZER_VOCAB, **sizes}
    if twins.is_twin(model):
        return twins.twin_config(*twins.parse(model))
    try:
        resolved = resolve_model(model)
    except Exception:  # an Ollama tag without an HF id, a bad name: not a model whose config is here
        return None
    path = Path(resolved) / "config.json"
    if not path.is_file():
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(resolved, "config.json")
        path = Path(cached) if isinstance(cached, str) else path
    return _read(path)


def _read(path: Path) -> dict | None:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def parameter_count(config: dict) -> int:
    """Parameters of the model a config.json describes (built on the meta device)."""
    import torch
    from transformers import AutoConfig

    from smolforge.models.stage_costs import model_info

    body = {k: v for k, v in config.items() if k != "model_type"}
    info = model_info(AutoConfig.for_model(config["model_type"], **body), torch.float32)
    return info.total_bytes // 4


def default_student(teacher: str, held: Mapping[str, str | None]) -> tuple[str, int, int] | None:
    """(student, its parameters, the teacher's) for the smallest held model of the teacher's family,
    smaller than the teacher; None when no node holds one (or the teacher's config is not here).
    `held`: model name -> its directory on this machine (None: a name another node advertises)."""
    teacher_config = model_config(teacher)
    if teacher_config is None:
        return None
    family = type(family_of(teacher_config))
    same = {}  # the teacher's family first, by config alone: sizes (torch, transformers) only for those
    for name in sorted(set(held) - {teacher}):
        config = model_config(name, held[name])
        if config is not None and "model_type" in config and type(family_of(config)) is family:
            same[name] = config
    if not same:
        return None
    teacher_size = parameter_count(teacher_config)
    size, name = min((parameter_count(config), name) for name, config in same.items())
    return (name, size, teacher_size) if size < teacher_size else None
