"""Streamed checkpoint files: safetensors written one tensor at a time, read by safetensors itself.

A sharded strategy (fsdp) gathers each tensor in turn and writes it as it comes, so a checkpoint of a
model that does not fit one process is never whole in memory. These check the file format against
safetensors' own reader, the optimizer file against `optimizer.state_dict()`, and that a broken
stream leaves nothing behind.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from smolforge.telemetry.memory import return_freed_memory
from smolforge.train import checkpoint as ckpt


def _specs(tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    return [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]


def test_a_streamed_file_is_what_safetensors_reads(tmp_path):
    tensors = {"w": torch.randn(5, 3), "half": torch.randn(7).to(torch.bfloat16), "ids": torch.arange(6).view(2, 3),
               "step": torch.tensor(4.0), "empty": torch.zeros(0, 4), "flag": torch.tensor([True, False]),
               "strided": torch.randn(4, 6).t()}  # not contiguous: written in its logical order
    path = ckpt.write_tensor_file(tmp_path / "t.safetensors", iter(tensors.items()), _specs(tensors),
                                  metadata={"format": "pt", "note": "x"})
    back = load_file(str(path))
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "note": "x"}
    assert [p.name for p in tmp_path.iterdir()] == ["t.safetensors"]  # the temp file was renamed


def test_a_stream_out_of_order_or_cut_short_leaves_no_file(tmp_path):
    tensors = {"a": torch.ones(2), "b": torch.zeros(3)}
    with pytest.raises(ValueError, match="expected"):
        ckpt.write_tensor_file(tmp_path / "x.safetensors", [("b", tensors["b"])], _specs(tensors))
    with pytest.raises(ValueError, match="never written"):
        ckpt.write_tensor_file(tmp_path / "y.safetensors", [("a", tensors["a"])], _specs(tensors))
    with pytest.raises(ValueError, match="expected"):  # a shape that is not the announced one
        ckpt.write_tensor_file(tmp_path / "z.safetensors", [("a", torch.ones(3))], _specs(tensors))
    assert list(tmp_path.iterdir()) == []


def test_an_optimizer_state_streamed_reads_back_as_its_state_dict(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW([{"params": [model[0].weight, model[1].weight], "weight_decay": 0.1},
                             {"params": [model[0].bias, model[1].bias], "weight_decay": 0.0}], lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    sd["state"][1]["note"] = 0.5  # a plain number in a state (some optimizers keep them)
    tensors = [(ckpt.optimizer_file_key(i, k), v) for i, st in sd["state"].items() for k, v in sorted(st.items())
               if isinstance(v, torch.Tensor)]
    scalars = {1: {"note": 0.5}}
    path = ckpt.write_tensor_file(tmp_path / ckpt.OPTIM_TENSORS, tensors, [(n, t.dtype, tuple(t.shape)) for n, t in tensors],
                                  ckpt.optimizer_file_metadata(sd["param_groups"], scalars))
    back = ckpt.read_optimizer_file(path)
    assert back["param_groups"] == sd["param_groups"]
    assert back["state"].keys() == sd["state"].keys()
    for i, st in sd["state"].items():
        assert back["state"][i].keys() == st.keys()
        for k, v in st.items():
            assert torch.equal(back["state"][i][k], v) if isinstance(v, torch.Tensor) else back["state"][i][k] == v
    fresh = torch.optim.AdamW(opt.param_groups, lr=1e-3)
    fresh.load_state_dict(back)  # what a resume does with it


def test_freed_memory_goes_back_to_the_system_on_linux():
    import sys

    assert return_freed_memory() is sys.platform.startswith("linux")
