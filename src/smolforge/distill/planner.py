"""Pipeline planning: how the dataset is cut into shards, which teacher makes which shard, which
student eats which, and which nodes may run a teacher.

Kept free of Ray so the same decisions are made (and tested) in the local pipeline and on a cluster.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from smolforge.distill.backends import LOADERS, backend_names, loader, teacher_backend
from smolforge.distill.store import StorePlan
from smolforge.errors import SmolforgeError

DEFAULT_SHARD_SIZE = 64
COORDINATOR_ROLES = ("coordinator", "embedded")  # as ray_glue.Requirements(on_coordinator=True) reads a node's role


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


def pick_student_node(candidates: Iterable[tuple[float, Any]], cpus: float, teacher_node_ids: set[str],
                      hybrid: bool = False) -> Any | None:
    """The node a student starts on, from (free CPUs, node) pairs; None: queue it.

    teacher_student mode: the freest eligible node, GPU nodes first; a node whose teacher left
    room takes a student too. hybrid mode: teachers and students keep to separate nodes, so a
    node with a running teacher is never chosen (it takes a student once its teacher finishes,
    through rotation).
    """
    fits = [(f, n) for f, n in candidates if f >= cpus - 1e-9]
    if hybrid:
        fits = [(f, n) for f, n in fits if n.node_id not in teacher_node_ids]
    if not fits:
        return None
    fits.sort(key=lambda fn: (-(fn[1].gpus >= 1), -fn[0], fn[1].name))
    return fits[0][1]


def model_key(name: str) -> str:
    """Model names as nodes advertise them: lower case, no ':latest', path separators folded."""
    key = name.strip().lower()
    if key.endswith(":latest"):
        key = key[: -len(":latest")]
    return key.replace("/", "--")


def holds(node: Any, model: str, backend: str = "hf") -> bool:
    """Whether a node can load `model` with the loader `backend` (`hf`: its `.models`, `ollama`: its
    `.ollama_models`: `backends.Loader.node_attr`), under any spelling or its dir name."""
    keys = {model_key(m) for m in _loadable_list(node, backend)}
    return model_key(model) in keys or model_key(model.rstrip("/").split("/")[-1]) in keys


def _loadable_list(node: Any, backend: str) -> list[str]:
    return list(getattr(node, loader(backend).node_attr, None) or [])


def _loadable(node: Any, backend: str) -> str:
    names = _loadable_list(node, backend)
    text = ", ".join(names) or loader(backend).none_held
    for other in LOADERS.values():
        held = _loadable_list(node, other.name) if other.name != loader(backend).name else []
        if held:
            text += f" [{other.label}: {', '.join(held)}]"
    return text


TEACHER_BACKENDS = backend_names()  # what --teacher-backend takes: the classes in `distill/backends.py`


def model_backend(backend: str) -> str:
    """How a task loads its model (a `backends.Loader` name): the teacher backend's loader (`ollama` for
    an Ollama teacher), `hf` (the weights) for students and every other teacher (`llamacpp` exports the
    weights on its node)."""
    return teacher_backend(backend).loader.name


def model_nodes(nodes: Iterable[Any], model: str, role: str = "teacher", any_node_ok: bool = False,
                backend: str = "hf", on_coordinator: bool = False) -> tuple[list[Any], str | None]:
    """Nodes that may run a task needing `model`, GPU nodes first; and the model resource to request.

    `nodes` are ray_glue NodeInfo-like objects (.name, .alive, .takes_work, .role, .models,
    .ollama_models, .gpus, .cpus, .resources). Nodes that can load the model with `backend` win: `hf`
    reads a node's `models` (weights it holds), `ollama` its `ollama_models`, so a node that has a
    model only as an Ollama tag never gets an `hf` task (which would download it from the hub). When
    none can and `any_node_ok` (a preset, built offline from config anywhere, or a local directory on
    a one-machine cluster), every worker node qualifies. Otherwise this raises at once, naming what
    each node holds: Ray alone would leave the task pending forever. `on_coordinator`: the
    coordinator node (the one-machine cluster's own node) is the only candidate, not the workers:
    the user lent it to this role.
    """
    nodes = list(nodes)
    workers = [n for n in nodes if n.alive and (n.role in COORDINATOR_ROLES if on_coordinator else n.takes_work)]
    holding = [n for n in workers if holds(n, model, backend)]
    req_model = None
    if holding:
        exact = [n for n in holding if f"{loader(backend).resource_prefix}{model}" in n.resources]
        req_model = model if len(exact) == len(holding) else None
        chosen = holding
    elif any_node_ok and workers:
        chosen = workers
    else:
        have = "; ".join(f"{n.name}: {_loadable(n, backend)}{'' if n.alive else ' (dead)'}" for n in nodes) or "no nodes"
        if on_coordinator:
            raise SmolforgeError(f"the coordinator node does not hold {role} model {model!r} ({have})",
                                 where="--teacher-on-coordinator",
                                 fix=f"put {model} in the coordinator's HF cache or models dir, or drop "
                                     "--teacher-on-coordinator to run the teachers on workers")
        how = loader(backend)
        raise SmolforgeError(f"no node holds {role} model {model!r} {how.how} ({have})", where="placement",
                             fix=how.missing_fix(model, role))
    return sorted(chosen, key=lambda n: (-(n.gpus >= 1), -n.gpus, -n.cpus, n.name)), req_model
