"""A distillation run as a coordinator job: `smolforge jobs`, the dashboard, pause/resume/cancel.

The runner steps a `smolforge.cluster.workloads.distill.run.DistillFlow` from a thread of the coordinator (or
of the embedded cluster): each `poll` is one step (the session's `step`: every teacher's and student's news
collected at once, the brokers drained, queued students placed; then the mirror and a stop asked), so the
base runner's loop is the run's one loop and its FailurePolicy decides what ends the run. It mirrors
it into the job store: job progress (the students' steps over their total, samples, mean loss, ETA),
a loss curve per student, one task row per teacher
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

Before the run places anything, its teacher and student bases travel to the workers that lack them
and the run waits until those workers advertise them (`travel.py`: distill places by `model:<name>`).

The run restarts its own teachers' shards and students inside it; what ends the run goes through the
job's FailurePolicy like every kind's (the base runner's): an error of the run's own making (bad
data, a student that failed after its restarts) is not retried; a lost Ray connection is, and the
next attempt resumes in the same run dir.
"""

from __future__ import annotations

import itertools
import re
import time
from pathlib import Path
from typing import Any, Callable

from ray.exceptions import RayError

from smolforge.cluster.nodes import ray_glue
from smolforge.cluster.workloads.distill.controller import started
from smolforge.cluster.workloads.distill.run import DistillFlow, DistillStopped
from smolforge.cluster.workloads.distill.session import DistillSession
from smolforge.cluster.control.artifacts import ArtifactStore
from smolforge.cluster.control.placement import busy_cpus
from smolforge.cluster.control.runner import (
    Cancelled, Completed, Failed, JobRunner, Outcome, Paused, RunnerContext, short_error,
)
from smolforge.cluster.control.specs import DistillJob, DistillTaskJob
from smolforge.cluster.control.states import ended_unsuccessfully, succeeded
from smolforge.cluster.workloads.distill.plans import store_dir_of
from smolforge.cluster.workloads.distill.state import TASK_ENDED
from smolforge.cluster.workloads.distill.stage_args import typed_args
from smolforge.cluster.workloads.distill.travel import bring_run_models, travelling_models
from smolforge.cluster.workloads.model_transfer import job_report
from smolforge.distill.store import store_summary
from smolforge.errors import SmolforgeError
from smolforge.parallel.transfer import sha256_bytes
from smolforge.telemetry.sinks import run_name


# What a student's progress report carries, as `<name>.student<N>` series (and its TensorBoard/W&B run)
STUDENT_SERIES = ("loss", "lr", "tokens_per_s")
STEP_S = 0.5  # one step waits at most this long for a teacher's or student's news (then drains, mirrors)


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
        self._flow: DistillFlow | None = None  # the attempt's run, stepped by `poll`
        self.out = run_dir(ctx.artifacts, job_id)

    def _stop_requested(self) -> str | None:
        if self.abandon:
            return "abandon"
        return self.want

    def _settings(self):
        """The run's settings, its dataset and held-out file read from the coordinator's uploads where they
        name them."""
        settings = self.spec.distill
        update = {key: str(self.ctx.artifacts.upload_path(value.split(":", 1)[1]))
                  for key in ("data", "eval_data") if (value := getattr(settings, key)) and value.startswith("upload:")}
        return settings.model_copy(update=update) if update else settings

    def start_attempt(self) -> Outcome | None:
        spec, settings = self.spec, self._settings()
        if spec.output_dir and self.ctx.embedded:
            self.out = Path(spec.output_dir)
        cluster = ray_glue.connect()
        moved = self._bring_models(settings.teacher, settings.students, settings.teacher_backend,
                                   settings.teacher_on_coordinator)
        if moved is not None:
            return moved
        self._session, self._events_seen, self._flow = DistillSession(cluster, spec.mode, driven=True), 0, None
        self.open_sinks(self.out, tensorboard=spec.tensorboard, wandb=spec.wandb, config=spec.model_dump(mode="json"),
                        name_for=lambda series: run_name(spec.mode, "student", int(series[len("student"):]),
                                                         settings.lr, settings.batch_size,
                                                         host=self._nodes.get(series, "node")))
        self.store.add_event(self.job_id, "distill_started",
                             f"{spec.mode}: teacher {settings.teacher} → {', '.join(settings.students)} "
                             f"({settings.num_students} per base, {settings.peft}); run dir {self.out}")
        self.recovered(f"the run goes on in {self.out}")
        return None

    def _bring_models(self, teacher: str | None, students: list[str], backend: str = "hf",
                      on_coordinator: bool = False) -> Outcome | None:
        """The run's models to the workers that lack them, advertised there, before anything is placed
        (`travel.bring_run_models`): None, or the attempt's Outcome."""
        models = travelling_models(teacher, students, self.ctx.embedded, backend, on_coordinator)
        return bring_run_models(job_report(self.store, self.job_id), models, teacher,
                                stopping=lambda: bool(self.want or self.abandon))

    def poll(self) -> Outcome | None:
        """One step of the run (`DistillSession.step`: the teachers' and students' news, the brokers'
        drain, placement; then `DistillFlow.step`: the mirror, a stop asked): None while it runs."""
        try:
            if self._flow is None:  # the attempt's first step: its settings checked (`check_run`), its tasks made
                # resume=True on a first run too: its run dir is new, so there is nothing to resume from.
                self._flow = DistillFlow(self._settings(), self._session, output_dir=self.out, mode=self.spec.mode,
                                         on_update=self._mirror, should_stop=self._stop_requested, resume=True)
                self._flow.start()
            else:
                self._session.step(STEP_S)
            flow = self._flow
            if not flow.step():
                return None
            summary = flow.finish()
        except DistillStopped as stop:
            self._close()
            return None if stop.what == "abandon" else self.stopped(stop.what)
        except SmolforgeError as err:  # its own making, or its students' restarts spent: not again
            self._close()
            return Failed(err.what, retryable=False, error=err.render())
        except RayError as err:  # the Ray connection (or the driver's node) lost: the next attempt resumes
            self._close()
            return Failed(f"the run lost Ray: {short_error(err)}", error=short_error(err))
        self._close()
        return self._publish(self.out, summary)

    def end_attempt(self) -> None:
        if self._flow is not None:  # (an abandoned attempt: the coordinator going down)
            self._close()

    def _close(self) -> None:
        """Every task of the attempt stopped (their last lines taken first), then the last mirror."""
        flow, self._flow = self._flow, None
        if flow is not None:
            flow.close()
            self._mirror(self._session.distill_tasks(), self._session.events)

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
        if self._session is not None and started(self._session._dstate().run):
            self.ctx.placed(self.job_id)  # Ray's table shows what its tasks hold now: the queue's claim can go
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
            scored = {ev.get("examples") for ev in ok}  # each student scores the one held-out set
            if len(scored) == 1 and None not in scored:
                result["eval"]["examples"] = scored.pop()
        total = sum(int(t.get("max_steps") or 0) for t in summary["student_tasks"])
        self.store.update_job(self.job_id, step=total, max_steps=total)
        return Completed(f"completed: {len(summary['student_tasks'])} students, "
                         f"{summary['store']['bytes_per_token']:.1f} bytes/token store", result=result)


# -- the seeds' calls as jobs (specs.DistillTaskJob) ---------------------------------------------------

TASK_ID = re.compile(r"^(?P<job>.+)-(?P<task>(?:teacher|student|aggregate)-\d+)$")
STAGE_WAIT_S = 0.5  # how often a stage looks at its tasks (and at the jobs it waits for)
TEACHERS_SETTLE_S = 5.0  # every teacher ended with shards missing: a retry may still be starting


def split_task_id(task_id: str) -> tuple[str, str] | None:
    """`job-1a2b3c4d5e-student-3` -> (`job-1a2b3c4d5e`, `student-3`); None for anything else."""
    m = TASK_ID.match(task_id)
    return (m.group("job"), m.group("task")) if m else None


class StageSession(DistillSession):
    """A stage's DistillSession: its tasks share the nodes with other jobs' (several stage jobs run at
    once), so a node's busy CPUs are what Ray holds there, not only this session's own tasks; a
    student placed on a node another job's student fills would wait there while another node idles."""

    def _busy_cpus(self) -> dict[str, float]:
        return busy_cpus(super()._busy_cpus(), self._nodes())


class DistillTaskRunner(DistillRunner):
    """One of the seeds' distillation calls as a job: a teacher stage writes a store, a students stage
    trains on a finished teacher job's store, an aggregate stage merges finished students' adapters.

    Each drives a DistillSession as `distill` does (so the tasks, their restarts and rotation are the
    same), and mirrors it into the job store the same way: its tasks are the job's task rows,
    `<job>-teacher-N` / `<job>-student-N`, which any process reads. What a stage writes is kept in its
    run dir (`distill/<job>/`, or the embedded job's output_dir) and published as artifacts for the
    client: the store (`store/teacher_outputs`), each student's output (`student/student_N`, without
    its checkpoints) and the merged adapter (`adapter/final_adapter`). Stopped (pause, cancel, a
    coordinator going down), a stage runs again in the same run dir: valid shards and student
    checkpoints are reused.
    """

    def __init__(self, ctx: RunnerContext, job_id: str, spec: DistillTaskJob, reason: str):
        super().__init__(ctx, job_id, spec, reason)  # type: ignore[arg-type]
        self.spec: DistillTaskJob = spec  # type: ignore[assignment]
        if spec.output_dir and ctx.embedded:
            self.out = Path(spec.output_dir)

    def start_attempt(self) -> Outcome | None:
        spec = self.spec
        if not self.ctx.embedded and (spec.store_dir or spec.student_dirs):
            return Failed("store_dir and student_dirs name directories on the embedded cluster's machine",
                          retryable=False, error="a coordinator reads only its own jobs' stores and adapters: "
                          "give teacher_job / student_tasks")
        cluster, a = ray_glue.connect(), spec.args
        if spec.stage != "aggregate":  # a stage's models travel as the whole run's do
            teacher, bases = (a.get("model_path"), []) if spec.stage == "teacher" else (None, a.get("base_model"))
            moved = self._bring_models(teacher if isinstance(teacher, str) else None,
                                       bases if isinstance(bases, list) else [bases],
                                       str(a.get("backend") or "hf"), bool(a.get("teacher_on_coordinator")))
            if moved is not None:
                return moved
        self._session, self._events_seen = StageSession(cluster, spec.mode, driven=True), 0
        self.store.add_event(self.job_id, "distill_task_started", f"{spec.stage} stage; run dir {self.out}",
                             {"stage": spec.stage})
        self.recovered(f"the {spec.stage} stage goes on in {self.out}")
        return None

    def poll(self) -> Outcome | None:
        stage = {"teacher": self._teacher_stage, "students": self._students_stage,
                 "aggregate": self._aggregate_stage}[self.spec.stage]
        try:
            return stage()
        except DistillStopped as stop:
            return None if stop.what == "abandon" else self.stopped(stop.what)
        except TypeError as err:  # the call's arguments, as the job file gave them
            return Failed(f"the {self.spec.stage} call's arguments: {err}", retryable=False, error=str(err))
        except SmolforgeError as err:
            return Failed(err.what, retryable=False, error=err.render())
        except RayError as err:
            return Failed(f"the stage lost Ray: {short_error(err)}", error=short_error(err))
        finally:
            self._session.shutdown_distill()  # its tasks' last lines first, then the last mirror
            self._sync()

    def end_attempt(self) -> None:
        if self._session is not None and not self._session._dstate().closing:
            self._session.shutdown_distill()

    # -- the stages --------------------------------------------------------------------------------

    def _teacher_stage(self) -> Outcome:
        s = self._session
        s.create_parallel_teacher_tasks(**self._call_args("dataset_path"), output_dir=self.out)
        store = next(iter(s._dstate().stores.values()))
        settled = [0.0]

        def done() -> bool:
            teachers = [t for t in s.distill_tasks() if t["kind"] == "teacher"]
            if any(t["state"] in ("pending", "running") for t in teachers):
                settled[0] = 0.0
                return False
            if len(store.written) >= store.plan.num_shards:
                return True
            settled[0] = settled[0] or time.time()
            return time.time() - settled[0] > TEACHERS_SETTLE_S

        self._follow(done)
        missing = sorted(set(range(store.plan.num_shards)) - store.written)
        if missing:
            errors = [t["error"] for t in s.distill_tasks() if t["kind"] == "teacher" and t.get("error")]
            raise SmolforgeError(f"shards {missing} were not written: {errors[-1] if errors else 'teachers stopped'}",
                                 fix="see the job's events; the shards written are kept and reused by a rerun")
        self.ctx.artifacts.put_dir(self.job_id, "store", "teacher_outputs", store.dir)
        n = store.plan.num_shards
        self.store.update_job(self.job_id, step=n, max_steps=n)
        return Completed(f"completed: {n} shards in {store.dir}",
                         result={"store": str(store.dir), "shards": n, "teacher": store.plan.teacher,
                                 "summary": store_summary(store.dir)})

    def _students_stage(self) -> Outcome:
        s = self._session
        store_dir = Path(self.spec.store_dir) if self.spec.store_dir else self._teacher_store(self.spec.teacher_job)
        s._dstate().counters["student"] = itertools.count(self.spec.first_student)
        # resume: a stage that runs again continues its students from their kept checkpoints
        ids = s.create_student_tasks(**self._call_args("eval_data", "eval_path"), teacher_outputs_dir=store_dir,
                                     output_dir=self.out, resume=True)
        self._follow(lambda: all(st["state"] in TASK_ENDED for st in map(s.task_status, ids)))
        students = [s.task_status(t) for t in ids]
        failed = [t for t in students if t["state"] != "completed"]
        if failed:
            raise SmolforgeError(f"{failed[0]['task_id']} {failed[0]['state']}: {failed[0].get('error')}",
                                 fix="see the job's events; kept checkpoints are reused by a rerun")
        for t in students:
            if t.get("output_dir"):
                self._publish_student(t["task_id"], Path(t["output_dir"]))
        return Completed(f"completed: {len(ids)} students on {store_dir}",
                         result={"store": str(store_dir),
                                 "students": [{k: t.get(k) for k in ("task_id", "node", "output_dir", "loss", "step")}
                                              for t in students]})

    def _aggregate_stage(self) -> Outcome:
        dirs = [d for d in (self._student_dir(t) for t in self.spec.student_tasks) if d] + list(self.spec.student_dirs)
        target = self.out if self.spec.output_dir and self.ctx.embedded else self.out / "merged_model"
        # the values checked at submit (`stage_args`: AggregateSettings), as they were checked
        report = self._session.aggregate_student_outputs(dirs, target, **typed_args("aggregate", self.spec.args))
        self._sync()
        final = Path(report["output"])
        self.ctx.artifacts.put_dir(self.job_id, "adapter", final.name, final)
        report = {k: v for k, v in report.items() if k != "truncation_error"}
        return Completed(f"completed: {len(dirs)} students merged into {final}", result=report)

    # -- what the stages share -----------------------------------------------------------------------

    def _call_args(self, *data_keys: str) -> dict[str, Any]:
        """The call's keyword arguments, typed as checked at submit (`stage_args.typed_args`: a TaskConfig's
        dict a TaskConfig), its dataset files (DATA_KEYS) read from the coordinator's uploads."""
        args = typed_args(self.spec.stage, self.spec.args)
        for key in data_keys:
            value = args.get(key)
            if isinstance(value, str) and value.startswith("upload:"):
                args[key] = str(self.ctx.artifacts.upload_path(value.split(":", 1)[1]))
        return args

    def _sync(self) -> None:
        if self._session is not None:
            self._mirror(self._session.distill_tasks(), self._session.events)
            if self.spec.stage == "teacher":
                teachers = [t for t in self._session.distill_tasks() if t["kind"] == "teacher"]
                total = sum(len(t["shards"]) for t in teachers)
                self.store.update_job(self.job_id, step=sum(len(t["done_shards"]) for t in teachers), max_steps=total)

    def _follow(self, done: Callable[[], bool]) -> None:
        """Mirror the session until `done()`; a pause, cancel or shutdown stops every task (DistillStopped)."""
        while True:
            self._sync()
            stop = self._stop_requested()
            if stop:
                if stop == "pause":
                    self._session.pause_distill_students([t["task_id"] for t in self._session.distill_tasks()])
                raise DistillStopped(stop)
            if done():
                return
            self._session.tick(STAGE_WAIT_S)  # one step of its tasks (no monitor thread: this loop drives them)

    def _await_job(self, job_id: str, why: str) -> dict[str, Any]:
        """The job this stage reads from, once it has completed (said once in the events while it waits)."""
        said = False
        while True:
            job = self.store.get_job(job_id)
            if succeeded(job["state"]):
                return job
            if ended_unsuccessfully(job["state"]):
                raise SmolforgeError(f"{why}: job {job_id} {job['state']}: {job.get('error') or ''}".rstrip(": "),
                                     fix=f"see `smolforge job logs {job_id}`; run that task again, then this one")
            if not said:
                self.store.add_event(self.job_id, "waiting", f"waiting for job {job_id} ({why}; it is {job['state']})",
                                     {"job": job_id})
                said = True
            stop = self._stop_requested()
            if stop:
                raise DistillStopped(stop)
            time.sleep(STAGE_WAIT_S)

    def _run_dir_of(self, job: dict[str, Any]) -> Path:
        out = (job.get("spec") or {}).get("output_dir")
        return Path(out) if out and self.ctx.embedded else run_dir(self.ctx.artifacts, job["id"])

    def _teacher_store(self, job_id: str) -> Path:
        job = self._await_job(job_id, "its teacher store")
        return store_dir_of(self._run_dir_of(job))

    def _student_dir(self, task_id: str) -> str | None:
        """A student task's output dir, from its (completed) students job; None for a ddp group's other ranks."""
        parts = split_task_id(task_id)
        if parts is None or not parts[1].startswith("student-"):
            raise SmolforgeError(f"{task_id} is not a student task id", where="student_tasks",
                                 fix="give ids create_student_tasks returned (<job>-student-N)")
        job = self._await_job(parts[0], f"the adapter of {task_id}")
        rows = {t["task_id"]: t for t in (job.get("result") or {}).get("students", [])}
        if parts[1] not in rows:
            raise SmolforgeError(f"job {parts[0]} has no student {parts[1]}", where="student_tasks",
                                 fix="give ids create_student_tasks returned")
        return rows[parts[1]].get("output_dir")

    def _publish_student(self, task_id: str, out: Path) -> None:
        """A student's adapter and summary (not its checkpoints) as the job's `student/student_N` artifact."""
        files = {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
                 if p.is_file() and not p.is_symlink() and "checkpoints" not in p.relative_to(out).parts}
        payload = {"files": files, "sha256": {k: sha256_bytes(v) for k, v in files.items()}}
        self.ctx.artifacts.put(self.job_id, "student", out.name, payload)
