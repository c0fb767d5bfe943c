"""Fold a split run's LoRA (bottom + trunk + top) into one ordinary HF model directory.

The client holds all three adapters after training: its own bottom/top LoRA and a copy of the
trunk's, which the server sends with every checkpoint. Together they cover every layer, so they
form one standard peft LoRA adapter (`<output_dir>/lora_adapter`). Merging loads the base model,
applies that adapter with `smolforge.models.peft_methods` and folds it in; the result loads with
`smolforge.models.load_model(dir)` and `smolforge generate --model dir`, and no longer needs
smolforge's split code or peft.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from smolforge.config import PeftSpec
from smolforge.errors import SmolforgeError
from smolforge.models.loading import load_model, load_tokenizer, resolve_model
from smolforge.models.peft_methods import load_adapter, merge_adapter
from smolforge.paths import atomic_replace_dir
from smolforge.rundir import claim_run_dir
from smolforge.split import checkpoint as ckpt
from smolforge.split.lora import save_peft_adapter


def _run_info(run_dir: Path) -> dict:
    path = run_dir / "split_run.json"
    if path.exists():
        return json.loads(path.read_text())
    return {}


def adapter_from_checkpoint(run_dir: Path, step: int | None, out_dir: Path) -> tuple[Path, dict]:
    """Write checkpoint `step` (newest if None) of a run as a peft adapter at out_dir."""
    from transformers import AutoConfig


    root = run_dir / "checkpoints"
    steps = ckpt.valid_steps(root)
    if not steps:
        raise SmolforgeError(f"{run_dir} holds no valid split checkpoint",
                             fix="point --output-dir at the directory `smolforge split train` wrote")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise SmolforgeError(f"{run_dir} has no valid checkpoint at step {step}", fix=f"use one of {steps}")
    path, state = ckpt.read(root, step)
    weights = {**ckpt.load_tensors(path, "client_lora"), **ckpt.load_tensors(path, "trunk_lora")}
    model_type = AutoConfig.from_pretrained(resolve_model(state["model"])).model_type
    save_peft_adapter(weights, PeftSpec(**state["lora"]), model_type, state["model"], out_dir)
    return out_dir, state


def merge_run(output_dir: str | Path, merged_dir: str | Path | None = None, *, model: str | None = None,
              step: int | None = None) -> Path:
    """Merge a split run into a full model directory (default `<output_dir>/merged_model`).

    Uses `<output_dir>/lora_adapter` (written when training finishes), or checkpoint `step` when
    given (for a run that was paused or is still going).
    """

    run_dir = Path(output_dir)
    merged_dir = Path(merged_dir) if merged_dir else run_dir / "merged_model"
    info = _run_info(run_dir)
    if merged_dir == run_dir / "merged_model":  # in the run's own dir: only a split run's merge is replaced
        legacy = ("merged_model",) if (run_dir / "split_run.json").is_file() else ()
        claim_run_dir(run_dir, "split", ("merged_model",), where="the run's directory", adopt=legacy)
    merged_dir.parent.mkdir(parents=True, exist_ok=True)
    # Scratch space next to the destination: the final rename must not cross filesystems.
    scratch = Path(tempfile.mkdtemp(prefix=f".{merged_dir.name}.merge-", dir=merged_dir.parent))
    try:
        adapter = run_dir / "lora_adapter"
        if step is not None or not (adapter / "adapter_config.json").exists():
            adapter, state = adapter_from_checkpoint(run_dir, step, scratch / "adapter")
            info = {**state, **info} if step is None else state
        name = model or info.get("model")
        if not name:
            raise SmolforgeError(f"cannot tell which base model {run_dir} was trained on", fix="pass --model M")
        base = load_model(name)
        tokenizer = load_tokenizer(name)
        merged = merge_adapter(load_adapter(base, adapter))
        tmp = scratch / "merged"
        merged.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        atomic_replace_dir(tmp, merged_dir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return merged_dir
