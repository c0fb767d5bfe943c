"""Pipeline planning: how the dataset is cut into shards, which teacher makes which shard, which
student eats which, and which nodes may run a teacher.

Kept free of Ray so the same decisions are made (and tested) in the local pipeline and on a cluster.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from smolforge.distill.store import StorePlan
from smolforge.errors import SmolforgeError

DEFAULT_SHARD_SIZE = 64


def plan_shards(num_items: int, *, num_shards: int | None = None, shard_size: int | None = None,
                min_shards: int = 1, teacher: str = "", dataset: str = "", tokenizer_hash: str = "",
                vocab_size: int = 0, k: int = 0, samples_per_prompt: int = 1) -> StorePlan:
    """Cut `num_items` prompts into contiguous [start, end) shards of near-equal size.

    Small shards let students start sooner; `min_shards` (e.g. 2 per teacher) keeps every teacher
    busy and lets the first shard land early.
    """
    if num_items < 1:
        raise SmolforgeError("the dataset has no prompts to shard", fix="check --data")
    if num_shards is None:
        size = shard_size or DEFAULT_SHARD_SIZE
        num_shards = max(min_shards, math.ceil(num_items / size))
    num_shards = max(1, min(num_shards, num_items))
    bounds = [round(i * num_items / num_shards) for i in range(num_shards + 1)]
    shards = [[bounds[i], bounds[i + 1]] for i in range(num_shards)]
    return StorePlan(num_shards=num_shards, num_examples=num_items, shard_size=math.ceil(num_items / num_shards),
                     teacher=teacher, dataset=dataset, tokenizer_hash=tokenizer_hash, vocab_size=vocab_size, k=k,
                     shards=shards, samples_per_prompt=samples_per_prompt)


def teacher_assignment(num_shards: int, num_teachers: int) -> list[list[int]]:
    """Interleaved: teacher t makes shards t, t+T, … so the first T shards are produced first, together."""
    num_teachers = max(1, min(num_teachers, num_shards))
    return [list(range(t, num_shards, num_teachers)) for t in range(num_teachers)]


def student_assignment(num_shards: int, num_students: int, split: bool = True) -> list[list[int]]:
    """Which shards each student trains on.

    split=True (hybrid / data-parallel students): disjoint, interleaved, so every student has a
    shard as soon as the first round of teachers is done and no two students share a shard.
    split=False (ensemble): every student sees every shard.
    """
    if num_students < 1:
        raise SmolforgeError("num_students must be ≥ 1", fix="pass --num-students 1 or more")
    if not split:
        return [list(range(num_shards)) for _ in range(num_students)]
    if num_students > num_shards:
        raise SmolforgeError(f"{num_students} students cannot split {num_shards} shards without sharing",
                             fix="use fewer students, or more (smaller) shards")
    return [list(range(s, num_shards, num_students)) for s in range(num_students)]


@dataclass
class NodeView:
    """What placement needs to know about a node (built from the cluster's node table)."""

    node_id: str
    name: str
    models: set[str] = field(default_factory=set)
    gpus: float = 0.0
    cpus: float = 0.0
    alive: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def holds(self, model: str) -> bool:
        return model_key(model) in {model_key(m) for m in self.models}


def model_key(name: str) -> str:
    """Model names as nodes advertise them: lower case, no ':latest', path separators folded."""
    key = name.strip().lower()
    if key.endswith(":latest"):
        key = key[: -len(":latest")]
    return key.replace("/", "--")


def eligible_teacher_nodes(nodes: Iterable[NodeView], model: str, prefer_gpu: bool = True) -> list[NodeView]:
    """Alive nodes that hold the teacher model, GPU nodes first (then most CPUs).

    Raises at once when none holds it: Ray alone would leave the task pending forever.
    """
    nodes = list(nodes)
    ok = [n for n in nodes if n.alive and n.holds(model)]
    if not ok:
        have = "; ".join(f"{n.name}: {', '.join(sorted(n.models)) or 'no models'}{'' if n.alive else ' (dead)'}"
                         for n in nodes) or "no nodes"
        raise SmolforgeError(
            f"no node holds teacher model {model!r} ({have})",
            fix=f"download {model} on a worker (or pass --models-dir to `smolforge worker join`), or pick a "
                "teacher that a node lists under `smolforge nodes`")
    ok.sort(key=lambda n: (-(n.gpus > 0) if prefer_gpu else 0, -n.gpus, -n.cpus, n.name))
    return ok
