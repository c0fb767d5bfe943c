"""Atomic, checksummed training checkpoints that resume exactly.

A checkpoint is `<output_dir>/checkpoints/step-<N>/` holding the trainable weights, the optimizer,
the scheduler and RNG state, and `manifest.json` with a sha256 of every file. A strategy whose ranks
hold only shards (FSDP) streams the weights and the optimizer's tensors into safetensors files one
tensor at a time (`TensorFileWriter`), so the whole state is never in one process's memory; such a
checkpoint keeps the optimizer's tensors in `optim_state.safetensors` instead of `optim.pt`. It is written into a
temp directory and renamed into place, so a crash leaves the previous checkpoint intact; a
checkpoint whose checksums do not match is skipped when resuming.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors.torch import load_file, save_file

from smolforge.paths import atomic_replace_dir, atomic_write_json
from smolforge.train.strategy import Strategy
from smolforge.train.tensor_reader import TensorReader

MANIFEST = "manifest.json"
OPTIM_TENSORS = "optim_state.safetensors"  # a streamed optimizer state (see optimizer_file_items)

_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


class TensorFileWriter:
    """A safetensors file written one tensor at a time, in the order of `specs`.

    safetensors' own `save_file` serialises every tensor into one buffer first (a second copy of the
    whole state); here the header is written from the names, dtypes and shapes alone and each
    tensor's bytes follow as they come (a gathered shard, then freed). Readers are safetensors' own
    (`load_file`, `safe_open`, transformers). Written to `<path>.tmp`, fsynced, renamed on `close`.
    """

    def __init__(self, path: str | Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        self._expect: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        for name, dtype, shape in specs:
            size = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
            self._expect.append((name, dtype, tuple(shape)))
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self._f = open(self._tmp, "wb")
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want = self._expect[self._next]
        got = (name, tensor.dtype, tuple(tensor.shape))
        if got != want:
            raise ValueError(f"tensor file {self.path}: expected {want} next, got {got}")
        self._f.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        self._next += 1

    def close(self) -> Path:
        if self._next != len(self._expect):
            self.abort()
            raise ValueError(f"tensor file {self.path}: {len(self._expect) - self._next} tensors never written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        self._f.close()
        self._tmp.unlink(missing_ok=True)


def write_tensor_file(path: str | Path, items: Iterable[tuple[str, torch.Tensor]],
                      specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
                      metadata: dict[str, str] | None = None) -> Path:
    """Stream `items` (produced one at a time, e.g. gathered from shards) into a safetensors file."""
    writer = TensorFileWriter(path, specs, metadata)
    try:
        for name, tensor in items:
            writer.write(name, tensor)
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def spool_tensor_file(spool_dir: str | Path | None, kind: str, tensors: Iterable[tuple[str, torch.Tensor]],
                      specs: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]) -> Path:
    """A fresh safetensors file under `spool_dir` (the run's output dir; the system's temp dir without
    one), written as the tensors arrive: a sharded strategy's whole state, never whole in memory."""
    root = Path(spool_dir or tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=root, prefix=f".{kind}-", suffix=".safetensors")
    os.close(fd)
    return write_tensor_file(name, tensors, specs, metadata)


def optimizer_file_key(index: int, key: str) -> str:
    """Where `state[index][key]` of an optimizer state dict lives in an `optim_state.safetensors`."""
    return f"state.{index}.{key}"


def optimizer_file_metadata(param_groups: list[dict[str, Any]], scalars: dict[int, dict[str, Any]]) -> dict[str, str]:
    """The non-tensor half of a streamed optimizer state: its groups, and state values that are plain numbers."""
    return {"format": "pt", "param_groups": json.dumps(param_groups),
            "scalars": json.dumps({str(i): v for i, v in scalars.items()})}


def read_optimizer_file(path: str | Path) -> dict[str, Any]:
    """An `optim_state.safetensors` back as the `optimizer.state_dict()` it was streamed from."""
    return TensorReader(path).optimizer_state()


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
                    optimizer_state: dict[str, Any] | Path | None = None,
                    model_state: dict[str, torch.Tensor] | Path | None = None) -> Path:
    """Write `step-<step>/` atomically and prune all but the newest `keep_last`.

    `rank_rng`: every rank's CPU RNG state (a data-parallel group), kept as `cpu_rank<r>` so that each
    rank resumes its own dropout stream; `strategy_state`: the strategy's own tensors and numbers;
    `optimizer_state`: the whole optimizer state when it was gathered from sharded ranks
    (Strategy.optimizer_state), else `optimizer.state_dict()`; `model_state`: the trainable weights when
    gathered from shards (Strategy.model_state), else read from the model. Either may instead be the
    path of a safetensors file a strategy streamed them into (moved into the checkpoint, not copied).
    """
    root = checkpoints_dir(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".step-{step}."))
    try:
        if isinstance(model_state, Path):
            shutil.move(str(model_state), tmp / "trainable.safetensors")
        else:
            save_file(model_state if model_state is not None else trainable_state(model),
                      str(tmp / "trainable.safetensors"))
        if isinstance(optimizer_state, Path):
            shutil.move(str(optimizer_state), tmp / OPTIM_TENSORS)
        rng = {"cpu": torch.get_rng_state()}
        rng.update({f"cpu_rank{r}": state for r, state in enumerate(rank_rng or [])})
        if torch.cuda.is_available():
            rng.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
        save_file(rng, str(tmp / "rng.safetensors"))
        # Tensors plus plain numbers only: loaded back with weights_only=True.
        if isinstance(optimizer_state, Path):
            optimizer_blob = None  # its tensors are in OPTIM_TENSORS
        else:
            optimizer_blob = optimizer_state if optimizer_state is not None else optimizer.state_dict()
        torch.save({"optimizer": optimizer_blob,
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


def read_state(path: Path) -> dict[str, Any]:
    """A checkpoint's `state.json` (its step, and what the run recorded with it), without loading a tensor."""
    return json.loads((path / "state.json").read_text())


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer, scheduler, strategy=None) -> dict[str, Any]:
    """Restore weights, optimizer, scheduler and RNG; returns state.json.

    With a `strategy` (smolforge.train.strategy.Strategy), rank r restores the RNG state rank r saved
    when the checkpoint holds one per rank of the same world size; otherwise every rank takes the main
    rank's (a resumed group of another size cannot replay the old dropout streams anyway).
    """
    weights = TensorReader(path / "trainable.safetensors")  # read per key: FSDP reads only its shards
    params = dict(model.named_parameters())
    missing = [n for n in weights.keys() if n not in params]
    if missing:
        raise RuntimeError(f"checkpoint {path} has weights the model lacks: {missing[:3]}")
    strategy = strategy or Strategy()
    strategy.load_model_state(model, weights)
    blob = torch.load(path / "optim.pt", map_location="cpu", weights_only=True)
    read = weights.bytes_read
    if blob["optimizer"] is None:
        tensors = TensorReader(path / OPTIM_TENSORS)
        strategy.load_optimizer_file(optimizer, tensors)
        read += tensors.bytes_read
    else:
        strategy.load_optimizer_state(optimizer, blob["optimizer"])
    strategy.count_checkpoint_read(read)
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
    return read_state(path)
