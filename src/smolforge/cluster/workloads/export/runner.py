"""An `export` job: one task, on a node that holds the model, runs `smolforge.models.export.run.export`
and hands the result to the coordinator's artifact store as `export/<to>` (in checksummed pieces
through the job's control actor, as a data-parallel job ships its checkpoints); the client
downloads it from there. No shared filesystem is assumed.

Adapter directories are read where the task runs, so a job that names them runs only on the
embedded cluster (this machine), like a serve job's adapter. Cancel (or pause) stops the task; a
resumed export starts again (exports are minutes at most, and a half-written one is never stored).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from smolforge.cluster.nodes import ray_glue
from smolforge.cluster.control.placement import holds_anywhere
from smolforge.cluster.control.runner import POLL_S, JobRunner, short_error
from smolforge.cluster.control.specs import ExportJob

ARTIFACT_KIND = "export"


def export_task(spec_dict: dict[str, Any], control: Any, upload_timeout_s: float) -> dict:
    """Ray task body: export into scratch space on this node, then upload it to the control actor."""
    import ray

    from smolforge.models.export.run import export
    from smolforge.cluster.workloads.data_parallel.rank import local_model_path, node_dir
    from smolforge.parallel.transfer import send_dir

    spec = ExportJob.model_validate(spec_dict)
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
    def __init__(self, mgr, job_id: str, reason: str):
        super().__init__(mgr, job_id, reason)
        self.control: Any = None
        self.ref: Any = None

    def _run(self) -> None:
        import ray

        spec = self._spec_to_run(ExportJob)
        if spec is None:
            return
        if spec.adapters and not self.mgr.embedded:  # a coordinator never reads where a network peer tells it to
            self.store.set_state(self.job_id, "failed", "failed: adapters are for the embedded cluster only",
                                 error="an export job's adapter directories are read where it runs: only the "
                                       "embedded cluster (this machine) takes them; export a merged or full model")
            return
        self.store.set_state(self.job_id, "running", f"exporting {spec.model} to {spec.to} ({self.reason})")
        handle = ray_glue.connect()
        need_model = spec.require_model if spec.require_model is not None else \
            not holds_anywhere(spec.model, self.mgr.embedded)
        req = ray_glue.Requirements(model=spec.model if need_model else None, cpus=spec.cpus)
        from smolforge.cluster.workloads.data_parallel.job_control import create_control

        self.control = create_control(self.job_id, str(self.mgr.artifacts.root.resolve()))
        self.ref = ray.remote(export_task).options(**handle.ray_options(req), max_retries=0).remote(
            spec.model_dump(mode="json"), self.control, spec.timeout_s)
        deadline = time.monotonic() + spec.timeout_s + 60
        while True:
            ready, _ = ray.wait([self.ref], timeout=POLL_S)
            if ready:
                break
            if self.abandon:
                return
            if self.want:
                self._finish_stopped(self.want)
                return
            if time.monotonic() > deadline:
                self.store.set_state(self.job_id, "failed", "failed: the export did not finish in time",
                                     error=f"the export did not finish within timeout_s={spec.timeout_s:g}")
                return
        try:
            summary = ray.get(self.ref, timeout=30)
        except Exception as err:
            self.store.set_state(self.job_id, "failed", f"failed: {short_error(err)}", error=short_error(err))
            return
        verify = summary.get("verify")
        detail = (f"; llama.cpp: logits NMSE {verify['logits_nmse']:.2e}, greedy agreement "
                  f"{verify['greedy_agreement']:.0%}") if verify else ""
        self.store.add_event(self.job_id, "exported", f"exported {spec.model} to {spec.to}{detail}",
                             {k: v for k, v in summary.items() if k != "output_dir"})
        self.store.set_state(self.job_id, "completed", f"completed: artifact {ARTIFACT_KIND}/{spec.to}")

    def _finish_stopped(self, what: str) -> None:
        self._cleanup()
        if what == "pause":
            self.store.set_state(self.job_id, "paused", "paused: the export stopped (it starts again on resume)")
        else:
            self.store.set_state(self.job_id, "cancelled", "cancelled; the export stopped", force=True)

    def _cleanup(self) -> None:
        import ray

        ref, self.ref = self.ref, None
        if ref is not None:
            try:
                ray.cancel(ref, force=True)
            except Exception:
                pass  # finished already
        control, self.control = self.control, None
        if control is not None:
            try:
                ray.kill(control, no_restart=True)
            except Exception:
                pass

