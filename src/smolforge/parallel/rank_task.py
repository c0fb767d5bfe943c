"""What a data-parallel rank is asked to do (`RankPlan`) and what it hands back (`RankResult`): one typed object
each way.

Why typed objects rather than a config dict and loose arguments: a job's spec is validated once, at
submit; the rank receives the `TrainConfig` that validation made (this round's batch per rank in it)
and the strategy's settings as checked there (with their defaults filled in), and never parses them
again. The plan travels whole: to every rank actor, and to the round's parameter server. Ray pickles both between
our own processes (the coordinator's runner and its rank actors), which is fine: the rule against
unpickling applies to what a network peer sends our HTTP and gRPC services. On the way back the rank
returns its `TrainResult` as is, with where and how it ran beside it, and `parallel.summary.job_summary`
derives the job's summary from those in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from smolforge.config import TrainConfig
from smolforge.parallel.strategies import strategy_class
from smolforge.train.engine import TrainResult

if TYPE_CHECKING:
    from smolforge.train.strategy import Strategy

UPLOAD_BARRIER_MARGIN_S = 60.0  # saving and packing a checkpoint, on top of its upload's own bound


@dataclass(frozen=True)
class RankPlan:
    """One round's work for every rank of a data-parallel job (the same object for each rank), made from
    the job's spec validated at submit (`worker_group.rank_task`)."""

    train: TrainConfig  # validated at submit; batch_size is this round's rows per rank
    strategy: str = "ddp"  # a name in `parallel.strategies.STRATEGIES`
    # checked at submit (`Strategy.check_settings`), its defaults filled in (`Strategy.settings_dict`)
    strategy_config: dict[str, Any] = field(default_factory=dict)
    backend: str = "auto"  # "auto" | "gloo" | "nccl" (`parallel.rendezvous.pick_backend`)
    timeout_s: float = 300.0  # a collective's timeout (a peer lost without a TCP reset)
    keep_last: int = 2  # checkpoints kept in the job's artifact store
    upload_timeout_s: float = 600.0  # rank 0's checkpoint upload to the coordinator
    balance: str = "off"  # "auto": rows per rank follow measured speed (synchronous strategies)
    # the runner sends the model to placed nodes that lack it: a rank whose strategy reads only its stage
    # (`Strategy.stage_parts`) got the config part there and fetches its stage's part once it has cut the model
    model_travels: bool = False

    @property
    def strategy_class(self) -> "type[Strategy]":
        """The plan's strategy class (`parallel.strategies.strategy_class`): its capabilities, its server."""
        return strategy_class(self.strategy)

    @property
    def collective_timeout_s(self) -> float:
        """The group's collective timeout: the other ranks wait for rank 0's checkpoint upload at the save's
        barrier, so it must outlast the upload's, or a slow link fails every round."""
        return max(self.timeout_s, self.upload_timeout_s + UPLOAD_BARRIER_MARGIN_S)


@dataclass(frozen=True)
class Seat:
    """Where one group of ranks meets: decided per round by the worker group, the same for its ranks.

    `join`: these ranks join a running elastic group of `world` ranks and get the rendezvous from the
    job's control actor when the group takes them in; ranks of a parameter-server strategy never meet
    (addr and port empty)."""

    world: int
    addr: str = ""
    port: int = 0
    secret: str = ""  # the round's rendezvous key; travels only through Ray
    join: bool = False


@dataclass(frozen=True)
class RankResult:
    """One rank's `TrainResult` and where and how it ran; `job_summary` makes the job's summary from these."""

    train: TrainResult
    rank: int
    world: int
    node_name: str | None = None
    node_id: str | None = None
    setup_s: float | None = None  # from the task's start to the group formed (staging, model, rendezvous)
    adapter_artifact: str | None = None  # rank 0: the final adapter's name in the job's artifact store
    first_step_ts: float | None = None  # wall clock of the first step's end
    cpu_step_s: float | None = None  # this process's CPU seconds per step (all threads)
    step_times: list[float] | None = None  # rank 0: every step's end (wall clock)

    @property
    def stopped(self) -> str | None:
        """"pause" | "cancel" | None: how the rank's loop ended."""
        return self.train.stopped

    @property
    def steps(self) -> int:
        return self.train.steps
