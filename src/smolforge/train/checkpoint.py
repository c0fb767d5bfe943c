"""Atomic, checksummed training checkpoints that resume exactly.

A checkpoint is `<output_dir>/checkpoints/step-<N>/` holding the trainable weights, the optimizer,
the scheduler and RNG state, and `manifest.json` with a sha256 of every file. It is written into a
temp directory and renamed into place, so a crash leaves the previous checkpoint intact; a
checkpoint whose checksums do not match is skipped when resuming.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from smolforge.paths import atomic_replace_dir, atomic_write_json
from smolforge.train.strategy import Strategy

MANIFEST = "manifest.json"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def step_of(path: Path) -> int:
    """The step in a `step-N` checkpoint dir's name (-1 for other names)."""
    try:
        return int(path.name.split("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def step_dirs(root: str | Path) -> list[Path]:
    """The `step-N` directories directly under `root`, oldest first (none when it does not exist)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and step_of(p) >= 0]
    return sorted(found, key=step_of)


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    return step_dirs(checkpoints_dir(output_dir))


def verify(path: Path) -> bool:
    """True when the manifest exists and every file's checksum matches."""
    manifest = path / MANIFEST
    if not manifest.exists():
        return False
    try:
        files = json.loads(manifest.read_text())["files"]
        return all((path / name).exists() and sha256_file(path / name) == digest for name, digest in files.items())
    except (OSError, ValueError, KeyError):
        return False


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest checkpoint that verifies; corrupt or half-written ones are passed over."""
    for path in reversed(list_checkpoints(output_dir)):
        if verify(path):
            return path
    return None


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(output_dir: str | Path, step: int, model: torch.nn.Module, optimizer, scheduler,
                    extra: dict[str, Any] | None = None, keep_last: int = 2,
                    rank_rng: list[torch.Tensor] | None = None, strategy_state: dict[str, Any] | None = None,
                    optimizer_state: dict[str, Any] | None = None,
                    model_state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write `step-<step>/` atomically and prune all but the newest `keep_last`.

    `rank_rng`: every rank's CPU RNG state (a data-parallel group), kept as `cpu_rank<r>` so that each
    rank resumes its own dropout stream; `strategy_state`: the strategy's own tensors and numbers;
    `optimizer_state`: the whole optimizer state when it was gathered from sharded ranks
    (Strategy.optimizer_state), else `optimizer.state_dict()`; `model_state`: the trainable weights when
    gathered from shards (Strategy.model_state), else read from the model.
    """
    root = checkpoints_dir(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".step-{step}."))
    try:
        save_file(model_state if model_state is not None else trainable_state(model),
                  str(tmp / "trainable.safetensors"))
        rng = {"cpu": torch.get_rng_state()}
        rng.update({f"cpu_rank{r}": state for r, state in enumerate(rank_rng or [])})
        if torch.cuda.is_available():
            rng.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
        save_file(rng, str(tmp / "rng.safetensors"))
        # Tensors plus plain numbers only: loaded back with weights_only=True.
        torch.save({"optimizer": optimizer_state if optimizer_state is not None else optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "strategy": strategy_state or {}}, tmp / "optim.pt")
        atomic_write_json(tmp / "state.json", {"step": step, **(extra or {})})
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        atomic_write_json(tmp / MANIFEST, {"step": step, "files": files})
        atomic_replace_dir(tmp, final)  # fsynced, then swapped in; on disk before older ones go
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    for old in list_checkpoints(output_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer, scheduler, strategy=None) -> dict[str, Any]:
    """Restore weights, optimizer, scheduler and RNG; returns state.json.

    With a `strategy` (smolforge.train.strategy.Strategy), rank r restores the RNG state rank r saved
    when the checkpoint holds one per rank of the same world size; otherwise every rank takes the main
    rank's (a resumed group of another size cannot replay the old dropout streams anyway).
    """
    weights = load_file(str(path / "trainable.safetensors"))
    params = dict(model.named_parameters())
    missing = [n for n in weights if n not in params]
    if missing:
        raise RuntimeError(f"checkpoint {path} has weights the model lacks: {missing[:3]}")
    (strategy or Strategy()).load_model_state(model, weights)  # FSDP: each rank keeps its shard
    blob = torch.load(path / "optim.pt", map_location="cpu", weights_only=True)
    if strategy is not None:
        strategy.load_optimizer_state(optimizer, blob["optimizer"])
    else:
        optimizer.load_state_dict(blob["optimizer"])
    scheduler.load_state_dict(blob["scheduler"])
    rng = load_file(str(path / "rng.safetensors"))
    mine = None
    if strategy is not None:
        strategy.load_state_dict(blob.get("strategy") or {})
        per_rank = [rng[k] for k in sorted((k for k in rng if k.startswith("cpu_rank")), key=lambda k: int(k[8:]))]
        mine = strategy.rng_for_rank(per_rank) if per_rank else None
    torch.set_rng_state(mine if mine is not None else rng["cpu"])
    cuda = [rng[k] for k in sorted(k for k in rng if k.startswith("cuda"))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    return json.loads((path / "state.json").read_text())
