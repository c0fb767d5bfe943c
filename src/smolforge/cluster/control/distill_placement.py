"""Which node a distillation's teachers and students run on: pure functions, no Ray, no clock.

A node here is anything with `node_id`, `name`, `cpus` and `gpus` (a `ray_glue.NodeInfo`, or a test's
stand-in). CPUs are counted as the run's own tasks hold them (`own_cpus`); a stage that shares the
nodes with other jobs counts what Ray holds there too (`placement.busy_cpus`). The rules:

- a student goes to the freest node that may run it, GPU nodes first, in hybrid mode never to a node
  with a running teacher; a ddp group's members start together or not at all, each picking as a lone
  student would, the CPUs it takes counted before the next one picks (`placement.pick_student_node`,
  `placement.pick_group_nodes`: the control plane's own, named here for the distill callers);
- whether a group could run at all on the live nodes, were they idle (`hosts`), decides between
  waiting for busy nodes and waiting for new ones;
- a failed teacher's shards go to another node that holds the teacher (`retry_teacher_node`), a corrupt
  shard's regeneration to the least busy one (`freest_node`), the first teachers round-robin
  (`teacher_nodes`).
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol, Sequence

from smolforge.cluster.control.placement import pick_group_nodes, pick_student_node

__all__ = ["Node", "own_cpus", "hosts", "pick_group_nodes", "pick_student_node", "teacher_nodes",
           "retry_teacher_node", "freest_node"]


class Node(Protocol):
    """What placement reads of a node."""

    node_id: str
    name: str
    cpus: float
    gpus: float


def own_cpus(held: Iterable[tuple[str | None, float]]) -> dict[str, float]:
    """CPUs held per node id, from (node id, CPUs) of every task placed and not ended; None ids skipped."""
    busy: dict[str, float] = {}
    for node_id, cpus in held:
        if node_id:
            busy[node_id] = busy.get(node_id, 0.0) + cpus
    return busy


def hosts(cpus: float, world: int, node_cpus: Iterable[float]) -> bool:
    """Whether nodes with these CPUs (all of them, as if idle) could hold `world` ranks of `cpus` each
    at once: the question that decides between waiting for busy nodes and waiting for new ones."""
    if cpus <= 0:
        return any(True for _ in node_cpus)
    return sum(int((c + 1e-9) // cpus) for c in node_cpus) >= world


def teacher_nodes(eligible: Sequence[Any], num_teachers: int) -> list[Any]:
    """The first teachers' nodes: teacher t on eligible node t mod len (eligible GPU first)."""
    return [eligible[t % len(eligible)] for t in range(num_teachers)]


def retry_teacher_node(eligible: Sequence[Any], exclude: str | None) -> Any:
    """Where a failed teacher's shards go: the first eligible node other than the one it failed on
    (that one only when it is the only one). `eligible` must not be empty."""
    return ([n for n in eligible if n.node_id != exclude] or list(eligible))[0]


def freest_node(eligible: Sequence[Any], busy: dict[str, float]) -> Any:
    """The eligible node holding the fewest busy CPUs (first in `eligible`'s order on a tie)."""
    return sorted(eligible, key=lambda n: busy.get(n.node_id, 0.0))[0]
