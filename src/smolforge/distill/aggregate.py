"""Aggregating student adapters into one: `merged_model/final_adapter/`.

LoRA `mean` averages what the students actually learned, the weight updates ΔW_s = scale·B_s·A_s,
and then factors the mean back to rank r with a truncated SVD. peft's `linear` combination
averages A and B separately, which is the mean of the updates only when every student has the
same A or B; in general (B1+B2)(A1+A2)/4 adds the cross terms B1·A2 and B2·A1. The truncation
error is reported per layer; `rank=` can keep more than r (rank 2r keeps the mean of two students
exactly).

`ties` (Yadav et al. 2023) trims each student's update to its largest `density` fraction of
entries, elects a sign per entry by summed mass, and averages only the agreeing entries.

Other methods: (IA)^3 vectors and Houlsby adapters are averaged tensor by tensor; full
fine-tunes (`none`) average the weights (their mean is exactly the mean update). Prefix and
prompt tuning learn virtual tokens, not weight updates, and cannot be averaged: refused.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from smolforge.distill.settings import AGGREGATE_METHODS as METHODS  # the names, one place (torch-free)
from smolforge.errors import SmolforgeError
from smolforge.models.loading import resolve_model
from smolforge.models.peft import peft_method
from smolforge.models.peft_methods import adapter_method
from smolforge.paths import atomic_replace_dir, atomic_write_json

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "vocab.json", "merges.txt", "generation_config.json",
                    "base_model.json")  # and the base's shape (peft_methods.BASE_FILE): the merge keeps its base


@dataclass(frozen=True)
class AggregateSettings:
    """How the students' adapters merge: `aggregate_student_outputs`' keyword arguments, and the `args` a
    `distill_task` job's aggregate stage may give (checked at submit by `checked`, as the stage runs them).

    `method`: one of METHODS; `rank`: a LoRA merge's rank (None: the students' r), ≥ 1; `density`: the
    fraction of each update TIES keeps, in (0, 1]; `base_model`: the base a TIES merge of full fine-tunes
    takes the updates from."""

    method: str = "mean"
    rank: int | None = None
    density: float = 0.2
    base_model: str | None = None

    def checked(self) -> AggregateSettings:
        """These settings, or a SmolforgeError for the first value the merge refuses (its setting named)."""
        if self.method not in METHODS:
            raise SmolforgeError(f"unknown aggregation method {self.method!r}", fix=f"use one of {', '.join(METHODS)}")
        if not 0 < self.density <= 1:
            raise SmolforgeError(f"TIES density must be in (0, 1], got {self.density}", fix="use e.g. density 0.2")
        if self.rank is not None and self.rank < 1:
            raise SmolforgeError(f"the merged LoRA rank must be ≥ 1, got {self.rank}",
                                 fix="give a rank ≥ 1, or none: the merge keeps the students' r")
        return self


def find_adapter_dir(path: str | Path) -> Path:
    """A student output dir (`output/student_N`, holding `<peft>_adapter/`) or an adapter dir itself."""
    path = Path(path)
    if (path / "adapter_config.json").exists() or (path / "config.json").exists():
        return path
    found = sorted(p for p in path.glob("*_adapter") if p.is_dir()) if path.exists() else []
    if len(found) == 1:
        return found[0]
    if not found:
        raise SmolforgeError(f"{path} holds no adapter (no *_adapter/ directory or adapter_config.json)",
                             fix="pass the students' output dirs (e.g. output/student_0) after they finished")
    raise SmolforgeError(f"{path} holds several adapters: {', '.join(p.name for p in found)}",
                         fix="pass the adapter directory itself")


def final_adapter_path(output_path: str | Path) -> Path:
    """`…/final_adapter` as given, `<x>/merged_model` → `<x>/merged_model/final_adapter`, else add both."""
    output_path = Path(output_path)
    if output_path.name == "final_adapter":
        return output_path
    if output_path.name == "merged_model":
        return output_path / "final_adapter"
    return output_path / "merged_model" / "final_adapter"


def _method_of(adapter: Path) -> str:
    return adapter_method(adapter)


def _load_tensors(adapter: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(adapter.glob("adapter_model*.safetensors")) or sorted(adapter.glob("model*.safetensors"))
    if not files:
        raise SmolforgeError(f"{adapter} has no safetensors weights", fix="re-save the adapter with save_adapter")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def _lora_scaling(config: dict[str, Any], module_key: str) -> tuple[int, float]:
    r = int(config.get("r", 8))
    alpha = float(config.get("lora_alpha", r))
    for pattern, value in (config.get("rank_pattern") or {}).items():
        if module_key.endswith(pattern):
            r = int(value)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if module_key.endswith(pattern):
            alpha = float(value)
    scale = alpha / (r ** 0.5) if config.get("use_rslora") else alpha / r
    return r, scale


def lora_pairs(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, str]]:
    """module key → (A tensor name, B tensor name), for linear and embedding LoRA."""
    pairs: dict[str, tuple[str, str]] = {}
    for name in tensors:
        for a_tag, b_tag in ((".lora_A.", ".lora_B."), (".lora_embedding_A", ".lora_embedding_B")):
            if a_tag in name:
                b_name = name.replace(a_tag, b_tag)
                if b_name not in tensors:
                    raise SmolforgeError(f"LoRA tensor {name} has no matching {b_tag.strip('.')}",
                                         fix="the adapter file is incomplete; re-save it")
                pairs[name.split(a_tag)[0]] = (name, b_name)
    return pairs


def lora_deltas(adapter: str | Path) -> dict[str, torch.Tensor]:
    """Each LoRA module's update scale·B·A (float64), in the adapter's own orientation."""
    adapter = Path(adapter)
    config = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8"))
    tensors = _load_tensors(adapter)
    out = {}
    for key, (a, b) in lora_pairs(tensors).items():
        _r, scale = _lora_scaling(config, key)
        out[key] = scale * (tensors[b].double() @ tensors[a].double())
    return out


def ties_merge(deltas: list[torch.Tensor], density: float = 0.2) -> torch.Tensor:
    """TIES: trim each to its top-`density` magnitudes, elect signs by mass, mean of agreeing entries."""
    trimmed = []
    for d in deltas:
        flat = d.abs().flatten()
        keep = max(1, int(round(density * flat.numel())))
        threshold = flat.kthvalue(flat.numel() - keep + 1).values if keep < flat.numel() else flat.min() - 1
        trimmed.append(torch.where(d.abs() >= threshold, d, torch.zeros_like(d)))
    stack = torch.stack(trimmed)
    sign = torch.sign(stack.sum(0))
    agree = (torch.sign(stack) == sign) & (stack != 0)
    count = agree.sum(0).clamp_min(1)
    return (stack * agree).sum(0) / count


def _factor(delta: torch.Tensor, rank: int, scale: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Truncated SVD: (A [rank, in], B [out, rank]) with scale·B·A the best rank-`rank` fit; relative error."""
    U, S, Vh = torch.linalg.svd(delta, full_matrices=False)
    rank = min(rank, S.numel())
    root = S[:rank].sqrt()
    B = U[:, :rank] * root / (scale ** 0.5)
    A = root[:, None] * Vh[:rank] / (scale ** 0.5)
    total = float(S.pow(2).sum())
    err = float(S[rank:].pow(2).sum() / total) ** 0.5 if total > 0 else 0.0
    return A, B, err


def _aggregate_lora(adapters: list[Path], method: str, rank: int | None, density: float):
    configs = [json.loads((a / "adapter_config.json").read_text(encoding="utf-8")) for a in adapters]
    tensors = [_load_tensors(a) for a in adapters]
    if configs[0].get("use_dora"):
        raise SmolforgeError("cannot aggregate DoRA adapters by update averaging",
                             fix="train the students with plain LoRA")
    keys = [set(t) for t in tensors]
    if any(k != keys[0] for k in keys):
        raise SmolforgeError("the students' LoRA adapters target different modules",
                             fix="train every student with the same base model and --peft-config")
    pairs = lora_pairs(tensors[0])
    config = dict(configs[0])
    r_in = int(config.get("r", 8))
    r_out = int(rank or r_in)
    _, scale0 = _lora_scaling(configs[0], "")
    # Keep the scale: alpha' such that alpha'/r' (or /sqrt r') equals the old scale.
    config["r"] = r_out
    config["lora_alpha"] = scale0 * (r_out ** 0.5 if config.get("use_rslora") else r_out)
    config["rank_pattern"], config["alpha_pattern"] = {}, {}
    out: dict[str, torch.Tensor] = {}
    report: dict[str, float] = {}
    for key, (a_name, b_name) in pairs.items():
        deltas = []
        for cfg, t in zip(configs, tensors):
            _r, scale = _lora_scaling(cfg, key)
            deltas.append(scale * (t[b_name].double() @ t[a_name].double()))
        merged = torch.stack(deltas).mean(0) if method == "mean" else ties_merge(deltas, density)
        A, B, err = _factor(merged, r_out, scale0)
        dtype = tensors[0][a_name].dtype
        if A.shape[0] < r_out:  # a tiny layer whose full rank is below r: pad with zeros
            A = torch.cat([A, A.new_zeros(r_out - A.shape[0], A.shape[1])])
            B = torch.cat([B, B.new_zeros(B.shape[0], r_out - B.shape[1])], dim=1)
        out[a_name], out[b_name] = A.to(dtype).contiguous(), B.to(dtype).contiguous()
        report[key] = err
    for name in tensors[0]:  # anything else (modules_to_save, biases): plain mean
        if name not in out:
            out[name] = torch.stack([t[name].double() for t in tensors]).mean(0).to(tensors[0][name].dtype)
    return out, config, report


def _aggregate_tensors(adapters: list[Path], method: str, density: float, base: dict[str, torch.Tensor] | None,
                       neutral: float):
    tensors = [_load_tensors(a) for a in adapters]
    keys = set(tensors[0])
    if any(set(t) != keys for t in tensors):
        raise SmolforgeError("the students' adapters hold different tensors",
                             fix="train every student with the same base model and PEFT settings")
    out = {}
    for name in tensors[0]:
        ts = [t[name] for t in tensors]
        if not ts[0].is_floating_point():
            out[name] = ts[0]
            continue
        if method == "mean":
            out[name] = torch.stack([x.double() for x in ts]).mean(0).to(ts[0].dtype)
        else:
            origin = base[name].double() if base is not None and name in base else torch.full_like(ts[0].double(), neutral)
            merged = ties_merge([x.double() - origin for x in ts], density)
            out[name] = (origin + merged).to(ts[0].dtype)
    return out


def aggregate_student_outputs(student_output_dirs: list[str | Path], output_path: str | Path, method: str = "mean",
                              *, rank: int | None = None, density: float = 0.2,
                              base_model: str | None = None) -> dict[str, Any]:
    """Merge the students' adapters into `merged_model/final_adapter/` (see `final_adapter_path`).

    Returns a report: method, PEFT type, students, where it was written, and for LoRA the
    relative truncation error per layer (0 when rank ≥ the mean's rank). The settings: `AggregateSettings`
    (a value it refuses: SmolforgeError before anything is read).
    """
    from safetensors.torch import save_file

    AggregateSettings(method, rank, density, base_model).checked()
    if not student_output_dirs:
        raise SmolforgeError("no student outputs to aggregate", fix="run the students first")
    adapters = [find_adapter_dir(p) for p in student_output_dirs]
    kinds = {_method_of(a) for a in adapters}
    if len(kinds) != 1:
        raise SmolforgeError(f"students used different PEFT methods ({', '.join(sorted(kinds))})",
                             fix="aggregate students of one method at a time")
    kind = kinds.pop()
    method_class = peft_method(kind)
    if not method_class.aggregates:
        refused = method_class.refusal("aggregate", adapter=str(adapters[0]))
        raise SmolforgeError(refused.what, fix=f"keep one student's adapter ({adapters[0]}); {refused.fix}")
    final = final_adapter_path(output_path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
    report: dict[str, Any] = {"method": method, "peft": kind, "students": [str(a) for a in adapters],
                              "output": str(final)}
    try:
        first = adapters[0]
        for name in _TOKENIZER_FILES:
            if (first / name).exists():
                shutil.copy2(first / name, tmp / name)
        if method_class.low_rank:
            tensors, config, errors = _aggregate_lora(adapters, method, rank, density)
            save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
            (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            report.update(rank=config["r"], truncation_error=errors,
                          max_truncation_error=max(errors.values()) if errors else 0.0)
        elif method_class.full_model:
            base = None
            if method == "ties":
                if not base_model:
                    raise SmolforgeError("TIES on full fine-tunes needs the base model to compute updates",
                                         fix="pass base_model=<the students' base>")

                base = _load_tensors(Path(resolve_model(base_model)))
            tensors = _aggregate_tensors(adapters, method, density, base, 0.0)
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            shutil.copy2(first / "config.json", tmp / "config.json")
        else:  # ia3 (neutral 1) and Houlsby adapters (neutral 0)
            assert method_class.neutral is not None, kind
            tensors = _aggregate_tensors(adapters, method, density, None, method_class.neutral)
            save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
            shutil.copy2(first / "adapter_config.json", tmp / "adapter_config.json")
        atomic_write_json(tmp / "aggregation.json", report)
        atomic_replace_dir(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return report
