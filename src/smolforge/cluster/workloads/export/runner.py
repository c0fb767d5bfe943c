"""An `export` job: one task, on a node that holds the model, runs `smolforge.models.export.run.export`
and hands the result to the coordinator's artifact store as `export/<to>` (in checksummed pieces
through the job's control actor, as a data-parallel job ships its checkpoints); the client
downloads it from there. No shared filesystem is assumed.

Adapter directories are read where the task runs, so a job that names them runs only on the
embedded cluster (this machine), like a serve job's adapter. Cancel (or pause) stops the task; a
resumed export starts again (exports are minutes at most, and a half-written one is never stored).
A task lost with its process or node is run again, as the job's FailurePolicy decides (the base
runner's); an export error of the job's own making fails it at once.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from smolforge.cluster.nodes import ray_glue
from smolforge.cluster.control.placement import model_need, model_travels, travel_node
from smolforge.cluster.control.runner import (
    POLL_S, Cancelled, Completed, Failed, JobRunner, Outcome, Paused, RunnerContext, own_making, short_error,
)
from smolforge.cluster.control.specs import ExportJob
from smolforge.cluster.workloads.model_transfer import bring_model, job_report
from smolforge.train.faults import fault_once

ARTIFACT_KIND = "export"


def export_task(spec: ExportJob, control: Any, upload_timeout_s: float) -> dict:
    """Ray task body: export into scratch space on this node, then upload it to the control actor."""
    import ray

    from smolforge.models.export.run import export
    from smolforge.cluster.workloads.data_parallel.rank import local_model_path, node_dir
    from smolforge.parallel.transfer import send_dir

    if fault_once("export-fail"):  # fault injection (train/faults.py): this node's process dies, once
        os._exit(1)
    scratch = node_dir() / "exports"
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch, prefix="export-") as tmp:
        out = Path(tmp) / spec.to
        summary = export(local_model_path(spec.model), spec.to, out, adapters=spec.adapters, quant=spec.quant,
                         name=spec.model_name, verify=spec.verify, threads=max(1, int(spec.cpus)), dtype=spec.dtype)
        deadline = time.monotonic() + upload_timeout_s
        left = lambda: max(1.0, deadline - time.monotonic())  # noqa: E731
        upload_id = ray.get(control.begin_artifact.remote(ARTIFACT_KIND, spec.to), timeout=left())
        try:
            sums = send_dir(out, lambda rel, off, data: ray.get(control.put_piece.remote(upload_id, rel, off, data),
                                                                 timeout=left()))
            summary["artifact"] = ray.get(control.commit_artifact.remote(upload_id, sums), timeout=left())
        except BaseException:
            control.abort_artifact.remote(upload_id)
            raise
    return summary


class ExportRunner(JobRunner):
    """One export job: an attempt is one task; a task whose node or process is lost is tried again
    through the job's FailurePolicy (the base's), an export error of its own making is not."""

    def __init__(self, ctx: RunnerContext, job_id: str, spec: ExportJob, reason: str):
        super().__init__(ctx, job_id, spec, reason)
        self.spec: ExportJob = spec
        self.control: Any = None
        self.ref: Any = None
        self.deadline = 0.0

    def running_message(self) -> str:
        return f"exporting {self.spec.model} to {self.spec.to} ({self.reason})"

    def start_attempt(self) -> Outcome | None:
        import ray

        from smolforge.cluster.workloads.data_parallel.job_control import create_control

        spec = self.spec
        if spec.adapters and not self.ctx.embedded:  # a coordinator never reads where a network peer tells it to
            return Failed("adapters are for the embedded cluster only", retryable=False,
                          error="an export job's adapter directories are read where it runs: only the embedded "
                                "cluster (this machine) takes them; export a merged or full model")
        handle = ray_glue.connect()
        nodes = self.ctx.healthy_nodes()
        req = ray_glue.Requirements(model=model_need(spec.model, spec.require_model, self.ctx.embedded, nodes),
                                    cpus=spec.cpus)
        options = handle.ray_options(req)
        if model_travels(spec.model, spec.require_model, self.ctx.embedded, nodes):
            options = self._travel(req, nodes, options)
            if not isinstance(options, dict):
                return options
        self.control = create_control(self.job_id, str(self.ctx.artifacts.root.resolve()))
        self.ref = ray.remote(export_task).options(**options, max_retries=0).remote(spec, self.control, spec.timeout_s)
        self.deadline = time.monotonic() + spec.timeout_s + 60
        self.recovered("the export runs again")
        return None

    def _travel(self, req: ray_glue.Requirements, nodes: list[ray_glue.NodeInfo],
                options: dict[str, Any]) -> dict[str, Any] | Outcome:
        """Where the task runs when its model travels: a worker that holds the model (nothing sent),
        else the candidate worker with the most free CPUs, which fetches it first (`bring_model`);
        the task is then pinned there. A transfer that fails is this attempt's Failed outcome."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        held, node = travel_node(req, self.spec.model, nodes)  # the choice: `placement.travel_node`
        if held is not None:
            return held.ray_options(nodes)
        if node is None:  # the healthy view has none the live table had: Ray places it (or says why not)
            return options
        moved = bring_model(job_report(self.store, self.job_id), self.spec.model, [(node.node_id, node.name)], nodes,
                            stopping=lambda: bool(self.want), advertise=False)
        if moved is not None:
            return moved
        options.pop("label_selector", None)
        return {**options, "scheduling_strategy": NodeAffinitySchedulingStrategy(node.node_id, soft=False)}

    def poll(self) -> Outcome | None:
        import ray

        ready, _ = ray.wait([self.ref], timeout=POLL_S)
        if not ready:
            if self.want:
                return self.stopped(self.want)
            if time.monotonic() > self.deadline:  # the same export would take as long again: not retried
                return Failed("the export did not finish in time", retryable=False,
                              error=f"the export did not finish within timeout_s={self.spec.timeout_s:g}")
            return None
        ref, self.ref = self.ref, None  # it ended: nothing to cancel (a cancel racing its end upsets Ray)
        try:
            summary = ray.get(ref, timeout=30)
        except Exception as err:  # noqa: BLE001 - the task failed, or its process or node died
            return Failed(f"the export task failed: {short_error(err)}", retryable=not own_making(err),
                          error=short_error(err))
        verify = summary.get("verify")
        detail = (f"; llama.cpp: logits NMSE {verify['logits_nmse']:.2e}, greedy agreement "
                  f"{verify['greedy_agreement']:.0%}") if verify else ""
        self.store.add_event(self.job_id, "exported", f"exported {self.spec.model} to {self.spec.to}{detail}",
                             {k: v for k, v in summary.items() if k != "output_dir"})
        return Completed(f"completed: artifact {ARTIFACT_KIND}/{self.spec.to}")

    def stopped(self, what: str, where: str = "") -> Outcome:
        if what == "pause":
            return Paused("paused: the export stopped (it starts again on resume)")
        return Cancelled("cancelled; the export stopped")

    def end_attempt(self) -> None:
        import ray

        ref, self.ref = self.ref, None
        if ref is not None:
            try:
                ray.cancel(ref, force=True)
            except Exception:  # noqa: BLE001
                pass  # finished already
        control, self.control = self.control, None
        if control is not None:
            try:
                ray.kill(control, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
