"""Bringing a job's model to the workers placed for it that lack it, before its work starts there.

Every kind that runs a model on a worker calls `bring_model` itself, with the nodes it placed, before
it starts work on them: a data-parallel round (and a node joining a running elastic group, `_admit`),
a serve job's stage (`serve/stages.py`: only that stage's part, `StagePart`), a pipeline rank (the
round's nodes only the config and tokenizer, `CONFIG_PART`; each rank its stage's part once it has
cut the model: `data_parallel/stage_parts.py`), an export task, a
distill run's teacher and student bases (`distill/travel.py`: to every worker before the run places
anything, then awaited until those workers advertise them, since distill places by `model:<name>`). What
comes back is the attempt's Outcome (Failed with the reason), so the job's FailurePolicy decides.

The placed nodes that do not advertise the model (`model:<name>`) each fetch it from one node
that does (the coordinator's machine first: it runs no ranks), through `nodes.model_fetch`: a
`ModelSource` actor on the holder, a `ModelFetcher` actor on each fetching node, in checksummed
pieces. Every step is a `model_transfer` event of the job (what `job logs -f` shows): the nodes that
hold it already (a cache hit: nothing sent), the plan, progress (bytes, pieces, rate) every few
seconds, a cut fetch resumed, each node's result. A node whose disk cannot take the model is refused
before anything is sent, and the round fails with the reason.

Transport: Ray actors rather than the coordinator's HTTP API, because the holder may be any node
(a worker's models dir), the pieces then go straight from holder to fetcher, and Ray's channel is
already authenticated (the cluster token, Ray's TLS where on) between our own processes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ray.exceptions import NodeDiedError, RayError

from smolforge.cluster.control.jobstore import JobStore
from smolforge.cluster.control.placement import lacking, transfer_seconds, transfer_source
from smolforge.cluster.control.runner import Failed, Outcome, Regroup, short_error
from smolforge.cluster.nodes import ray_glue
from smolforge.cluster.nodes.model_fetch import ModelFetcher, ModelSource, ask_rescan_here, piece_bytes, stage_part_name

MAX_ATTEMPTS = 3  # a fetch cut mid-way (its process killed, its node's link lost) resumes this often
REPORT_S = 2.0  # seconds between a node's progress events
MANIFEST_TIMEOUT_S = 600.0  # the holder reads (hashes) the whole model once: a 2 GB model on a slow disk
RESCAN_ASK_TIMEOUT_S = 60.0  # a node's answer to "read your models again" (a file written there)


@dataclass
class Fetch:
    """One node's fetch: its actor, the attempt, what it reported last."""

    node_id: str
    node: str
    attempt: int = 0
    actor: Any = None
    ref: Any = None
    resumed: int = 0
    started: float = field(default_factory=time.time)
    reported: float = 0.0
    last: dict = field(default_factory=dict)


Report = Callable[[str, dict], None]  # (message, data): one `model_transfer` event of the job


def job_report(store: JobStore, job_id: str, task_id: str | None = None) -> Report:
    """`model_transfer` events straight into the job store (a runner in the coordinator's process)."""
    return lambda message, data: store.add_event(job_id, "model_transfer", message, data, task_id=task_id)


@dataclass(frozen=True)
class StagePart:
    """A stage's share of the model: what a node that runs stage `index` of the cut `bounds` receives
    (its tensors, the config and tokenizer), kept apart from the whole models it advertises. `index`
    None (`CONFIG_PART`): the config and tokenizer only, no tensor: what a pipeline rank builds the
    model on the meta device and plans its cut with, before it knows its stage."""

    bounds: tuple[int, ...] = ()
    index: int | None = None

    def label(self) -> str:
        if self.index is None:
            return "its config and tokenizer (no tensors)"
        return f"stage {self.index}'s part (layers {self.bounds[self.index]}-{self.bounds[self.index + 1]})"

    def stage(self) -> tuple[list[int], int | None]:
        """(bounds, index) as `ModelSource` and `stage_part_name` take them."""
        return list(self.bounds), self.index

    def data(self) -> dict[str, Any]:
        """What its events carry about it."""
        return {"part": "config"} if self.index is None else {"stage": self.index, "bounds": list(self.bounds)}


CONFIG_PART = StagePart()


class Transfer:
    """The fetches of one round, reported as the job's `model_transfer` events."""

    def __init__(self, report: Report, model: str, part: StagePart | None = None, advertise: bool = True):
        self.report, self.model, self.part = report, model, part
        self.advertise = advertise and part is None  # a part is never advertised as the model
        self.source: Any = None
        self.manifest: dict = {}
        self.fetches: dict[str, Fetch] = {}

    def event(self, message: str, **data: Any) -> None:
        what = f"model {self.model}" + (f", {self.part.label()}" if self.part else "")
        extra = self.part.data() if self.part else {}
        self.report(f"{what}: {message}", {"model": self.model, **extra, **data})

    def open_source(self, holder: ray_glue.NodeInfo) -> None:
        import ray

        stage = self.part.stage() if self.part else None
        self.source = _pinned(ModelSource, holder.node_id, 8).remote(self.model, piece_bytes(), stage)
        self.manifest = ray.get(self.source.manifest.remote(), timeout=MANIFEST_TIMEOUT_S)

    def start(self, f: Fetch) -> str | None:
        """A fetcher on `f`'s node, prepared: None when it is fetching (or held the model already),
        else why the node cannot take it."""
        import ray

        f.attempt += 1
        dest = stage_part_name(self.model, *self.part.stage()) if self.part else None
        f.actor = _pinned(ModelFetcher, f.node_id, 2).remote(self.model, self.manifest, dest, self.advertise)
        prep = ray.get(f.actor.prepare.remote(), timeout=MANIFEST_TIMEOUT_S)
        if prep.get("refused"):
            return f"{f.node} cannot take it: {prep['refused']}"
        if prep.get("cache_hit"):
            self.event(f"{f.node} holds a complete copy already (cache hit: nothing sent)", node=f.node,
                       cache_hit=True, pieces=0, bytes=0)
            return None
        f.resumed, f.started = prep["resumed"], time.time()
        if f.attempt > 1:
            self.event(f"{f.node} resumes its cut fetch: {f.resumed} pieces kept, "
                       f"{prep['missing_bytes'] / 1e6:.1f} MB to go", node=f.node, resumed=f.resumed,
                       attempt=f.attempt, state="resumed")
        f.ref = f.actor.fetch.remote(self.source)
        return None

    def progress(self, f: Fetch, final: dict | None = None) -> None:
        """A progress event for `f` (at most every REPORT_S unless `final`)."""
        import ray

        if final is None:
            if time.time() - f.reported < REPORT_S:
                return
            try:
                final_or_now = ray.get(f.actor.progress.remote(), timeout=5)
            except RayError:
                return
            if final_or_now == f.last:
                return
        else:
            final_or_now = final
        p, f.reported, f.last = final_or_now, time.time(), final_or_now
        took = max(time.time() - f.started, 1e-6)
        done = final is not None
        self.event(f"{f.node} {'has it' if done else 'fetching'}: {p['bytes'] / 1e6:.2f} MB, "
                   f"{p['pieces'] + f.resumed}/{p['pieces_total']} pieces ({f.resumed} resumed, "
                   f"{p['refused']} refused and sent again), {p['bytes'] / 1e6 / took:.2f} MB/s",
                   node=f.node, pieces=p["pieces"], resumed=f.resumed, refused=p["refused"],
                   bytes=p["bytes"], pieces_total=p["pieces_total"], rate_mb_s=round(p["bytes"] / 1e6 / took, 3),
                   attempt=f.attempt, state="done" if done else "progress", cache_hit=False)

    def close(self) -> None:
        import ray

        for actor in [self.source, *(f.actor for f in self.fetches.values())]:
            if actor is not None:
                try:
                    ray.kill(actor, no_restart=True)
                except (RayError, ValueError):
                    pass  # gone already (the fetch a test killed)


def _pinned(cls: type, node_id: str, concurrency: int):
    """`cls` as a Ray actor on `node_id` that takes no CPU (a round's ranks hold the node's CPUs)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return ray.remote(cls).options(num_cpus=0, max_restarts=0, max_concurrency=concurrency,
                                   scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))


def ask_rescan(placed: list[tuple[str, str]]) -> tuple[set[str], dict[str, str]]:
    """Each placed node's ((node id, name) each) worker asked to read its models again, so it
    advertises what was fetched there with `advertise=False` (it re-joins Ray once none of its CPUs
    runs a task): a caller that brings several models asks once, after the last, so a node re-joins
    once and never while another of its fetches runs (distill). (names asked, {name: why not}); a node
    that left Ray before its answer came back counts as asked: it read the request and is re-joining
    (the caller's wait for it to advertise the model decides)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ask = ray.remote(num_cpus=0, max_retries=0)(ask_rescan_here)
    refs = {name: ask.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
            for node_id, name in placed}
    asked, failed = set(), {}
    for name, ref in refs.items():
        try:
            ray.get(ref, timeout=RESCAN_ASK_TIMEOUT_S)
            asked.add(name)
        except NodeDiedError:
            asked.add(name)
        except RayError as err:
            failed[name] = short_error(err)
    return asked, failed


def bring_model(report: Report, model: str, placed: list[tuple[str, str]], nodes: list[ray_glue.NodeInfo],
                stopping: Callable[[], bool], part: StagePart | None = None, advertise: bool = True
                ) -> Outcome | None:
    """Every placed node ((node id, name) each) that does not advertise `model` fetches it (or, with
    `part`, only the part that one stage loads) from a node that holds it; None once each has it,
    else what came of trying: Failed with the reason (a node refused for its disk: not retried), or
    Regroup when `stopping()` turned true meanwhile. Each step is reported (`report`, `job_report`).

    The caller decides whether the model travels at all (`placement.model_travels`): a preset, a
    local directory on the embedded cluster, or `require_model: false` needs nothing sent.

    `advertise` False: the fetching node is not asked to read its models at once. Ray cannot add a
    resource to a running node, so a worker that advertises a new model leaves Ray and joins again
    as soon as none of our tasks holds its CPUs; a caller whose task is not placed yet (export)
    passes False so the node stays while the task lands (its timed rescan advertises the model
    later, once idle). A data-parallel round's placement group holds the CPUs already."""
    have, need = lacking(model, placed, nodes)
    t = Transfer(report, model, part, advertise)
    if have:  # with a part asked for, such a node loads from its whole copy
        t.event(f"on {', '.join(have)} already{' (the whole model)' if part else ''} (cache hit: nothing sent)",
                nodes=have, cache_hit=True, pieces=0, bytes=0)
    if not need:
        return None
    source = transfer_source(model, need, nodes)
    if source is None:
        return Failed(f"no node holds model {model} to send to {', '.join(n for _, n in need)}",
                      error=f"no node holds model {model} any more")
    try:
        t.open_source(source)
        est = transfer_seconds(t.manifest["bytes"])  # the fetches run at once, each over its own link
        t.event(f"sending {t.manifest['bytes'] / 1e6:.2f} MB ({t.manifest['pieces']} pieces) from "
                f"{source.name} to {', '.join(n for _, n in need)}, est. {est:.1f} s", source=source.name,
                nodes=[n for _, n in need], bytes_total=t.manifest["bytes"], pieces_total=t.manifest["pieces"],
                state="planned", est_s=round(est, 3))
        t.fetches = {nid: Fetch(nid, name) for nid, name in need}
        for f in t.fetches.values():
            why = t.start(f)
            if why:
                t.event(f"refused: {why}", node=f.node, state="refused")
                return Failed(f"model {model}: {why}", retryable=False, error=f"model {model}: {why}")
        return _watch(t, stopping)
    except RayError as err:
        t.event(f"transfer failed: {short_error(err)}", state="failed")
        return Failed(f"could not send model {model}", error=short_error(err))
    finally:
        t.close()


def _watch(t: Transfer, stopping: Callable[[], bool]) -> Outcome | None:
    """Until every fetch is done: progress events, a cut fetch resumed (up to MAX_ATTEMPTS)."""
    import ray

    while True:
        running = {f.ref: f for f in t.fetches.values() if f.ref is not None}
        if not running:
            return None
        if stopping():
            return Regroup("stopped while the model was fetched")
        ready, _ = ray.wait(list(running), num_returns=1, timeout=1.0)
        for ref in ready:
            f = running[ref]
            f.ref = None
            try:
                t.progress(f, final=ray.get(ref))
            except RayError as err:
                if f.attempt >= MAX_ATTEMPTS:
                    t.event(f"{f.node}'s fetch failed {f.attempt} times: {short_error(err)}", node=f.node,
                            state="failed")
                    return Failed(f"could not send model {t.model} to {f.node}", error=short_error(err))
                t.event(f"{f.node}'s fetch was cut ({short_error(err)}); resuming", node=f.node,
                        attempt=f.attempt, state="cut")
                why = t.start(f)
                if why:
                    return Failed(f"model {t.model}: {why}", retryable=False, error=why)
        for f in t.fetches.values():
            if f.ref is not None:
                t.progress(f)
