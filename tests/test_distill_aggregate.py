"""Adapter aggregation: the LoRA mean is the exact mean of the weight updates, then truncated SVD."""

from __future__ import annotations

import json

import pytest
import torch

from smolforge.config import PeftSpec
from smolforge.distill.aggregate import aggregate_student_outputs, lora_deltas
from smolforge.errors import SmolforgeError
from smolforge.models.loading import load_model
from smolforge.models.peft_methods import apply_peft, load_adapter, merge_adapter, save_adapter


def _student(tmp_path, name: str, spec: PeftSpec, seed: int):
    """A PEFT model with random, non-trivial adapter weights (as if trained), saved like a student."""
    torch.manual_seed(seed)
    model = apply_peft(load_model("tiny-llama"), spec)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    out = tmp_path / "output" / name
    save_adapter(model, out / f"{spec.method}_adapter")
    return out


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().double().clone() for k, v in model.state_dict().items()}


def _updates(adapter_dir) -> dict[str, torch.Tensor]:
    """The real update of every base weight: merged(base + adapter) − base."""
    base = _weights(load_model("tiny-llama"))
    merged = _weights(merge_adapter(load_adapter(load_model("tiny-llama"), adapter_dir)))
    return {k: merged[k] - base[k] for k in base if not torch.equal(merged[k], base[k])}


def test_lora_mean_equals_exact_mean_of_updates(tmp_path):
    spec = PeftSpec(method="lora", r=4, alpha=8, dropout=0.0)
    students = [_student(tmp_path, f"student_{i}", spec, seed=i) for i in range(2)]
    per_student = [_updates(s / "lora_adapter") for s in students]
    want = {k: (per_student[0][k] + per_student[1][k]) / 2 for k in per_student[0]}
    assert len(want) == 4 * 7  # every linear of 4 blocks

    # rank 2r keeps the mean exactly: this is the mean "before truncation"
    report = aggregate_student_outputs(students, tmp_path / "exact", method="mean", rank=8)
    final = tmp_path / "exact" / "merged_model" / "final_adapter"
    assert report["output"] == str(final) and (final / "aggregation.json").exists()
    assert report["max_truncation_error"] < 1e-6
    got = _updates(final)
    assert set(got) == set(want)
    for k in want:
        assert (got[k] - want[k]).abs().max().item() < 1e-5, k

    # rank r: the best rank-r fit of the exact mean (Eckart–Young), its error reported per layer
    report = aggregate_student_outputs(students, tmp_path / "merged_model", method="mean")
    final_r = tmp_path / "merged_model" / "final_adapter"
    assert json.loads((final_r / "adapter_config.json").read_text())["r"] == 4
    got_r = _updates(final_r)
    for k in list(want)[:5]:
        s = torch.linalg.svdvals(want[k])
        best = (s[4:] ** 2).sum().sqrt()
        assert (got_r[k] - want[k]).norm().item() == pytest.approx(best.item(), rel=1e-4, abs=1e-7)
    assert 0 < report["max_truncation_error"] < 1

    # peft's "linear" (mean of A and mean of B) is not the mean of the updates
    d = [lora_deltas(s / "lora_adapter") for s in students]
    key = next(iter(d[0]))
    from safetensors.torch import load_file

    t = [load_file(str(s / "lora_adapter" / "adapter_model.safetensors")) for s in students]
    a_name = next(n for n in t[0] if n.startswith(key) and ".lora_A." in n)
    b_name = a_name.replace(".lora_A.", ".lora_B.")
    linear = 2.0 * ((t[0][b_name] + t[1][b_name]) / 2).double() @ ((t[0][a_name] + t[1][a_name]) / 2).double()
    assert (linear - (d[0][key] + d[1][key]) / 2).abs().max().item() > 1e-3


def test_ties_and_ia3_and_refusals(tmp_path):
    spec = PeftSpec(method="lora", r=4, alpha=8, dropout=0.0)
    students = [_student(tmp_path, f"lora_{i}", spec, seed=10 + i) for i in range(3)]
    report = aggregate_student_outputs(students, tmp_path / "ties", method="ties", density=0.3)
    assert report["method"] == "ties" and report["rank"] == 4
    load_adapter(load_model("tiny-llama"), tmp_path / "ties" / "merged_model" / "final_adapter")

    ia3 = [_student(tmp_path, f"ia3_{i}", PeftSpec(method="ia3"), seed=20 + i) for i in range(2)]
    aggregate_student_outputs(ia3, tmp_path / "ia3", method="mean")
    from safetensors.torch import load_file

    vecs = [load_file(str(s / "ia3_adapter" / "adapter_model.safetensors")) for s in ia3]
    merged = load_file(str(tmp_path / "ia3" / "merged_model" / "final_adapter" / "adapter_model.safetensors"))
    for k in merged:
        assert torch.allclose(merged[k], (vecs[0][k] + vecs[1][k]) / 2, atol=1e-7)

    prefix = [_student(tmp_path, f"prefix_{i}", PeftSpec(method="prefix"), seed=30 + i) for i in range(2)]
    with pytest.raises(SmolforgeError, match="cannot aggregate prefix tuning") as err:
        aggregate_student_outputs(prefix, tmp_path / "prefix")
    assert "--peft lora" in err.value.render()
    with pytest.raises(SmolforgeError, match="different PEFT methods"):
        aggregate_student_outputs([students[0], ia3[0]], tmp_path / "mixed")
    with pytest.raises(SmolforgeError, match="unknown aggregation method"):
        aggregate_student_outputs(students, tmp_path / "x", method="linear")
