"""How the students of one base share what they learn (`--students-sync`): one small plug-in per mode.

- `average` (the default): each student trains alone on its own part of the shards (the broker splits
  them) and their adapters are averaged at the end (`smolforge.distill.aggregate`).
- `ddp`: the students are ONE data-parallel group (any strategy of `smolforge.parallel.strategies`,
  DDP by default). Every rank reads every shard in the same order (`InOrderShardSource`: not a
  broker split, whose order depends on which shard is ready first) and takes its slice of each
  global step's rows, as `train_student` does for any strategy. So the group ends with ONE adapter,
  rank 0's, in `output/student_<first>/`: there is nothing to average.

The rest of the code sees only what a plug-in answers: which shards each student reads, which
students form a group (an `average` student is a group of one), how a group's members meet (the
project's own rendezvous, `smolforge.parallel.rendezvous`, as the data-parallel job kind uses), and
how a member's worker joins and leaves it.
"""

from __future__ import annotations

import secrets
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

from smolforge.distill.planner import student_assignment
from smolforge.errors import SmolforgeError, in_spec

if TYPE_CHECKING:  # (torch: imported where a student joins, not where a plan is checked)
    from smolforge.distill.shard_source import ShardSource
    from smolforge.train.strategy import Strategy

GROUP_TIMEOUT_S = 300.0  # a collective that waits longer than this for a rank fails (the group then restarts: groups.py)
START_S = 120.0  # a group's rank 0 answers within this once placed, else the group fails (its process is stuck)
# a member Ray has had no CPUs for this long: the group did not start (it waits again). Not shorter: Ray leases
# a worker only once its process runs, so a member whose CPUs are granted shows no worker while its process
# starts (7.4 s measured at load 15 for a probe's, stop 50)
UNSCHEDULED_S = 45.0
START_LOOK_S = 1.0  # between looks at a starting group's actors


def start_verdict(answered: bool, unscheduled_s: float | None, waited_s: float) -> str:
    """What a starting group's wait decides, from one look (seconds): `met` when rank 0 has answered and Ray
    has a worker for every member (`unscheduled_s` None: Ray's table shows all their CPUs); `not_started`
    when some member has had no CPUs from Ray for `unscheduled_s` >= UNSCHEDULED_S (placed where another
    job's tasks took them first: it waits again, `controller.NotStarted`); `timeout` once `waited_s` >=
    START_S; else `wait`."""
    if unscheduled_s is not None and unscheduled_s >= UNSCHEDULED_S:
        return "not_started"
    if answered and unscheduled_s is None:
        return "met"
    return "timeout" if waited_s >= START_S else "wait"


@dataclass(frozen=True)
class GroupSeat:
    """A student's seat in a data-parallel student group (`sync.DataParallelSync`): the group's strategy,
    members (task ids), world size and shards, this member's rank and device, and where the group meets
    (rank 0's address, a port it holds, the group's secret: through Ray only)."""

    sync: str
    strategy: str
    members: tuple[str, ...]
    world: int
    shards: tuple[int, ...]
    rank: int
    device: str
    addr: str | None = None
    port: int | None = None
    secret: str | None = None


class _Sync:
    """What the plug-ins share: two are equal when they are the same mode with the same strategy (a
    `StudentPlan` holds one, and plans compare by value)."""

    def _key(self) -> tuple[str, str | None]:
        return type(self).__name__, getattr(self, "strategy", None)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Sync) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        strategy = getattr(self, "strategy", None)
        return f"{type(self).__name__}({strategy!r})" if strategy else f"{type(self).__name__}()"


class AverageSync(_Sync):
    """Independent students, each on its own shards; averaged afterwards."""

    name = "average"
    merges = "averaged"  # what aggregation does with this mode's adapters (said in the run summary)

    def __init__(self, strategy: str | None = None):
        if strategy not in (None, "", "single"):
            raise SmolforgeError(f"--students-strategy {strategy} needs --students-sync ddp",
                                 fix="add --students-sync ddp, or drop --students-strategy",
                                 fields=(("students_strategy",), ("students_sync",)))

    def shards(self, num_shards: int, num_students: int, split: bool) -> list[list[int]]:
        return student_assignment(num_shards, num_students, split=split)

    def groups(self, task_ids: list[str]) -> list[list[str]]:
        return [[t] for t in task_ids]

    def group_spec(self, members: list[str], shards: list[int]) -> dict[str, Any] | None:
        return None

    @staticmethod
    @contextmanager
    def join(group: GroupSeat | None, source: ShardSource, listen=None) -> Iterator[tuple[Strategy, ShardSource]]:
        from smolforge.train.strategy import Strategy

        yield Strategy(), source


class DataParallelSync(_Sync):
    """The students of one base as one data-parallel group over the whole store."""

    name = "ddp"
    merges = "copied (one data-parallel adapter, no averaging)"

    def __init__(self, strategy: str | None = None):
        from smolforge.parallel.strategies import STRATEGIES, check_name, names_where

        with in_spec(default=("students_strategy",)):
            self.strategy = check_name(strategy or "ddp", where="--students-strategy")
        chosen = STRATEGIES[self.strategy]
        if not chosen.distill_students:
            why = ("needs a parameter server, which a distill student group does not run" if chosen.needs_server
                   else "cannot train a distill student group")
            raise SmolforgeError(f"--students-strategy {self.strategy} {why}",
                                 fix=f"use one of {', '.join(names_where(lambda s: s.distill_students))}",
                                 field=("students_strategy",))

    def shards(self, num_shards: int, num_students: int, split: bool) -> list[list[int]]:
        return [list(range(num_shards)) for _ in range(num_students)]

    def groups(self, task_ids: list[str]) -> list[list[str]]:
        return [list(task_ids)]

    def group_spec(self, members: list[str], shards: list[int]) -> dict[str, Any] | None:
        if len(members) < 2:
            return None  # one student: nothing to synchronise
        return {"sync": self.name, "strategy": self.strategy, "members": list(members), "world": len(members),
                "shards": list(shards)}

    @staticmethod
    def rendezvous(actors: list[Any]) -> dict[str, Any] | None:
        """Where the group of `actors` (rank order) meets: rank 0's address and a port it holds open, and
        this group's secret (it travels only through Ray, which takes the cluster token), once every
        member has started (`start_verdict`, looked at every START_LOOK_S: Ray's actor table says whether
        it still waits for CPUs, `ray_glue.actor_waits_for_cpus`). None: a member got no CPUs within
        UNSCHEDULED_S (the group did not start). A RayError: rank 0 failed, or did not answer in START_S."""
        import ray
        from ray.exceptions import GetTimeoutError

        from smolforge.cluster.nodes.ray_glue import actor_waits_for_cpus

        ref = actors[0].free_address.remote()
        t0 = time.monotonic()
        since: float | None = None  # since when some member has had no CPUs from Ray
        while True:
            try:
                addr, port = ray.get(ref, timeout=START_LOOK_S)
                answered = True
            except GetTimeoutError:
                answered = False
            now = time.monotonic()
            since = (since or now) if any(actor_waits_for_cpus(a) for a in actors) else None
            verdict = start_verdict(answered, now - since if since is not None else None, now - t0)
            if verdict == "met":
                return {"addr": addr, "port": port, "secret": secrets.token_hex(16)}
            if verdict == "not_started":
                return None
            if verdict == "timeout":
                raise GetTimeoutError(f"rank 0 did not answer within {START_S:.0f}s")
            if answered:  # (rank 0's answer is in hand: look again at the others in a while)
                time.sleep(START_LOOK_S)

    @staticmethod
    @contextmanager
    def join(group: GroupSeat, source: ShardSource, listen=None) -> Iterator[tuple[Strategy, ShardSource]]:
        from smolforge.distill.shard_source import InOrderShardSource
        from smolforge.parallel.rendezvous import init_group, leave_group, pick_backend
        from smolforge.parallel.strategies import make_strategy

        init_group(pick_backend("auto", group.device), group.addr, group.port, group.rank, group.world,
                   GROUP_TIMEOUT_S, group.secret, listen)
        try:
            yield make_strategy(group.strategy), InOrderShardSource(source, list(group.shards))
        finally:
            leave_group()


SYNCS = {"average": AverageSync, "ddp": DataParallelSync}


def make_sync(name: str, strategy: str | None = None) -> AverageSync | DataParallelSync:
    """The plug-in for `--students-sync NAME` (with `--students-strategy`, for ddp). Asked once per
    students stage, by its plan (`plans.plan_students`); the rest take it from the plan."""
    if name not in SYNCS:
        raise SmolforgeError(f"unknown --students-sync {name!r}", fix=f"use one of {', '.join(SYNCS)}")
    return SYNCS[name](strategy)
