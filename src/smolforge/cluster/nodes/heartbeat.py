"""A node agent's heartbeat as the coordinator accepts it.

A heartbeat is input from the network that /metrics and the dashboard render, so it is checked
against this schema before it is kept (a string where a number belongs once broke /metrics).
Unknown keys are dropped: a newer agent may report more. Strict types (no `false` for a number)
and no NaN or infinity (Python's JSON parser takes `NaN`; the answers that carry the value back
could not encode it). Only a node that joined (Ray lists it alive) has its heartbeat kept, and
each is bounded here (`MAX_GPUS` entries, numbers only: unknown keys, strings among them, are dropped),
so what the coordinator keeps per node, and the number of nodes, are bounded (`NodeMonitor.heartbeat`).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

MAX_GPUS = 64  # per node: a DGX has 8 or 16; the schema once took 1,024, ~600 KB kept per heartbeat


class GpuUsage(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False)

    index: int = Field(ge=0, lt=MAX_GPUS)
    util_percent: float = Field(ge=0, le=100)
    mem_used_gb: float = Field(ge=0)
    mem_total_gb: float = Field(ge=0)


class Heartbeat(BaseModel):
    """What a node agent reports (`sample_usage` plus when and who), checked before it is kept: a
    heartbeat is input from the network, and /metrics and the dashboard render it."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    ts: float = Field(ge=0)
    pid: int | None = Field(None, ge=0, le=2**31)
    cpu_percent: float | None = Field(None, ge=0, le=100)
    ram_used_gb: float | None = Field(None, ge=0)
    ram_total_gb: float | None = Field(None, ge=0)
    ram_percent: float | None = Field(None, ge=0, le=100)
    load_1m: float | None = Field(None, ge=0)
    gpus: list[GpuUsage] = Field(default_factory=list, max_length=MAX_GPUS)
