"""precision: auto picks bf16 on a CPU only where it measured faster."""

from __future__ import annotations

import json

import torch

from smolforge.paths import home
from smolforge.models import cpu_bf16
from smolforge.train import precision


def test_explicit_choices_and_override(monkeypatch):
    cpu = torch.device("cpu")
    assert precision.autocast_dtype("fp32", cpu) is None
    assert precision.autocast_dtype("bf16", cpu) is torch.bfloat16
    monkeypatch.setenv("SMOLFORGE_CPU_BF16", "1")
    assert precision.autocast_dtype("auto", cpu) is torch.bfloat16
    monkeypatch.setenv("SMOLFORGE_CPU_BF16", "0")
    assert precision.autocast_dtype("auto", cpu) is None


def test_auto_follows_the_cached_measurement(monkeypatch):
    monkeypatch.delenv("SMOLFORGE_CPU_BF16", raising=False)
    speedup = cpu_bf16.cpu_bf16_speedup()
    assert speedup > 0
    cache = home() / "probes" / "cpu_bf16.json"
    table = json.loads(cache.read_text())
    assert list(table.values()) == [speedup]
    key = next(iter(table))
    for fake, expected in ((3.0, torch.bfloat16), (0.5, None)):
        cache.write_text(json.dumps({key: fake}))
        assert precision.autocast_dtype("auto", torch.device("cpu")) is expected
