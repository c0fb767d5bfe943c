"""The export targets, one place: `smolforge export --to`, the `export` job kind's `to`, and the
`--export` of train, launch and distill (the targets a finished run may export to) all read them here;
so do `--quant` and the job's `quant` (the GGUF weight types, `QUANTS`).

Apart from run.py, which writes them, because the CLI builds its help and checks its flags from this
at start: no imports beyond the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Target:
    """One export format and what it promises."""

    name: str
    # a GGUF that llama.cpp runs and `verify.py` compares with the model: what a run's `--export`
    # promises (an HF directory is the merged weights as they are, checked by nothing)
    verified: bool


TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("hf", verified=False),
    Target("gguf", verified=True),
    Target("ollama", verified=True),
)}
RUN_TARGETS: tuple[str, ...] = tuple(name for name, target in TARGETS.items() if target.verified)

# the job spec's `to`: pydantic checks it and names the choices
ExportTarget = Literal[tuple(TARGETS)]  # type: ignore[valid-type]

# GGUF weight types (`--quant`, for gguf and ollama), written by gguf.py, each with its verify.py limits
# f32: no rounding at all (4 bytes a weight), the export to compare against a reference exactly
QUANTS: tuple[str, ...] = ("f16", "bf16", "q8_0", "f32")
QuantName = Literal[QUANTS]  # type: ignore[valid-type]  # the job spec's `quant`
