"""A data-parallel worker group: N actors placed together, started together, released together.

Placement is one placement group (strategy SPREAD), so the group is gang-scheduled: all ranks get a
node or none does, and a half-placed group never holds CPUs while waiting. Each bundle carries the
task's requirements as Ray resources (CPU, GPU, `smolforge-worker`, `model:<name>`) and a label
selector where a subset of nodes is meant. Releasing kills every actor (their processes end at
once) and removes the placement group, so CPUs return to the cluster within a second or two.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ray.exceptions import RayError

from smolforge.cluster.control.specs import DataParallelJob
from smolforge.errors import SmolforgeError
from smolforge.cluster.workloads.data_parallel.rank import DPWorker
from smolforge.parallel.rank_task import RankPlan, Seat
from smolforge.parallel.strategies import strategy_class


@dataclass
class Member:
    rank: int
    actor: Any
    info: dict = field(default_factory=dict)


class WorkerGroup:
    def __init__(self, job_id: str, attempt: int, bundles: list[tuple[dict, dict]], control: Any,
                 strategy: str = "SPREAD", first_rank: int = 0):
        self.job_id, self.attempt = job_id, attempt
        self.first_rank = first_rank  # a group of joiners to an elastic job numbers its members on from there
        self.bundles = bundles
        self.control = control
        self.strategy = strategy
        self.pg = None
        self.members: list[Member] = []

    @property
    def world(self) -> int:
        return len(self.bundles)

    def start(self, ready_timeout: float = 120.0,
              meanwhile: Callable[[list[tuple[str, str]]], None] | None = None) -> list[dict]:
        """Reserve the bundles, create one actor per bundle, return each rank's placement info.
        `meanwhile`: called with the reserved nodes (`bundle_nodes`) while the actors' processes start
        (the runner sends the model to those that lack it then: the transfer and the starts overlap)."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


        specs = [b for b, _ in self.bundles]
        selectors = [s or {} for _, s in self.bundles]
        kwargs: dict[str, Any] = {"strategy": self.strategy}
        if any(selectors):
            kwargs["bundle_label_selector"] = selectors
        self.pg = placement_group(specs, **kwargs)
        try:
            ray.get(self.pg.ready(), timeout=ready_timeout)
        except ray.exceptions.GetTimeoutError:
            self.release()
            raise SmolforgeError(f"could not place {self.world} workers within {ready_timeout:.0f} s "
                                 f"(bundles {specs})", where="placement",
                                 fix="free CPUs on the workers, join more workers, or lower --workers") from None
        actor_cls = ray.remote(DPWorker)
        for index, b in enumerate(specs):
            rank = self.first_rank + index
            res = {k: v for k, v in b.items() if k not in ("CPU", "GPU", "memory")}
            # reserved RAM (a bundle's `memory`) is an option of its own for an actor, not a custom resource
            memory = {"memory": b["memory"]} if b.get("memory") else {}
            actor = actor_cls.options(
                num_cpus=b.get("CPU", 1), num_gpus=b.get("GPU", 0), resources=res or None, **memory,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=index),
                max_restarts=0, max_task_retries=0, name=None,
            ).remote(self.job_id, self.attempt, rank, b.get("CPU", 1), self.control)
            self.members.append(Member(rank, actor))
        if meanwhile is not None:
            meanwhile(self.bundle_nodes())
        infos = ray.get([m.actor.info.remote() for m in self.members], timeout=ready_timeout)
        for m, info in zip(self.members, infos):
            m.info = info
        return infos

    def bundle_nodes(self) -> list[tuple[str, str]]:
        """(node id, name) of each reserved bundle's node, in rank order (Ray's placement group table;
        the name the node table gives it, else its id)."""
        from ray.util.placement_group import placement_group_table

        from smolforge.cluster.nodes import ray_glue

        where = placement_group_table(self.pg)["bundles_to_node_id"]
        names = {n.node_id: n.name for n in ray_glue.nodes()}
        return [(where[i], names.get(where[i], where[i])) for i in range(len(self.bundles))]

    def run(self, plan: RankPlan, resume_from: str | None, join_world: int | None = None,
            server: Any = None) -> list:
        """Start every rank on `plan`; returns one ObjectRef per rank (rank order), each a `RankResult`.

        `join_world`: these are members joining a running elastic group of that many ranks; they get
        the rendezvous from the job's control actor when the group takes them in."""
        import ray

        if join_world or server is not None:  # a joiner meets the group later; a server's workers never do
            seat = Seat(world=join_world or self.world, join=bool(join_world))
        else:
            addr, port = ray.get(self.members[0].actor.free_address.remote(), timeout=60)
            # this attempt's rendezvous keys; travel only through Ray
            seat = Seat(world=self.world, addr=addr, port=port, secret=secrets.token_hex(16))
        return [m.actor.run.remote(plan, seat, resume_from, server) for m in self.members]

    def release(self, wait_s: float = 5.0) -> None:
        """Kill every actor and free the placement group; waits (briefly) for the processes to go."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for m in self.members:
            try:
                ray.kill(m.actor, no_restart=True)
            except (RayError, ValueError):
                pass  # already gone
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except (RayError, ValueError):
                pass  # already removed
            self.pg = None
        deadline = time.time() + wait_s
        for m in self.members:
            pid = m.info.get("pid")
            while pid and time.time() < deadline and _pid_alive_local(pid, m.info):
                time.sleep(0.1)
        self.members = []


def rank_task(spec: DataParallelJob, world: int, model_travels: bool = False) -> RankPlan:
    """A round's plan for its `world` ranks: the job's validated train config with each rank's share of the
    global batch, and the spec's strategy, settings (checked at submit; here their defaults filled in) and
    timeouts; `model_travels`: the runner sends the model to placed nodes that lack it (a pipeline rank then
    fetches its stage's part)."""
    settings = strategy_class(spec.strategy).settings_dict(spec.strategy_config)
    return RankPlan(train=spec.train.model_copy(update={"batch_size": spec.global_batch // world}),
                    strategy=spec.strategy, strategy_config=settings, backend=spec.backend,
                    timeout_s=spec.dist_timeout_s, keep_last=spec.train.keep_last,
                    upload_timeout_s=spec.checkpoint_upload_timeout_s, balance=spec.balance,
                    model_travels=model_travels)


def _pid_alive_local(pid: int, info: dict) -> bool:
    """Only meaningful when the actor ran on this machine; elsewhere we trust ray.kill."""
    import os

    import ray

    try:
        if info.get("node_id") != ray.get_runtime_context().get_node_id():
            return False
    except Exception:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie waiting for its raylet parent counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
