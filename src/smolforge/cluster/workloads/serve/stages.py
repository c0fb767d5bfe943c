"""Serving a model cut into stages on the cluster: one Ray actor per stage, on nodes that hold the model.

Each `StageActor` wraps a `serve.stages.StageServer`: it loads the node's own copy of the
model (`SMOLFORGE_MODEL_PATHS`, as training ranks do) and reads only its stage's tensors, the adapter
merged into each (its files travel through Ray, no shared filesystem; `models/stage_load.py`), and uses
as many torch threads as it reserved CPUs.
Activations cross between actors as numpy arrays; nothing of ours pickles tensors.

`StageGroup` plans where the stages go (`plan()`: every candidate node probed where a stage would
run, then `cluster.control.stage_plan.plan_serving`; every node choice here is a pure function of
`cluster.control.stage_plan`), places the actors (node affinity, hard: a stage never lands on a node
without the model) and hands out a `StagedModel` whose stage handles are `RemoteStage`s. Every call is a
`ray.get` bounded by a timeout. When an actor dies (its process or node went away) or does not
answer in time, the call raises a `StageError`: the engine turns that into an error event for the
requests of that batch only. The handle is then marked broken, and before the next batch
(`StagedModel.new_cache` calls `ready()`) it is placed again on a live node that holds the model.
Ray does not restart the actors itself (`max_restarts=0`): a stage's KV caches die with it, so a
silent restart would only turn the failure into wrong tokens.

A stage runs one step at a time (`max_concurrency=1`), but answers `info` and `report` in a concurrency
group of its own (`STATUS_GROUP`), beside a running forward: `/metrics` (`RemoteStage.status`) waits for a
stage at most `SCRAPE_TIMEOUT_S`, and a stage that does not answer by then is reported not up, never marked
broken nor killed (a monitoring read must not take a serving stage down: only the step path decides that).

A model only some nodes hold travels (`placement.model_travels`): every worker is then a candidate,
and before a stage starts on a node that lacks the model, that node receives only the stage's part
(its tensors, the config and tokenizer: `model_transfer.StagePart`), kept under its models dir where
`held_stage_dir` finds it and its inventory does not (a part is never advertised as the model). The
plan event says what each such transfer is estimated to take; a re-placed stage prefers a holder.
"""

from __future__ import annotations

import logging
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from smolforge.cluster.nodes import ray_glue
from smolforge.cluster.control.placement import transfer_note
from smolforge.cluster.control.stage_plan import (
    holds_whole, probe_plan, stage_candidates, stage_model_resources, stage_node, with_room,
)
from smolforge.errors import SmolforgeError
from smolforge.serve.stages import StagedModel, StageError
from smolforge.telemetry.tasklog import LineBuffer, start_capture, this_node
from smolforge.train.faults import fault_setting, hold_while

if TYPE_CHECKING:
    from smolforge.models.stage_costs import Plan

log = logging.getLogger(__name__)

# Stages' parts sent at once when a group starts (`StageGroup._bring_parts`): each send writes its part on
# the holder (the part's tensors in memory while written: the model's bytes at most, all parts together).
SENDS_AT_ONCE = 4
# A scrape's wait for one stage's counters (`RemoteStage.status`): below Prometheus' default scrape timeout (10 s).
SCRAPE_TIMEOUT_S = 5.0
# The stage actor's concurrency group for what reads its state (`info`, `report`): answered while a step runs.
STATUS_GROUP = "status"
GROUP_OF = {"info": STATUS_GROUP, "report": STATUS_GROUP}  # a method not named: the default group (one step at a time)


def on_actor(actor: Any, method: str, *args: Any) -> Any:
    """`actor.<method>.remote(*args)` in the method's concurrency group (`GROUP_OF`): the object ref."""
    return getattr(actor, method).options(concurrency_group=GROUP_OF.get(method)).remote(*args)


def read_dir(path: str | Path) -> dict[str, bytes]:
    """A small directory (adapter, tokenizer) as {relative name: bytes}, to send through Ray."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise SmolforgeError(f"directory {root} does not exist",
                             fix="point --adapter at a <method>_adapter/ directory written by `smolforge train`")
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def write_dir(files: dict[str, bytes], root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        dst = (root / name).resolve()
        if root.resolve() not in dst.parents:
            raise SmolforgeError(f"refusing to write {name!r} outside {root}")
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(data)
    return root


class StageActor:
    """Ray actor class: one stage of a model and its batches' KV caches (`StageServer`), method by method."""

    def __init__(self, model: str, bounds: list[int], index: int, adapter_files: dict[str, bytes] | None,
                 num_cpus: float, device: str = "cpu", dtype: str = "fp32"):
        import torch

        from smolforge.cluster.nodes.model_fetch import held_stage_dir
        from smolforge.serve.stages import StageServer

        # what this process prints, task `stage<i>`: the API actor collects it with its status
        self.lines = LineBuffer(f"stage{index}", this_node())
        start_capture(self.lines)  # for the actor's life: its process is its own
        torch.set_num_threads(max(1, int(num_cpus)))
        # fault injection for tests (train/faults.py `hold-stage`): read here; only a stage armed now reads it again
        self.hold_fault = fault_setting("hold-stage").split()[:1] == [str(index)]
        self.index = index
        # the node's whole copy, else the part fetched for this stage (a model that travels), else the name
        self.model = held_stage_dir(model, list(bounds), index) or model
        # The adapter's files are needed only while loading: the actor is killed, never closed, so
        # nothing it keeps on disk would be removed.
        with tempfile.TemporaryDirectory(prefix="sf-stage-") as tmp:
            adapter = str(write_dir(adapter_files, Path(tmp) / "adapter")) if adapter_files else None
            self.server = StageServer.load(self.model, bounds, index, adapter=adapter, device=device, dtype=dtype)
        self.server.name = model
        log.info("stage %d: layers %d-%d of %s loaded on %s", index, bounds[index], bounds[index + 1], model,
                 self.lines.node)

    def _held(self, method: str) -> None:
        """Fault `hold-stage` "<index> <method>" (armed at start): wait while it names this call."""
        if self.hold_fault:
            hold_while("hold-stage", f"{self.index} {method}", f"stage {self.index} {method}")

    def forward(self, batch_id, x, attention_mask, position_ids, start=False, keep=1, resume=None, forget=()):
        self._held("forward")
        return self.server.forward(batch_id, x, attention_mask, position_ids, start, keep, resume, forget)

    def hold(self, batch_id: str, row: int, length: int, snapshot_id: str, forget: list[str]) -> int:
        return self.server.hold(batch_id, row, length, snapshot_id, forget)

    def select(self, batch_id: str, rows: list[int], trim: int) -> bool:
        return self.server.select(batch_id, rows, trim)

    def join(self, batch_id: str, other_id: str, pad: int, other_pad: int) -> None:
        self.server.join(batch_id, other_id, pad, other_pad)

    def drop(self, batch_id: str) -> None:
        self.server.drop(batch_id)

    def info(self) -> dict[str, Any]:
        """`StageServer.info` and where it runs; in `STATUS_GROUP` (`on_actor`): answered while a step runs."""
        import ray

        from smolforge.telemetry.memory import memory_limit_bytes

        limit = memory_limit_bytes()
        return {**self.server.info(), "node_id": ray.get_runtime_context().get_node_id(),
                "memory_limit_mb": None if limit is None else round(limit / 1e6, 1)}

    def report(self) -> dict[str, Any]:
        """What it printed since the last report, and its peak RSS so far (KV caches grow it after loading);
        in `STATUS_GROUP`, as `info`."""
        from smolforge.telemetry.memory import peak_rss_mb

        self._held("report")
        return {"lines": self.lines.drain(), "peak_rss_mb": round(peak_rss_mb(), 1)}

    def tokenizer_files(self) -> dict[str, bytes]:
        """The model's tokenizer as files: the server loads it without holding the model itself."""
        from transformers import AutoConfig

        from smolforge.models.loading import load_tokenizer, resolve_model

        with tempfile.TemporaryDirectory(prefix="sf-tok-") as tmp:
            load_tokenizer(self.model).save_pretrained(tmp)
            AutoConfig.from_pretrained(resolve_model(self.model)).save_pretrained(tmp)  # the loader wants one
            return read_dir(tmp)


def probe_node(model: str, name: str, cpus: float, device: str, with_model: bool,
               dtype: str = "fp32") -> dict[str, Any]:
    """Run as a Ray task on a node: what placement needs of it (matmul FLOP/s with the threads a stage
    would have, free memory: `stage_costs.measure_node`) and, from one node, the model's sizes and costs
    (`stage_costs.model_info`, from its config on the meta device: nothing loaded), in the dtype the
    stages will load (`--dtype`, resolved as the stages resolve it), not the checkpoint's. Plain dicts
    go back."""
    import dataclasses

    import torch
    from transformers import AutoConfig

    from smolforge.cluster.workloads.data_parallel.rank import local_model_path
    from smolforge.models.dtypes import pick_dtype
    from smolforge.models.loading import pick_device, resolve_model
    from smolforge.models.stage_costs import measure_node, model_info

    torch.set_num_threads(max(1, int(cpus)))
    node = measure_node(name, torch.device(device) if device == "cuda" else None)
    info = None
    if with_model:
        resolved = resolve_model(local_model_path(model))
        held = pick_dtype(dtype, resolved, pick_device(device))
        info = dataclasses.asdict(model_info(AutoConfig.from_pretrained(resolved), held))
    return {"node": dataclasses.asdict(node), "model": info}


def _dead(err: BaseException) -> bool:
    import ray.exceptions as rex

    return isinstance(err, (rex.RayActorError, rex.ActorDiedError, rex.ActorUnavailableError, rex.NodeDiedError,
                            rex.WorkerCrashedError, rex.GetTimeoutError, rex.ActorUnschedulableError))


class RemoteStage:
    """A stage handle for `StagedModel`: every call a bounded `ray.get` on the stage's actor."""

    def __init__(self, group: "StageGroup", index: int):
        self.group, self.index = group, index
        self.actor: Any = None
        self.where: dict[str, Any] = {}
        self.broken = True  # not placed yet
        self.replacements = 0
        self.pending: str | None = None  # the node id its actor is starting on (launched, not yet answered)
        self.asked: tuple[Any, Any] | None = None  # (actor, ref) of a `status` read not answered in time yet

    def ready(self) -> None:
        """Before a batch: a stage whose actor died is placed again (on a live node with the model)."""
        if self.broken:
            self.group.place(self)

    def _call(self, method: str, *args, timeout: float):
        import ray

        if self.broken or self.actor is None:
            raise StageError(f"stage {self.index} is not running", fix="it is placed again before the next batch")
        try:
            return ray.get(on_actor(self.actor, method, *args), timeout=timeout)
        except Exception as err:
            if not _dead(err):
                raise  # an error inside the stage (e.g. an unknown batch): the actor is fine
            self.broken = True
            self.group.kill(self)
            what = "did not answer within %.0f s" % timeout if "Timeout" in type(err).__name__ else "died"
            raise StageError(f"stage {self.index} on {self.where.get('node', '?')} {what} ({type(err).__name__})",
                             fix="the stage is placed again on a live node before the next batch") from None

    @property
    def uid(self) -> str | None:
        """The stage server answering now (`StageServer.uid`, from its actor's `info`); None while none is."""
        return None if self.broken else self.where.get("uid")

    def forward(self, batch_id, x, attention_mask, position_ids, start=False, keep=1, resume=None, forget=()):
        return self._call("forward", batch_id, x, attention_mask, position_ids, start, keep, resume, list(forget),
                          timeout=self.group.step_timeout_s)

    def hold(self, batch_id: str, row: int, length: int, snapshot_id: str, forget=()) -> int:
        return self._call("hold", batch_id, row, length, snapshot_id, list(forget), timeout=self.group.step_timeout_s)

    def select(self, batch_id: str, rows: list[int], trim: int) -> bool:
        return self._call("select", batch_id, rows, trim, timeout=self.group.step_timeout_s)

    def join(self, batch_id: str, other_id: str, pad: int, other_pad: int) -> None:
        self._call("join", batch_id, other_id, pad, other_pad, timeout=self.group.step_timeout_s)

    def drop(self, batch_id: str) -> None:
        if not self.broken:
            self._call("drop", batch_id, timeout=min(10.0, self.group.step_timeout_s))

    def info(self) -> dict[str, Any]:
        return self._call("info", timeout=self.group.step_timeout_s)

    def status(self) -> dict[str, Any] | None:
        """The monitoring read (`/metrics`): the actor's `info` (in its status group, so a running step does
        not delay it), waited for at most `group.scrape_timeout_s`; None when the stage is not running or
        did not answer by then. It never marks the stage broken nor kills it: the step path alone decides
        that. A read not answered in time is waited on again by the next one, not asked twice."""
        import ray
        import ray.exceptions as rex

        actor = self.actor
        if self.broken or actor is None:
            return None
        asked = self.asked if self.asked is not None and self.asked[0] is actor else (actor, on_actor(actor, "info"))
        self.asked = asked
        try:
            info = ray.get(asked[1], timeout=self.group.scrape_timeout_s)
        except rex.GetTimeoutError:
            return None  # still asked: the next read waits for the same answer
        except Exception:  # noqa: BLE001  a stage that died: the step path finds it and re-places it
            info = None
        if self.asked is asked:
            self.asked = None
        return info


class StageGroup:
    """The stage actors of one served model: placed, re-placed when one dies, killed together."""

    def __init__(self, model: str, stages: int | None, *, adapter: str | None = None, bounds: Sequence[int] | None = None,
                 cpus_per_stage: float = 1.0, device: str = "cpu", dtype: str = "fp32", step_timeout_s: float = 120.0,
                 load_timeout_s: float = 300.0, embedded: bool = False, name: str | None = None,
                 allowed: Sequence[str] | None = None):
        self.model, self.name = model, name or model
        self.allowed = set(allowed) if allowed else None  # the job's stage_nodes: only these nodes run stages
        self.count = None if stages is None else int(stages)  # None: the planner chooses (--stages auto)
        self.adapter_files = read_dir(adapter) if adapter else None
        self.bounds = list(bounds) if bounds else None
        self.cpus, self.device, self.dtype = float(cpus_per_stage), device, dtype
        self.step_timeout_s, self.load_timeout_s = float(step_timeout_s), float(load_timeout_s)
        self.scrape_timeout_s = SCRAPE_TIMEOUT_S  # a `/metrics` read's wait per stage (`RemoteStage.status`)
        self.embedded = embedded
        self.handles = [RemoteStage(self, i) for i in range(self.count or 0)]
        self.targets: list[str] = []  # the node id the plan chose for each stage
        self.model_bytes = 0.0  # the stages' weights, as the plan sized them
        self._lock = threading.Lock()
        self.events: list[dict[str, Any]] = []  # placements ({message, data}), for the job's events
        self._line_calls: dict[int, Any] = {}  # stage index -> its pending `report` call

    # -- placement --------------------------------------------------------------------------------

    def candidates(self) -> list[ray_glue.NodeInfo]:
        """The live nodes that may run a stage now (`stage_plan.stage_candidates`): those that hold the
        model, workers before the coordinator's own machine; when the model travels, every live worker
        too, a stage's part then sent to it before the stage starts (`place`)."""
        return stage_candidates(self.model, ray_glue.nodes(), self.embedded, self.allowed)

    def _pick(self, handle: RemoteStage, cands: list[ray_glue.NodeInfo], planned: str | None) -> ray_glue.NodeInfo:
        """Where `handle` (re)starts (`stage_plan.stage_node`), counting the other running stages' nodes."""
        used: dict[str, int] = {}
        for h in self.handles:
            at = h.pending or (h.where.get("node_id") if not h.broken else None)  # started there, or starting
            if h is not handle and at:
                used[at] = used.get(at, 0) + 1
        return stage_node(cands, self.cpus, self.model, self.model_bytes, used, planned)

    def plan(self) -> Plan:
        """Layer ranges and a node per stage (`stage_plan.plan_serving`) from every candidate node's
        measured throughput and free memory, probed where a stage would run; the plan and its reason
        become a job event."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from smolforge.cluster.control.stage_plan import ModelInfo, NodeCapacity, plan_serving

        nodes = self.candidates()
        free = with_room(nodes, self.cpus)
        probed, source, names = probe_plan(self.model, nodes, ray_glue.nodes(), self.cpus, self.embedded)
        refs = [ray.remote(probe_node).options(
            num_cpus=0, max_retries=0, resources=self._model_resources(n),
            scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False),
        ).remote(self.model, names[n.node_id], self.cpus, self.device, i == source, self.dtype)
            for i, n in enumerate(probed)]
        probes = ray.get(refs, timeout=self.load_timeout_s)
        info = ModelInfo(**{k: tuple(v) if isinstance(v, list) else v for k, v in probes[source]["model"].items()})
        measured = [NodeCapacity(**p["node"]) for p in probes[:len(free)]]  # the candidates only
        by_name = {names[n.node_id]: n for n in free}
        plan, hosts = plan_serving(info, measured, self.count)
        self.bounds = list(plan.bounds)
        self.targets = [by_name[name].node_id for name in hosts]
        self.handles = [RemoteStage(self, i) for i in range(plan.num_stages)]
        self.model_bytes = float(sum(plan.stage_bytes))
        # the time to send each stage on a node that lacks the model its part, at that node's measured link
        links = {names[n.node_id]: m.link_bytes_per_s for n, m in zip(free, measured)}
        note, transfer_s = transfer_note([(by_name[name].name, plan.stage_bytes[i], links.get(name))
                                          for i, name in enumerate(hosts) if not self._holds(by_name[name])])
        message = plan.describe() + (f"\n  {note}" if note else "")
        self.events.append({"kind": "plan", "message": message,
                            "data": {"bounds": plan.bounds, "nodes": [by_name[n].name for n in hosts],
                                     "per_token_s": plan.per_token_s, "kept_on_one_node": plan.kept_on_one_node,
                                     "stages_asked": self.count or "auto", "transfer_s": transfer_s}})
        log.info("%s", message)
        return plan

    def _holds(self, node: ray_glue.NodeInfo) -> bool:
        """Can `node` load the whole model itself (`stage_plan.holds_whole`)?"""
        return holds_whole(self.model, node, self.embedded)

    def _model_resources(self, node: ray_glue.NodeInfo) -> dict[str, float] | None:
        """The model resource a task on `node` asks for (`stage_plan.stage_model_resources`)."""
        return stage_model_resources(self.model, node, self.embedded)

    def _bring_part(self, handle: RemoteStage, node: ray_glue.NodeInfo) -> None:
        """The part of the model stage `handle` loads, sent to `node` when it lacks the model
        (`model_transfer.bring_model`, each step a `model_transfer` event of the job); raises with the
        reason when it could not be (the stages then fail to start: an attempt of the job)."""
        from smolforge.cluster.workloads.model_transfer import StagePart, bring_model

        if self._holds(node):
            return
        part = StagePart(tuple(self.bounds or ()), handle.index)
        report = lambda message, data: self.events.append(  # noqa: E731
            {"kind": "model_transfer", "message": message, "data": data})
        moved = bring_model(report, self.model, [(node.node_id, node.name)], ray_glue.nodes(),
                            stopping=lambda: False, part=part)
        if moved is not None:
            why = getattr(moved, "error", None) or getattr(moved, "reason", None) or getattr(moved, "why", "")
            raise StageError(f"stage {handle.index} could not be given its part of {self.model} on {node.name}: "
                             f"{why}", fix=f"join a worker that holds {self.model}, or free disk space on {node.name}")

    def _bring_parts(self, picked: list[tuple[RemoteStage, ray_glue.NodeInfo]]) -> None:
        """Every picked stage's part sent to its node at once (`_bring_part` each, in threads, at most
        SENDS_AT_ONCE at a time; a node holding the model is skipped): a start waits for the slowest send,
        not for their sum. Raises the first stage's StageError (or other error) once every send ended."""
        from concurrent.futures import ThreadPoolExecutor

        todo = [(h, node) for h, node in picked if not self._holds(node)]
        if not todo:
            return
        with ThreadPoolExecutor(max_workers=min(SENDS_AT_ONCE, len(todo)), thread_name_prefix="sf-stage-part") as pool:
            sends = [pool.submit(self._bring_part, h, node) for h, node in todo]
        for send in sends:
            send.result()

    def _pick_all(self) -> list[tuple[RemoteStage, ray_glue.NodeInfo]]:
        """Under the group's lock: a node for every stage (`_pick`, the plan's where it is a candidate),
        each marked `pending` there so the next pick counts it."""
        with self._lock:
            cands, picked = self.candidates(), []
            for h in self.handles:
                node = self._pick(h, cands, self._planned(h))
                h.pending = node.node_id
                picked.append((h, node))
            return picked

    def _planned(self, handle: RemoteStage) -> str | None:
        """The plan's node for a stage that has not run yet (`targets`), else None (a re-placement
        picks anew)."""
        return self.targets[handle.index] if not handle.where and handle.index < len(self.targets) else None

    def place(self, handle: RemoteStage) -> None:
        """A new actor for this stage on a live node that holds the model, answering before it returns."""
        self._settle(handle, *self._launch(handle))

    def _launch(self, handle: RemoteStage, before: Callable[[ray_glue.NodeInfo], None] | None = None,
                picked: ray_glue.NodeInfo | None = None) -> tuple[Any, ray_glue.NodeInfo]:
        """Under the group's lock: the old actor killed, a node picked (counting the stages being started
        elsewhere: `handle.pending`), `before(node)` called (`start`: a stage still starting there answers
        first), the part sent to it, the new actor created; not waited for. `picked`: the node `start`
        chose and sent the part to already (`_pick_all`, `_bring_parts`)."""
        with self._lock:
            self.kill(handle)
            node = picked
            if node is None:
                node = self._pick(handle, self.candidates(), self._planned(handle))
            if before is not None:
                before(node)
            if picked is None:
                self._bring_part(handle, node)
            actor = self._create(handle, node)
            handle.pending = node.node_id
            self.events.append({"kind": "stage_start", "message": f"stage {handle.index} starting on {node.name}",
                                "data": {"stage": handle.index, "node": node.name}})
            return actor, node

    def _create(self, handle: RemoteStage, node: ray_glue.NodeInfo) -> Any:
        """The stage's actor, created on `node` (hard affinity; not waited for)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # steps one at a time (default group); `info`/`report` in their own group, beside a step (`GROUP_OF`)
        return ray.remote(concurrency_groups={STATUS_GROUP: 1})(StageActor).options(
            num_cpus=self.cpus, resources=self._model_resources(node), max_restarts=0, max_task_retries=0,
            max_concurrency=1, scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
        ).remote(self.model, self.bounds, handle.index, self.adapter_files, self.cpus, self.device, self.dtype)

    def _settle(self, handle: RemoteStage, actor: Any, node: ray_glue.NodeInfo) -> None:
        """Wait (`load_timeout_s`) for a launched actor's answer; the stage is then running there (an event of
        the job), or the actor is killed and StageError says why."""
        import ray

        try:
            info = ray.get(on_actor(actor, "info"), timeout=self.load_timeout_s)
        except Exception as err:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
            raise StageError(f"stage {handle.index} could not start on {node.name}: {type(err).__name__}: "
                             f"{str(err).splitlines()[0] if str(err) else ''}",
                             fix="check that node's log; free CPUs on it, or join another node that holds "
                                 f"{self.model}") from None
        finally:
            handle.pending = None
        again = bool(handle.where)
        handle.actor, handle.where, handle.broken = actor, {**info, "node": node.name}, False
        if again:
            handle.replacements += 1
        cap = f" of its {info['memory_limit_mb']:.0f} MB limit" if info.get("memory_limit_mb") else ""
        message = (f"stage {handle.index} (layers {info['layers'][0]}-{info['layers'][1]}) "
                   f"{'re-placed' if again else 'placed'} on {node.name}, peak RSS {info['peak_rss_mb']:.0f} MB{cap}")
        self.events.append({"kind": "stage", "message": message, "data": {
            "stage": handle.index, "node": node.name, "pid": info.get("pid"), "layers": info["layers"],
            "replaced": again, "peak_rss_mb": info["peak_rss_mb"], "memory_limit_mb": info.get("memory_limit_mb")}})
        log.info(message)

    def _start_stages(self) -> None:
        """Every stage placed: a node picked for each (`_pick_all`), every stage's part sent at once to a
        node that lacks the model (`_bring_parts`), then the actors started. Stages on different nodes
        start at once, their model loads overlapping; on one node one after another (a node's memory cap
        was planned for the stages' resident sizes, not for two loads' peaks at once). The first stage that
        fails ends the start, the actors it started killed."""
        import ray

        launched: list[tuple[RemoteStage, Any, ray_glue.NodeInfo]] = []

        def settle_on(node: ray_glue.NodeInfo) -> None:
            for h, actor, there in launched:
                if h.pending and there.node_id == node.node_id:
                    self._settle(h, actor, there)

        picked = self._pick_all()
        try:
            self._bring_parts(picked)
            for h, node in picked:
                launched.append((h, *self._launch(h, settle_on, node)))
            for h, actor, node in launched:
                if h.pending:
                    self._settle(h, actor, node)
        except BaseException:
            for h, actor, _node in launched:  # started, not yet a handle's: close() would not see them
                if h.actor is not actor:
                    try:
                        ray.kill(actor, no_restart=True)
                    except Exception:  # noqa: BLE001  already gone
                        pass
            for h in self.handles:
                h.pending = None
            raise

    def kill(self, handle: RemoteStage) -> None:
        import ray

        if handle.actor is not None:
            try:
                ray.kill(handle.actor, no_restart=True)
            except Exception:
                pass  # already gone
            handle.actor = None

    # -- the model --------------------------------------------------------------------------------

    def start(self) -> StagedModel:
        """Place every stage and return the batch model over them (the tokenizer loaded here)."""
        import ray

        from smolforge.models.loading import load_tokenizer

        try:
            if self.bounds is None:
                self.plan()
            elif not self.handles:
                self.handles = [RemoteStage(self, i) for i in range(len(self.bounds) - 1)]
            self._start_stages()
            files = ray.get(self.handles[0].actor.tokenizer_files.remote(), timeout=self.load_timeout_s)
            last = self.handles[-1].where
        except BaseException:
            self.close()
            raise
        with tempfile.TemporaryDirectory(prefix="sf-tok-") as tmp:
            tokenizer = load_tokenizer(str(write_dir(files, Path(tmp))))
        return StagedModel(self.handles, tokenizer, name=self.name, eos_ids=frozenset(last["eos_ids"]),
                           max_positions=int(last["max_positions"]))

    def take_lines(self, timeout: float = 2.0) -> list[dict[str, Any]]:
        """What the stages printed since the last take (their peak RSS noted on the way, for `describe`).
        A stage busy past `timeout` answers at a later take (its call stays pending, so no lines are
        lost); a dead one's stay in its node's Ray log."""
        import ray

        for h in self.handles:
            if h.actor is not None and not h.broken and h.index not in self._line_calls:
                self._line_calls[h.index] = on_actor(h.actor, "report")
        refs = list(self._line_calls.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout) if refs else ([], [])
        out: list[dict[str, Any]] = []
        for index, ref in list(self._line_calls.items()):
            if ref not in ready:
                continue
            del self._line_calls[index]
            try:
                report = ray.get(ref, timeout=timeout)
            except Exception:  # noqa: BLE001  a stage that died: its re-placement is reported elsewhere
                continue
            out.extend(report["lines"])
            if index < len(self.handles):
                self.handles[index].where["peak_rss_mb"] = report["peak_rss_mb"]
        return out

    def describe(self) -> list[dict[str, Any]]:
        """Each stage: where it runs, its layers, and its process's peak RSS against its node's memory limit."""
        return [{"stage": h.index, "node": h.where.get("node"), "layers": h.where.get("layers"),
                 "pid": h.where.get("pid"), "running": not h.broken, "replacements": h.replacements,
                 "peak_rss_mb": h.where.get("peak_rss_mb"), "memory_limit_mb": h.where.get("memory_limit_mb")}
                for h in self.handles]

    def close(self) -> None:
        for h in self.handles:
            self.kill(h)
            h.broken = True
