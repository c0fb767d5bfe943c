"""A distillation run's models, brought to the workers that lack them before the run places anything.

Distill places its teachers and students by what the nodes advertise (`model:<name>`, through
`planner.model_nodes`), not on a placement group it holds while the model is fetched (a data-parallel
round) or on one node it pins (an export). So the run's models travel first: the teacher (unless it
runs on the coordinator, or is an Ollama tag) and every student base, each that some node holds
(`placement.model_travels`), go to every live worker that takes work and lacks them
(`model_transfer.bring_model`, its steps the job's `model_transfer` events; the models at once), and
the run then waits (REGISTER_WAIT_S at most) until those workers advertise them.

A worker advertises a new model only by leaving Ray and joining again (Ray cannot add a resource to a
running node), under a new node id, once none of its CPUs runs a task: the wait matches nodes by
name. Every model is fetched with `advertise=False`, and each node that received any is asked to
read its models once, after the last: asked after its first model, a node would leave Ray while its
second was being fetched (and re-join once per model). A worker that is not back with the models in
time is left out (an event says so) and the run goes on with the nodes that hold them; when no
worker holds the teacher then, the attempt fails with the reason (its FailurePolicy decides).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from smolforge.cluster.control.placement import model_travels
from smolforge.cluster.control.runner import Failed, Outcome, Regroup
from smolforge.cluster.nodes import ray_glue
from smolforge.cluster.workloads.model_transfer import Report, ask_rescan, bring_model, lacking
from smolforge.distill.backends import loader
from smolforge.distill.planner import model_backend

REGISTER_WAIT_S = 120.0  # how long the run waits for the workers that fetched a model to advertise it
WAIT_POLL_S = 1.0  # how often it looks at the node table meanwhile
WAIT_REPORT_S = 15.0  # how often it says, while waiting, whom it waits for


def travelling_models(teacher: str | None, students: list[str], embedded: bool, backend: str = "hf",
                      on_coordinator: bool = False, nodes: list[ray_glue.NodeInfo] | None = None) -> list[str]:
    """The run's models that travel to the workers (`placement.model_travels`), teacher first, each
    once: not a teacher the coordinator runs (it must hold it), nor an Ollama tag (never weights)."""
    travels = teacher is not None and not on_coordinator and loader(model_backend(backend)).weights
    names = [teacher] if travels else []
    names += [s for s in students if isinstance(s, str)]
    return [m for m in dict.fromkeys(names) if model_travels(m, None, embedded, nodes)]


def bring_run_models(report: Report, models: list[str], teacher: str | None, stopping: Callable[[], bool],
                     wait_s: float | None = None) -> Outcome | None:
    """`models` to every live worker that takes work and lacks them, every model at once (a run waits for
    the slowest transfer, not their sum; a failed one's Outcome is returned once all ended), then each
    such worker's re-join awaited (`wait_s`, default REGISTER_WAIT_S); None when the run may place its
    tasks, else the attempt's Outcome: a transfer's Failed or Regroup, Regroup when `stopping()` turned
    true while waiting, Failed when `teacher` (one of `models`) is on no worker afterwards."""
    if not models:
        return None
    nodes = ray_glue.nodes()
    placed = [(n.node_id, n.name) for n in nodes if n.alive and n.takes_work]
    fetched: dict[tuple[str, str], set[str]] = {}  # (node id, name) -> the models it must advertise
    with ThreadPoolExecutor(max_workers=len(models), thread_name_prefix="sf-run-model") as pool:  # all at once
        outcomes = list(pool.map(lambda m: bring_model(report, m, placed, nodes, stopping, advertise=False), models))
    moved = next((o for o in outcomes if o is not None), None)  # the first model's that failed, in `models` order
    if moved is not None:
        return moved
    for model in models:
        for node in lacking(model, placed, nodes)[1]:
            fetched.setdefault(node, set()).add(model)
    if fetched:
        asked, failed = ask_rescan(list(fetched))
        for name, why in failed.items():
            report(f"models {', '.join(models)}: {name} could not be asked to read its models ({why}): "
                   "left out of this run", {"model": models[0], "models": models, "node": name, "state": "left_out"})
        want = {name: ms for (_, name), ms in fetched.items() if name in asked}
        stopped = await_advertised(report, models, want, stopping, REGISTER_WAIT_S if wait_s is None else wait_s
                                   ) if want else None
        if stopped is not None:
            return stopped
    if teacher in models and not any(ray_glue.model_resource(teacher) in n.resources
                                     for n in ray_glue.nodes() if n.alive and n.takes_work):
        return Failed(f"no worker holds teacher model {teacher} after its transfer",
                      error=f"the workers that fetched {teacher} did not join Ray again advertising it "
                            "(see the job's model_transfer events)")
    return None


def await_advertised(report: Report, models: list[str], want: dict[str, set[str]], stopping: Callable[[], bool],
                     wait_s: float) -> Outcome | None:
    """Until every node named in `want` is live (under any node id) and advertises the models it
    fetched, or `wait_s` passed (those still missing are left out, with an event): None; Regroup
    when `stopping()` turned true meanwhile."""
    what, it = f"model{'s' if len(models) > 1 else ''} {', '.join(models)}", "them" if len(models) > 1 else "it"
    deadline, said = time.monotonic() + wait_s, 0.0
    while True:
        live = [n for n in ray_glue.nodes() if n.alive]
        waiting = sorted(name for name, ms in want.items()
                         if not any(n.name == name and all(ray_glue.model_resource(m) in n.resources for m in ms)
                                    for n in live))
        data = {"model": models[0], "models": models, "nodes": waiting}
        if not waiting:
            report(f"{what}: {', '.join(sorted(want))} joined Ray again advertising {it}",
                   {**data, "nodes": sorted(want), "state": "advertised"})
            return None
        if stopping():
            return Regroup("stopped while waiting for the workers to advertise the model")
        if time.monotonic() >= deadline:
            report(f"{what}: {', '.join(waiting)} did not join Ray again advertising {it} within {wait_s:g} s: "
                   "left out of this run",
                   {**data, "state": "left_out", "wait_s": wait_s})
            return None
        if time.monotonic() - said >= WAIT_REPORT_S:
            said = time.monotonic()
            report(f"{what}: waiting for {', '.join(waiting)} to join Ray again advertising {it} (up to "
                   f"{wait_s:g} s; a worker re-joins once none of its CPUs runs a task)", {**data, "state": "waiting", "wait_s": wait_s})
        time.sleep(WAIT_POLL_S)
