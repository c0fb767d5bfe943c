"""How a student learns from its teacher (KDConfig), apart from the losses themselves: the CLI and
the job specs check these settings without importing torch (seconds), so a bad flag fails at once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from smolforge.errors import SmolforgeError

KDLossName = Literal["forward_kl", "reverse_kl", "jsd"]  # the KD losses, one place (`losses.bucket_divergence`)
KD_LOSSES: tuple[str, ...] = get_args(KDLossName)  # what --kd-loss takes and its help names


@dataclass
class KDConfig:
    """How the student learns from the teacher: which divergence, how soft, how much CE."""

    loss: KDLossName = "forward_kl"
    temperature: float = 1.0
    kd_ratio: float = 0.5  # weight of the KD term; 1 - kd_ratio goes to cross-entropy on the tokens
    beta: float = 0.5  # generalized JSD interpolation (0 → forward KL, 1 → reverse KL)

    def __post_init__(self) -> None:
        if self.loss not in KD_LOSSES:
            raise SmolforgeError(f"unknown KD loss {self.loss!r}", fix=f"use one of {', '.join(KD_LOSSES)}",
                                 field=("loss",))
        if not self.temperature > 0:
            raise SmolforgeError(f"temperature must be > 0, got {self.temperature}", fix="use e.g. --temperature 1.0",
                                 field=("temperature",))
        if not 0.0 <= self.kd_ratio <= 1.0:
            raise SmolforgeError(f"kd_ratio must be in [0, 1], got {self.kd_ratio}", fix="use e.g. --kd-ratio 0.5",
                                 field=("kd_ratio",))
        if not 0.0 <= self.beta <= 1.0:
            raise SmolforgeError(f"JSD beta must be in [0, 1], got {self.beta}", fix="use e.g. beta 0.5", field=("beta",))
