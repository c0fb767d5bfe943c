"""The coordinator's gate: moved to `smolforge/gate.py` (serve uses it too); re-exported here so
existing imports keep working."""

from __future__ import annotations

from smolforge.gate import TOKEN_FIX, Gate, coordinator_error_body

__all__ = ["TOKEN_FIX", "Gate", "coordinator_error_body"]
