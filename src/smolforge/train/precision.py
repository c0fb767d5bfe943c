"""Choosing the autocast dtype: measured, not assumed.

On a GPU bf16 (or fp16 where bf16 is missing) is always worth it. On a CPU it depends on the chip:
with AMX / AVX512-BF16 a bf16 autocast step measured 1.3–1.8x faster here, on older CPUs it is
slower than fp32. So `precision: auto` on a CPU picks bf16 only where `models/cpu_bf16.py` measured it clearly
faster (a small matmul step timed both ways, once per machine).
`SMOLFORGE_CPU_BF16=0|1` overrides the measurement (the test suite pins fp32 for exact
float-equality checks).
"""

from __future__ import annotations

import torch

from smolforge.models.cpu_bf16 import cpu_prefers_bf16


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """None means plain fp32."""
    if precision == "fp32":
        return None
    if precision == "bf16":
        return torch.bfloat16
    if precision == "fp16":
        return torch.float16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_prefers_bf16() else None
