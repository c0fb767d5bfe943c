"""Split-learning checkpoints: one directory per step on each side, atomic and checksummed.

Client: `<output_dir>/checkpoints/step-<N>/` with the bottom+top LoRA weights, a copy of the
trunk's LoRA weights (sent by the server), the optimizer, the RNG state and `state.json` (step,
data position, best eval loss, run settings).
Server: `<checkpoint_dir>/<session name>/step-<N>/` with the trunk LoRA weights and optimizer.

Both are written into a temp directory, checksummed into `manifest.json` and renamed into place,
so a crash leaves the previous checkpoint whole; a directory whose checksums fail is ignored. The
two sides save at the same step when the client asks, and resume picks the newest step both
sides hold (`shared_step`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

from smolforge.paths import atomic_write_json
from smolforge.train.checkpoint import MANIFEST, sha256_file, step_dirs, step_of, verify


def valid_steps(root: str | Path) -> list[int]:
    """Steps of the checkpoints under `root` whose checksums verify, ascending."""
    return [step_of(p) for p in step_dirs(root) if verify(p)]


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step}"


def shared_step(client_steps: list[int], server_steps: list[int]) -> int:
    """The newest step both sides can load; 0 (a fresh start) when they share none."""
    common = set(client_steps) & set(server_steps)
    return max(common) if common else 0


def write(root: str | Path, step: int, tensors: dict[str, dict[str, torch.Tensor]], blobs: dict[str, Any],
          state: dict[str, Any], keep_last: int = 2, on_written: Callable[[Path], None] | None = None) -> Path:
    """Write step `step` under `root`: each `tensors` entry as <name>.safetensors, each blob with
    torch.save (tensors and plain values only, read back with weights_only=True), then state.json
    and the manifest. Older checkpoints beyond `keep_last` are removed."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = step_dir(root, step)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".step-{step}."))
    try:
        for name, tdict in tensors.items():
            save_file({k: v.contiguous() for k, v in tdict.items()}, str(tmp / f"{name}.safetensors"))
        for name, blob in blobs.items():
            torch.save(blob, tmp / f"{name}.pt")
        atomic_write_json(tmp / "state.json", {"step": step, **state})
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        atomic_write_json(tmp / MANIFEST, {"step": step, "files": files})
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if on_written:
        on_written(final)
    for old in valid_steps(root)[:-keep_last] if keep_last > 0 else []:
        if old != step:
            shutil.rmtree(step_dir(root, old), ignore_errors=True)
    return final


def read(root: str | Path, step: int) -> tuple[Path, dict[str, Any]]:
    """The verified checkpoint directory of `step` and its state.json; raises FileNotFoundError."""
    path = step_dir(root, step)
    if not verify(path):
        raise FileNotFoundError(f"no valid checkpoint at {path}")
    return path, json.loads((path / "state.json").read_text())


def load_tensors(path: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(path / f"{name}.safetensors"))


def load_blob(path: Path, name: str) -> Any:
    return torch.load(path / f"{name}.pt", map_location="cpu", weights_only=True)
