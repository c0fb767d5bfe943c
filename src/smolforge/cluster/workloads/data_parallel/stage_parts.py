"""A pipeline rank on a node that lacks the job's model receives only its own stage's part of it.

Where a data-parallel job's model travels (some node holds it, `require_model` unset) and its
strategy's ranks each read only their stage (`Strategy.stage_parts`: the pipeline), a node placed
without the model never receives it whole. The cut is planned inside the ranks, after they start
(every rank's measured node, exchanged over the group), so the model travels in two steps:

1. before the round's ranks start, the runner brings each placed node that lacks the model the
   config part (`round_part`: config, generation config, tokenizer, no tensor; `model_transfer.CONFIG_PART`):
   enough for the rank to load the tokenizer, build the model on the meta device and plan the cut;
2. once the cut is planned, each rank brings its own stage's part (`PartFetch`, which the rank glue
   hands the strategy as `model_part`): the tensors its stage reads, from a node that holds the model,
   checksummed and cached under `<models>/.stages/…` as a serve stage's part is (never advertised as
   the model). The rank then reads only that part's one safetensors file.

A node that holds the whole model loads from its whole copy (the runner reports a cache hit; no part is
fetched). A rank of a later round (a re-placed stage, a new cut) fetches what its node lacks again; a
part already there is a cache hit. The rank's transfer steps are the job's `model_transfer` events,
reported through the job's control actor like its other events.
"""

from __future__ import annotations

from typing import Callable

from smolforge.cluster.workloads.model_transfer import CONFIG_PART, StagePart, bring_model
from smolforge.errors import SmolforgeError


def round_part(stage_parts: bool, world: int) -> StagePart | None:
    """What a node placed for a round of `world` ranks receives before they start when it lacks the
    job's model: the config part when the strategy's ranks read only their stages (`stage_parts`) and
    there is more than one of them (one rank runs the single strategy: the whole model), else None (the
    whole model)."""
    return CONFIG_PART if stage_parts and world > 1 else None


def fetches_part(stage_parts: bool, world: int, travels: bool, whole_here: bool) -> bool:
    """Does a rank fetch its stage's part once it has cut the model? Only where the round sent its node
    the config part instead of the model (`round_part`, the model travels) and the node has no whole
    copy of its own."""
    return round_part(stage_parts, world) is not None and travels and not whole_here


def local_model(model: str, stage_parts: bool, world: int, travels: bool) -> tuple[str, bool]:
    """(where a rank on this node loads `model` from, whether it fetches its stage's part): the node's
    whole copy; else, where the rank fetches its part (`fetches_part`), the config part the round
    brought; else the name as given (a preset or a hub id, built or read by every node)."""
    from smolforge.cluster.nodes.model_fetch import held_model_dir, held_stage_dir

    whole = held_model_dir(model)
    if whole is not None:
        return whole, False
    if fetches_part(stage_parts, world, travels, whole_here=False):
        return held_stage_dir(model, [], None) or model, True
    return model, False


class PartFetch:
    """`Strategy.model_part` for a rank on a node that lacks the model: (bounds, index) -> the local
    directory of that stage's part, brought there now (`model_transfer.bring_model` with a `StagePart`).

    `node`: (node id, name) of the rank's node. Each step is one of the job's `model_transfer` events,
    handed to `emit` (the rank's reports to the job's control actor, which the runner drains into the
    job's events). A part that could not be brought raises, so the rank fails and the job's
    FailurePolicy decides, as for a round whose model could not be sent. A pause or cancel asked
    meanwhile is not a failure: the fetch goes on, as a slow load would, and the loop stops at its first
    step, or the runner kills the rank after its grace (the fetch's actors, which the rank owns, with it)."""

    def __init__(self, model: str, node: tuple[str, str], rank: int, emit: Callable[[dict], None]):
        self.model, self.node, self.rank, self.emit = model, node, rank, emit

    def report(self, message: str, data: dict) -> None:
        self.emit({"type": "event", "kind": "model_transfer", "message": f"rank {self.rank}: {message}",
                   "data": {**data, "rank": self.rank}})

    def __call__(self, bounds: list[int], index: int) -> str:
        from smolforge.cluster.nodes import ray_glue
        from smolforge.cluster.nodes.model_fetch import held_stage_dir

        part = StagePart(tuple(bounds), index)
        moved = bring_model(self.report, self.model, [self.node], ray_glue.nodes(), lambda: False, part=part)
        if moved is not None:
            why = getattr(moved, "error", None) or getattr(moved, "reason", None) or getattr(moved, "why", "")
            raise SmolforgeError(f"{self.node[1]} could not be given {part.label()} of model {self.model}: {why}",
                                 fix=f"join a worker that holds {self.model}, or free disk space on {self.node[1]}")
        where = held_stage_dir(self.model, list(bounds), index)
        if where is None:
            raise SmolforgeError(f"{part.label()} of model {self.model} is not on {self.node[1]} after its fetch",
                                 fix="run the job again: the part is fetched anew")
        return where
