"""`--to hf`: the merged model as an ordinary Hugging Face directory, written shard by shard.

The directory loads with plain `AutoModelForCausalLM.from_pretrained` (no peft, no smolforge):
config, sharded safetensors with their index, tokenizer files, chat template and generation
config. Tensors arrive one at a time from `MergedModel.tensors()` and a shard is flushed once it
holds SHARD_BYTES, so the peak stays one shard plus one tensor above the adapters.

Houlsby adapters and prefix/prompt tuning are refused for `--to hf` as for GGUF (by
`merge.read_adapter`): a plain HF architecture has no place for them, and a directory that loads
without them would silently be the base model. Keep such an adapter and serve it with `--adapter`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from smolforge.models.export.merge import MergedModel

SHARD_BYTES = 64 * 2**20  # safetensors' save_file copies a shard to bytes once more: peak ~2x this
# What a tokenizer, its chat template and generation defaults may be saved as (whichever exist are copied).
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
              "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
              "generation_config.json")


def copy_side_files(model: MergedModel, out: Path) -> None:
    """The tokenizer, chat template and generation config, from the (possibly fine-tuned) base."""
    for name in SIDE_FILES:
        for src in (model.base_dir / name, model.tokenizer_dir / name):
            if src.is_file():
                shutil.copyfile(src, out / name)
                break


def write_hf(model: MergedModel, out: Path, dtype: str = "auto") -> dict:
    """Write the merged model into the empty directory `out`; returns {files, bytes}.

    `dtype` (a --dtype choice): the floating tensors are written in it (the merge itself folds in
    fp32, merge._apply) and config.json declares it; auto keeps the checkpoint's own dtypes."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cast = _cast_to(dtype)
    shards: list[dict] = []
    current: dict = {}
    size = total = 0
    for name, raw in model.tensors(cast):  # merged, then rounded once to `cast`
        tensor = raw.to(cast) if cast is not None and raw.is_floating_point() else raw
        if current and size + tensor.numel() * tensor.element_size() > SHARD_BYTES:
            shards.append(current)
            _flush(current, out, len(shards), save_file)
            current, size = {}, 0
        current[name] = tensor
        size += tensor.numel() * tensor.element_size()
        total += tensor.numel() * tensor.element_size()
    if current:
        shards.append(current)
        _flush(current, out, len(shards), save_file)
    count = len(shards)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        final = out / _shard_name(i, count)
        (out / f"part-{i}.safetensors").rename(final)
        weight_map.update({name: final.name for name in shard})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2), encoding="utf-8")
    config = dict(model.config)
    if cast is not None:  # transformers 5 reads `dtype`, older versions `torch_dtype`
        config["dtype"] = config["torch_dtype"] = str(cast).replace("torch.", "")
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    copy_side_files(model, out)
    return {"files": sorted(p.name for p in out.iterdir()), "bytes": total}


def _cast_to(dtype: str):
    """The torch dtype to write tensors in; None: as stored (auto)."""
    from smolforge.models.dtypes import torch_dtype

    return None if dtype == "auto" else torch_dtype(dtype)


def _shard_name(i: int, count: int) -> str:
    return f"model-{i:05d}-of-{count:05d}.safetensors"


def _flush(shard: dict, out: Path, index: int, save_file) -> None:
    """One shard to disk; its tensors are dropped by the caller right after (only the names stay)."""
    save_file(shard, str(out / f"part-{index}.safetensors"), metadata={"format": "pt"})
    for name in shard:
        shard[name] = None
