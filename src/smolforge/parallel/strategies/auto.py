"""auto: measures the ranks' links, step time and a sync's CPU work at the start of every round and runs ddp, or diloco with the int8, int4 or sparse codec, whichever keeps communication under 10 % of compute.

`auto` is a name the ranks resolve before training, never a strategy that trains: once the round's
group has met, every rank measures (every pair's Mbit/s and round trip over the group's own channel, its
step, timed on the run's own model), all gather the numbers and the pure `parallel.auto_choice.decide`
picks the strategy, codec and sync interval (`parallel/auto_probe.py`, called by the rank glue): the sparse
codec only for a run with enough outer rounds for its error feedback (`SPARSE_MIN_ROUNDS`), int8 for a
shorter one. Rank 0
states the decision and its numbers as the job's `strategy_plan` event. A regroup (a node joins or leaves)
is a new round, so it measures and decides again; a checkpoint resumes under either strategy.

Its settings (`--set strategy_config.KEY=VALUE`): `budget` (the share of compute communication may take,
default 0.10), `probe_mb` (the most a pair's timed payload sends, MB), `max_inner_steps` (diloco's H ceiling).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from smolforge.train.rank_context import RankContext
from smolforge.train.strategy import Strategy


class AutoSettings(BaseModel):
    """`strategy_config` of `auto`."""

    model_config = ConfigDict(extra="forbid")
    budget: float = Field(0.10, gt=0, le=1, description="communication's share of compute, at most")
    probe_mb: float = Field(4.0, gt=0, le=64, description="the most one pair's timed payload sends, MB")
    max_inner_steps: int = Field(500, ge=1, description="diloco's H, at most")


class Auto(Strategy):
    """auto: measures the ranks' links, step time and a sync's CPU work at the start of every round and runs ddp, or diloco with the int8, int4 or sparse codec, whichever keeps communication under 10 % of compute."""

    name = "auto"
    Settings: ClassVar[type[BaseModel] | None] = AutoSettings
    uses_process_group = True  # the ranks meet first: the probe runs over the group training will use
    elastic = False  # a join or leave regroups at a checkpoint: the new round measures and decides again

    def __init__(self, context: RankContext | None = None, **config: Any):
        raise RuntimeError("the auto strategy is resolved by the ranks before training "
                           "(smolforge.parallel.auto_probe.resolve); it never trains itself")
