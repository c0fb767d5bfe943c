"""What a strategy knows of its rank when it is made: one typed, frozen `RankContext`.

A strategy (`smolforge.train.strategy.Strategy`) is constructed from it and nothing sets its
attributes afterwards: the rank glue (`cluster/workloads/data_parallel/rank.py`) builds the context
from its plan and seat (the job's parameter server, the control actor's membership, where a stage's
part of the model comes from), a test builds one with its in-process stand-ins, and a run on one
process takes the default (rank 0 of 1, nothing shared).

What belongs to the *run* rather than the rank reaches the strategy as arguments of the calls that
read it, from the engine and driver that know it: the run's config (`load_model(..., run=)`: a pipeline
sizes its stages' activations from the batch), the directory state is streamed into
(`model_state` / `optimizer_state(..., spool_dir=)`) and the loss tokens of a global step
(`step_targets(..., counted=)`). A caller may then hand any built strategy to `train` (a test, a
distillation student, the rank glue), and the run's facts still have one source.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Protocol

Balance = Literal["off", "auto"]


class ParamServer(Protocol):
    """A parameter server's methods as plain calls (a `needs_server` strategy's `server`): the rank glue's
    `ServerClient` (a Ray actor behind it, every call bounded) or a test's `ServerCore` itself."""

    def setup(self, spec: dict) -> bool: ...

    def is_ready(self) -> bool: ...

    def exchange(self, member: int, wait_s: float, push: dict | None, have: int, pull_due: bool) -> dict: ...

    def pull(self, member: int, which: str) -> dict: ...

    def stop(self, code: str) -> None: ...

    def put_feedback(self, member: int, gen: int | None, table: dict, final: bool) -> None: ...

    def snapshot(self, member: int | None = None, feedback: dict | None = None) -> dict: ...


class Membership(Protocol):
    """How an elastic group re-forms (an `elastic` strategy's `membership`): the rank glue's
    `ControlMembership`, through the job's control actor."""

    def regroup(self, epoch: int | None, admit: bool = False) -> dict:
        """The next group: {"members", "host", "addr", "backend", "timeout_s", ...} (`epoch` None: a joiner)."""
        ...

    def joiners_waiting(self) -> bool: ...


@dataclass(frozen=True)
class RankContext:
    """One rank's facts, fixed for the strategy's life (`Strategy(context=...)`, `make_strategy`).

    - `world`: ranks the job's round started with (the global batch is the per-rank batch times this);
      a strategy without a live process group (a parameter server's worker, an elastic member between
      groups) counts itself among these. 1: a run alone.
    - `member`: this rank's id in the job (its first rank; a joiner's new id), 0 alone.
    - `server`: the job's parameter server (`needs_server` strategies), else None.
    - `membership`: how the group re-forms (`elastic` strategies in a group of more than one), else None.
    - `balance`: "auto": rows per rank follow measured speed (synchronous strategies); "off": equal slices.
    - `model_part`: where this node lacks the job's model and the strategy reads stage parts
      (`Strategy.stage_parts`): (bounds, stage index) -> a local model directory holding that stage's
      tensors, fetched when called (`stage_parts.PartFetch`); None: the node has the model.
    """

    world: int = 1
    member: int = 0
    server: ParamServer | None = None
    membership: Membership | None = None
    balance: Balance = "off"
    model_part: Callable[[list[int], int], str] | None = None

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.member:
            raise ValueError(f"a rank context needs world >= 1 and member >= 0 (got {self.world}, {self.member})")


ALONE = RankContext()
"""Rank 0 of 1, nothing shared: a run on one process."""
