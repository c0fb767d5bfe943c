"""Dropout randomness that depends only on (run seed, part, step, micro-batch).

Each side of a split run draws dropout masks in its own process, so the process-wide RNG state
would depend on what else that process did (other sessions, evaluation, retries after a server
restart). Seeding each forward from (seed, part, step, micro-batch) instead makes a recomputed
micro-batch draw the same masks: a run resumed from a checkpoint, or replayed after a
reconnect, repeats the uninterrupted run exactly. The outer RNG state is restored afterwards.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager

import torch


def derive_seed(seed: int, *parts) -> int:
    text = ":".join(str(p) for p in (seed, *parts))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 63) - 1)


@contextmanager
def seeded_rng(seed: int, part: str, step: int, micro: int, device: torch.device | str = "cpu"):
    device = torch.device(device)
    devices = []
    if device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(derive_seed(seed, part, step, micro))
        yield
