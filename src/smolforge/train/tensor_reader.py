"""A safetensors file read one tensor, or one slice of a tensor, at a time.

Resuming is where a sharded strategy would otherwise hold the whole checkpoint: `load_file` reads every
tensor whole. With this reader FSDP reads only the rows of its shards and a pipeline rank only its
stage's tensors; `bytes_read` counts what was materialised, which is what the tests assert.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


class TensorReader:
    """One safetensors file read a tensor, or a slice of one, at a time (safetensors' `safe_open`),
    counting the bytes it materialised: a rank that keeps a shard reads only that shard, so resuming
    never holds the whole checkpoint (`Strategy.load_model_state`, `load_optimizer_file`)."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        self.path = Path(path)
        self._f = safe_open(str(path), framework="pt")
        self.bytes_read = 0

    def keys(self) -> list[str]:
        return list(self._f.keys())

    def metadata(self) -> dict[str, str]:
        return self._f.metadata() or {}

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._f.get_slice(name).get_shape())

    def get(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor `name`, or only `index` of it (one slice per leading dimension)."""
        t = self._f.get_tensor(name) if index is None else self._f.get_slice(name)[index]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def optimizer_state(self) -> dict[str, Any]:
        """The whole streamed optimizer state (`read_optimizer_file`'s answer), read through this reader."""
        meta = self.metadata()
        state: dict[int, dict[str, Any]] = {int(i): dict(v) for i, v in json.loads(meta.get("scalars", "{}")).items()}
        for name in self.keys():
            _, index, key = name.split(".", 2)
            state.setdefault(int(index), {})[key] = self.get(name)
        return {"state": state, "param_groups": optimizer_file_groups(meta)}


def optimizer_file_groups(meta: dict[str, str]) -> list[dict[str, Any]]:
    """A streamed optimizer state's param groups (JSON has no tuples: torch keeps its pairs, AdamW's
    betas, as tuples; `params` is the one list)."""
    return [{k: v if k == "params" or not isinstance(v, list) else tuple(v) for k, v in g.items()}
            for g in json.loads(meta["param_groups"])]
