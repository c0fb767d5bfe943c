"""Learning-rate schedules: linear warmup, then cosine, linear or constant."""

from __future__ import annotations

import math

from torch.optim.lr_scheduler import LambdaLR


def lr_lambda(step: int, total: int, warmup: int, kind: str, min_ratio: float) -> float:
    if warmup and step < warmup:
        return (step + 1) / warmup
    if kind == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if kind == "linear":
        decay = 1.0 - progress
    else:
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * decay


def make_scheduler(optimizer, total: int, warmup: int, kind: str, min_ratio: float = 0.0) -> LambdaLR:
    return LambdaLR(optimizer, lambda s: lr_lambda(s, total, warmup, kind, min_ratio))
