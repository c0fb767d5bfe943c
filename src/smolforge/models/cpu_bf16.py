"""Is bf16 fast on this CPU? Measured once per machine, never assumed.

With AMX / AVX512-BF16 a bf16 autocast step measured 1.3–1.8x faster here, on older CPUs it is
slower than fp32. So a small matmul forward+backward is timed both ways once per machine (cached
under $SMOLFORGE_HOME) and bf16 counts as fast only when it is clearly faster. Two users: the
training loop's `precision: auto` (train/precision.py) and a model load's `--dtype auto`
(models/dtypes.py), which is why it lives down here. `SMOLFORGE_CPU_BF16=0|1` overrides the
measurement (the test suite pins fp32 for exact float-equality checks).
"""

from __future__ import annotations

import json
import os
import platform
import time

import torch

from smolforge.paths import atomic_write_json, home

SPEEDUP_NEEDED = 1.15


def _time_step(dtype: torch.dtype | None, reps: int = 5) -> float:
    torch.manual_seed(0)
    layer = torch.nn.Linear(1024, 1024)
    x = torch.randn(512, 1024)
    best = float("inf")
    for i in range(reps + 2):
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            y = layer(x)
        y.float().sum().backward()
        if i >= 2:
            best = min(best, time.perf_counter() - t)
    return best


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_bf16_speedup() -> float:
    """fp32 time / bf16-autocast time for a matmul step on this CPU, measured once and cached."""
    key = f"{_cpu_name()}|torch {torch.__version__}|threads {torch.get_num_threads()}"
    cache = home() / "probes" / "cpu_bf16.json"
    try:
        table = json.loads(cache.read_text())
    except (OSError, ValueError):
        table = {}
    if key not in table:
        table[key] = _time_step(None) / _time_step(torch.bfloat16)
        atomic_write_json(cache, table)
    return float(table[key])


def cpu_prefers_bf16() -> bool:
    forced = os.environ.get("SMOLFORGE_CPU_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    return cpu_bf16_speedup() >= SPEEDUP_NEEDED
