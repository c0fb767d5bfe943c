"""A data-parallel job's parameter server: a Ray actor around its strategy's `ServerCore`.

One per round of a job whose strategy `needs_server` (`ssp`, `sync-ps`, `async-ps`). It is placed on
the node of one of the round's ranks, so on a worker node, or on the coordinator only when the
coordinator was lent to the job (its rank is there): the coordinator's own machine is never loaded
with it otherwise. It takes no CPU reservation (it shares its node with a rank) and one torch thread.
The actor is threaded (a claim may wait, bounded, while others push), and it is not restarted by Ray:
its state lives in the job's checkpoints, so when its node dies the round fails and the job resumes
from the last checkpoint with a new server elsewhere (see `runner.py`).
"""

from __future__ import annotations

import logging
from typing import Any

from smolforge.parallel.rank_task import RankPlan
from smolforge.telemetry.tasklog import TASK_LOGGER, LineBuffer, start_capture, this_node

SERVER_CONCURRENCY = 64  # calls at once: every worker's claim, push and pull, and the runner's stats


class ServerActor:
    """Ray actor class: the strategy's server core, method by method."""

    def __init__(self, plan: RankPlan, world: int):
        """The server of `plan`'s strategy for `world` members, with the plan's settings (checked at submit)."""
        import os

        import torch

        torch.set_num_threads(1)
        # what this process prints, task `ps`, handed to the runner with each `stats` (its poll)
        self.lines = LineBuffer("ps", this_node())
        start_capture(self.lines)  # for the actor's life: its process is its own
        self.core = plan.strategy_class.Server(plan.strategy_config, world)
        logging.getLogger(TASK_LOGGER).info("parameter server (%s) for %d members on %s, pid %d", plan.strategy, world,
                                            self.lines.node, os.getpid())

    def where(self) -> dict:
        import os

        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def setup(self, spec: dict) -> bool:
        return self.core.setup(spec)

    def is_ready(self) -> bool:
        return self.core.is_ready()

    def exchange(self, member: int, wait_s: float, push: dict | None, have: int, pull_due: bool) -> dict:
        return self.core.exchange(member, wait_s, push, have, pull_due)

    def push(self, member: int, step: int, part: int, version_used: int, payload: dict, weight: float, lr: float,
             max_norm: float | None) -> dict:
        return self.core.push(member, step, part, version_used, payload, weight, lr, max_norm)

    def pull(self, member: int, which: str) -> dict:
        return self.core.pull(member, which)

    def stop(self, code: str) -> None:
        self.core.stop(code)

    def member_left(self, member: int) -> None:
        self.core.member_left(member)

    def put_feedback(self, member: int, gen: int | None, table: dict, final: bool) -> None:
        self.core.put_feedback(member, gen, table, final)

    def snapshot(self, member: int | None = None, feedback: dict | None = None) -> dict:
        return self.core.snapshot(member, feedback)

    def stats(self) -> dict:
        return {**self.core.stats(), "lines": self.lines.drain()}


def start_server(plan: RankPlan, world: int, node_id: str, timeout_s: float = 60.0) -> Any:
    """The round's server for `plan` and its `world` ranks on `node_id` (a node of one of its ranks),
    answering before it is returned."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor = ray.remote(ServerActor).options(
        num_cpus=0, max_concurrency=SERVER_CONCURRENCY, max_restarts=0, max_task_retries=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(plan, world)
    ray.get(actor.where.remote(), timeout=timeout_s)
    return actor


def server_node(infos: list[dict], coordinator_ids: set[str]) -> dict:
    """Where the server goes: the node of the highest rank not on the coordinator's machine (rank 0 writes
    the checkpoints; apart, one node's death takes only one of the two), else the coordinator's when
    only it was lent."""
    for info in sorted(infos, key=lambda i: -i["rank"]):
        if info["node_id"] not in coordinator_ids:
            return info
    return infos[-1]
