"""A distillation run as a coordinator job: `smolforge jobs`, the dashboard, pause/resume/cancel.

The runner drives `smolforge.cluster.workloads.distill.run.run_distill` from a thread of the coordinator (or
of the embedded cluster) and mirrors it into the job store: job progress (the students' steps
over their total, samples, mean loss, ETA), a loss curve per student, one task row per teacher
and student with its node and state, the pipeline's events, and what each teacher and student
printed (the job's `logs`, labelled by task id: `teacher-0`, `student-1`). Outputs are written under the
coordinator's state dir (`distill/<job>/`, the seed layout); when the run completes, the merged
adapter becomes the job's `adapter` artifact (what `smolforge launch`/`Client.download_adapter`
fetch) and the run summary its `summary` artifact.

Pause stops the teachers at once and has each student checkpoint the steps it has done; the
checkpoint comes back to `output/student_N/checkpoints/` here. Shards already in
`teacher_outputs/` are checksummed and stay. `resume` starts the pipeline again in the same
directory: the teachers make only the missing shards, and each student continues from its
checkpoint (shipped to whichever node runs it now). Cancel stops everything at once. A worker
that dies mid-run costs its teacher's unfinished shards (regenerated elsewhere) and its student's
steps since the last `save_every` checkpoint (see smolforge.cluster.workloads.distill).

The run restarts its own teachers' shards and students inside it; what ends the run goes through the
job's FailurePolicy like every kind's (the base runner's): an error of the run's own making (bad
data, a student that failed after its restarts) is not retried; a lost Ray connection is, and the
next attempt resumes in the same run dir.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ray.exceptions import RayError

from smolforge.cluster.nodes import ray_glue
from smolforge.cluster.workloads.distill.run import DistillStopped, run_distill
from smolforge.cluster.workloads.distill.session import DistillSession
from smolforge.cluster.control.artifacts import ArtifactStore
from smolforge.cluster.control.runner import (
    Cancelled, Completed, Failed, JobRunner, Outcome, Paused, RunnerContext, short_error,
)
from smolforge.cluster.control.specs import DistillJob
from smolforge.errors import SmolforgeError
from smolforge.parallel.transfer import sha256_bytes
from smolforge.telemetry.sinks import run_name


# What a student's progress report carries, as `<name>.student<N>` series (and its TensorBoard/W&B run)
STUDENT_SERIES = ("loss", "lr", "tokens_per_s")


def student_series(task_id: str) -> str:
    """`student-3` (the session's task id) -> `student3` (the metric and TensorBoard series name)."""
    return task_id.replace("-", "")


def run_dir(artifacts: ArtifactStore, job_id: str) -> Path:
    """Where a distill job writes its run (teacher_outputs/, output/, merged_model/)."""
    return artifacts.root.parent / "distill" / job_id


class DistillRunner(JobRunner):
    """Runs one distill job until it is completed, failed, cancelled or paused."""

    def __init__(self, ctx: RunnerContext, job_id: str, spec: DistillJob, reason: str):
        super().__init__(ctx, job_id, spec, reason)
        self.spec: DistillJob = spec
        self.world = 0
        self._events_seen = 0
        self._task_rows: dict[str, tuple] = {}
        self._last_progress = -1.0
        self._steps: dict[str, Any] = {}
        self._nodes: dict[str, str] = {}  # student series -> the node it last ran on (its W&B run's name)
        self._session: DistillSession | None = None  # the running pipeline: its tasks' output lines
        self.out = run_dir(ctx.artifacts, job_id)

    def _stop_requested(self) -> str | None:
        if self.abandon:
            return "abandon"
        return self.want

    def _settings(self):
        """The run's settings, its dataset read from the coordinator's upload where it names one."""
        settings = self.spec.distill
        if settings.data.startswith("upload:"):
            path = self.ctx.artifacts.upload_path(settings.data.split(":", 1)[1])
            settings = settings.model_copy(update={"data": str(path)})
        return settings

    def start_attempt(self) -> Outcome | None:
        spec, settings = self.spec, self._settings()
        if spec.output_dir and self.ctx.embedded:
            self.out = Path(spec.output_dir)
        self._session, self._events_seen = DistillSession(ray_glue.connect(), spec.mode), 0
        self.open_sinks(self.out, tensorboard=spec.tensorboard, wandb=spec.wandb, config=spec.model_dump(mode="json"),
                        name_for=lambda series: run_name(spec.mode, "student", int(series[len("student"):]),
                                                         settings.lr, settings.batch_size,
                                                         host=self._nodes.get(series, "node")))
        self.store.add_event(self.job_id, "distill_started",
                             f"{spec.mode}: teacher {settings.teacher} → {', '.join(settings.students)} "
                             f"({settings.num_students} per base, {settings.peft}); run dir {self.out}")
        self.recovered(f"the run goes on in {self.out}")
        return None

    def poll(self) -> Outcome | None:
        """The whole run: `run_distill` blocks here, minding stop requests through `should_stop`."""
        orch = self._session
        try:
            # resume=True on a first run too: its run dir is new, so there is nothing to resume from.
            summary = run_distill(self._settings(), orch, output_dir=self.out, mode=self.spec.mode,
                                  on_update=self._mirror, should_stop=self._stop_requested, resume=True)
        except DistillStopped as stop:
            self._mirror(orch.distill_tasks(), orch.events)
            return None if stop.what == "abandon" else self.stopped(stop.what)
        except SmolforgeError as err:  # its own making, or its students' restarts spent: not again
            self._mirror(orch.distill_tasks(), orch.events)
            return Failed(err.what, retryable=False, error=err.render())
        except RayError as err:  # the Ray connection (or the driver's node) lost: the next attempt resumes
            self._mirror(orch.distill_tasks(), orch.events)
            return Failed(f"the run lost Ray: {short_error(err)}", error=short_error(err))
        self._mirror(orch.distill_tasks(), orch.events)
        return self._publish(self.out, summary)

    def stopped(self, what: str, where: str = "") -> Outcome:
        if what == "pause":
            return Paused("paused: every task stopped; teacher shards and student checkpoints kept for resume")
        return Cancelled("cancelled; every task stopped")

    # -- mirroring into the job store ----------------------------------------------------------------

    def _mirror(self, statuses: list[dict[str, Any]], events: list[dict[str, Any]]) -> None:
        for e in events[self._events_seen:]:
            data = {k: v for k, v in (e.get("data") or {}).items() if isinstance(v, (str, int, float, bool, list))}
            self.store.add_event(self.job_id, e["kind"], e["message"], data, task_id=data.get("task_id"), ts=e.get("ts"))
        self._events_seen = len(events)
        if self._session is not None:
            self.store.add_logs(self.job_id, self._session.take_lines())
        nodes: list[str] = []
        done = total = 0.0
        steps = max_steps = 0
        losses, etas = [], []
        metric_rows: list[tuple[int, str, float]] = []
        for s in statuses:
            if s["kind"] == "aggregate":
                continue
            row = (s["state"], s.get("node"), round(float(s.get("progress") or 0), 3), s.get("error"))
            if self._task_rows.get(s["task_id"]) != row:
                self._task_rows[s["task_id"]] = row
                state = "queued" if s.get("queued") else s["state"]
                self.store.upsert_task(f"{self.job_id}-{s['task_id']}", self.job_id, s["kind"], state,
                                       node_name=s.get("node"), error=s.get("error"))
            if s.get("node") and s["state"] in ("pending", "running") and s["node"] not in nodes:
                nodes.append(s["node"])
                self.ctx.placed(self.job_id)  # a task holds a node now: the queue's claim can go
            if s["kind"] == "student":
                if s.get("node"):
                    self._nodes.setdefault(student_series(s["task_id"]), s["node"])
                total += float(s.get("samples_total") or 0)
                done += float(s.get("samples_total") or 0) if s["state"] == "completed" else float(s.get("samples_done") or 0)
                max_steps += int(s.get("max_steps") or 0)
                steps += int(s.get("max_steps") or 0) if s["state"] == "completed" else int(s.get("step") or 0)
                if s.get("loss") is not None:
                    losses.append(float(s["loss"]))
                    if self._steps.get(s["task_id"]) != s.get("step"):  # curves per student: `<name>.student<N>`
                        self._steps[s["task_id"]] = s.get("step")
                        series, step = student_series(s["task_id"]), int(s.get("step") or 0)
                        values = {k: float(s[k]) for k in STUDENT_SERIES if s.get(k) is not None}
                        metric_rows.extend((step, f"{k}.{series}", v) for k, v in values.items())
                        self.log_series(series, "train", step, values)
                if s.get("eta_s") is not None:
                    etas.append(float(s["eta_s"]))
        self.store.add_metrics(self.job_id, metric_rows)
        progress = done / total if total else 0.0
        if abs(progress - self._last_progress) >= 0.005 or (nodes and self.world != len(nodes)):
            self._last_progress = progress
            self.world = len(nodes)
            fields: dict[str, Any] = dict(step=steps, max_steps=max_steps, nodes=nodes, world_size=len(nodes),
                                          samples_done=int(done), samples_total=int(total),
                                          eta_s=max(etas) if etas else None)
            if losses:
                fields["loss"] = sum(losses) / len(losses)
            self.store.update_job(self.job_id, **fields)

    def _publish(self, out: Path, summary: dict[str, Any]) -> Outcome:
        """The merged adapter and the summary into the artifact store; the job's result."""
        merged = [Path(rep["output"]) for rep in summary.get("merged", {}).values() if rep.get("output")]
        if merged:
            self.ctx.artifacts.put_dir(self.job_id, "adapter", merged[0].name, merged[0])
        data = (out / "distill_summary.json").read_bytes()
        payload = {"files": {"distill_summary.json": data}, "sha256": {"distill_summary.json": sha256_bytes(data)}}
        self.ctx.artifacts.put(self.job_id, "summary", "distill", payload)
        evals = [t.get("eval") or {} for t in summary["student_tasks"]]
        result = {"store": summary["store"], "stage_seconds": summary["stage_seconds"],
                  "students": [{k: t.get(k) for k in ("task_id", "node", "state", "output_dir")} | {"eval": ev}
                               for t, ev in zip(summary["student_tasks"], evals)],
                  "merged": {base: {k: v for k, v in rep.items() if k != "truncation_error"}
                             for base, rep in summary.get("merged", {}).items()}}
        ok = [ev for ev in evals if "eval_loss" in ev]
        if ok:
            result["eval"] = {k: sum(ev[k] for ev in ok) / len(ok) for k in ("eval_loss", "accuracy")
                              if all(k in ev for ev in ok)}
        total = sum(int(t.get("max_steps") or 0) for t in summary["student_tasks"])
        self.store.update_job(self.job_id, step=total, max_steps=total)
        return Completed(f"completed: {len(summary['student_tasks'])} students, "
                         f"{summary['store']['bytes_per_token']:.1f} bytes/token store", result=result)
