"""The whole distillation run as one call: teachers → streaming students → aggregation.

`run_distill` is what a distill job runs (`smolforge distill`, `launch --mode teacher_student|hybrid`,
`submit` of a `kind: distill` file): it drives a DistillTasks session on the cluster (a coordinator's,
or the embedded one), shows progress, and writes the seed layout (see smolforge.distill.settings).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from smolforge.cluster.workloads.distill.plans import (
    StudentCall, StudentPlan, TeacherCall, TeacherPlan, plan_students, plan_teachers,
)
from smolforge.cluster.workloads.distill.sync import AverageSync, DataParallelSync
from smolforge.distill.backends import teacher_backend
from smolforge.distill.settings import DistillSettings, _slug, check_run
from smolforge.distill.store import store_summary
from smolforge.errors import SmolforgeError, in_spec
from smolforge.paths import atomic_write_json


class _Progress:
    """A rich progress bar per teacher (shards) and per student (steps), with rate and ETA."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self._p = None
        self._rows: dict[str, Any] = {}
        if quiet:
            return
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self._p = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                           TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                           console=Console(stderr=True), refresh_per_second=4)
        self._p.start()

    def update(self, statuses: list[dict[str, Any]]) -> None:
        if self._p is None:
            return
        for s in statuses:
            if s["kind"] == "aggregate":
                continue
            if s["kind"] == "teacher":
                total, done = len(s["shards"]), len(s["done_shards"])
                unit = "shards"
            else:
                total = max(1, int(s.get("samples_total") or 1))
                done = int(s.get("samples_done") or 0) if s["state"] != "completed" else total
                unit = "samples"
            state = "queued" if s.get("queued") else s["state"]
            info = f"{state} · {s.get('node') or '-'} · {unit}"
            if s["task_id"] not in self._rows:
                self._rows[s["task_id"]] = self._p.add_task(s["task_id"], total=total, info=info)
            self._p.update(self._rows[s["task_id"]], total=total, completed=done, info=info)

    def close(self) -> None:
        if self._p is not None:
            self._p.stop()


class DistillStopped(Exception):
    """`should_stop` asked for a pause or a cancel: every task was stopped, the valid shards stay."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


def check_job(job: Any) -> None:
    """A distill job's settings, checked once, when it is submitted (`kinds.KINDS["distill"].check`, which
    `smolforge distill` and `launch` call through `kinds.parse` before any cluster starts): across
    fields and into other modules' settings (`check_run`; a spec's `output_dir` is `kinds.check_output_dir`'s,
    the CLI flag `settings.check_output_flag`'s), and the run's two plans (`distill_plans`: the PEFT
    config, the students' sync plug-in with its strategy, ...). The runner takes the checked spec as
    it is and builds the same plans from it."""
    with in_spec("distill"):  # a refusal names its settings, at a spec's line (`config.placed`)
        check_run(job.distill, job.mode)
        check_held_out(job.distill.eval_data)
        distill_plans(job.distill, job.mode, Path(job.output_dir or "."))  # (the calls' keys are the settings')


def check_held_out(eval_data: str | None) -> None:
    """The held-out file `distill.eval_data` (`--eval-data`) names, read by the one reader
    (`data.formats.read_examples`; answers needed, the eval loss is over them) while it is a path on this
    machine (`smolforge distill` checks its spec so, before staging it): a bad line is refused at its
    FILE:LINE before a teacher runs, a missing file before the run dir is touched (a spec that `submit` stages
    is read so there: `JobKind.read_at_submit`). A staged upload or a built-in set ('bundled') is the
    students' run's, which reads it the same way. SmolforgeError (exit 2)."""
    from smolforge.cluster.control.kinds import is_local_file
    from smolforge.data.formats import read_examples

    if not is_local_file(eval_data):
        return
    path = Path(str(eval_data)).expanduser()
    if not path.is_file():
        raise SmolforgeError(f"held-out file {eval_data} does not exist", where="distill.eval_data", field=("eval_data",),
                             fix="check the --eval-data path, or name 'bundled' (the generated task set's held-out file)")
    read_examples(path, skip_hint=False)


class DistillFlow:
    """One distillation run in steps: `start` (its teacher and student tasks), `step` (one look at
    them: None while they run), `finish` (aggregation and the summary), `close` (every task stopped).

    `on_update(task statuses, events so far)` is called at every step (the coordinator's job runner
    mirrors them into its job store); when `should_stop()` returns "pause" or "cancel" every task
    is stopped and DistillStopped is raised. Shards already written stay valid: a rerun into the
    same output dir reuses them. On "pause" the students first checkpoint the steps they have
    done; a rerun with `resume=True` continues each student from its checkpoint.
    """

    def __init__(self, cfg: DistillSettings, orch, *, output_dir: str | Path, mode: str = "teacher_student",
                 quiet: bool = True, on_update: Callable[[list[dict[str, Any]], list[dict[str, Any]]], None] | None = None,
                 should_stop: Callable[[], str | None] | None = None, resume: bool = False):
        self.cfg, self.orch, self.out = cfg, orch, Path(output_dir)
        # the settings were checked at submit (`check_job`): built once here, the plans travel whole
        self.teacher_plan, self.student_plan = distill_plans(cfg, mode, self.out, resume)
        self.sync = self.student_plan.sync  # its name and what aggregation does
        self.on_update, self.should_stop = on_update, should_stop
        self.t0, self.teacher_done = time.time(), None
        self.progress = _Progress(quiet)
        self.teachers: list[str] | None = None
        self.students: list[str] = []

    def start(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.teachers = self.orch.start_teachers(self.teacher_plan)
        # (the students stream the teachers' shards as they appear)
        self.students = self.orch.start_students(self.student_plan)

    def step(self) -> bool:
        """One look at the tasks: True once every one has ended (or paused). A stop asked through
        `should_stop` raises DistillStopped (a pause checkpoints first)."""
        orch, ids = self.orch, (self.teachers or []) + self.students
        statuses = orch.distill_tasks()
        mine = [s for s in statuses if s["task_id"] in ids]
        self.progress.update(mine)
        if self.on_update is not None:
            self.on_update(mine, list(orch.events))
        stop = self.should_stop() if self.should_stop is not None else None
        if stop:
            if stop == "pause":
                orch.pause_distill_students(self.students)
                if self.on_update is not None:
                    self.on_update(orch.distill_tasks(), list(orch.events))
            raise DistillStopped(stop)  # `close` stops every task and actor
        by_id = {s["task_id"]: s for s in statuses}
        if self.teacher_done is None and all(by_id[t]["state"] in ("completed", "failed", "cancelled")
                                             for t in self.teachers or []):
            self.teacher_done = time.time()
        return all(by_id[t]["state"] in ("completed", "failed", "cancelled", "paused") for t in ids)

    def finish(self) -> dict[str, Any]:
        """Every task has ended: the students' states decide the run (a failed teacher's shards went to
        another teacher, or the students that needed them failed saying why); aggregate; the summary."""
        cfg, orch, out, students = self.cfg, self.orch, self.out, self.students
        self.progress.close()
        failed = [s for s in map(orch.task_status, students) if s["state"] == "failed"]
        if failed:
            raise SmolforgeError(f"{failed[0]['task_id']} failed: {failed[0]['error']}",
                                 fix="see the error above; fix it and rerun (valid teacher shards are reused)")
        stages = {"teachers": (self.teacher_done or time.time()) - self.t0, "students": time.time() - self.t0}
        t_agg = time.time()
        merged = _aggregate(cfg, orch, out, students, self.sync)
        stages["aggregate"] = time.time() - t_agg
        summary = {
            "output_dir": str(out),
            "teacher": cfg.teacher,
            "students": cfg.students,
            "store": store_summary(out / "teacher_outputs"),
            "teacher_tasks": [orch.task_status(t) for t in self.teachers or []],
            "student_tasks": [{**orch.task_status(t), "eval": _eval_of(orch, t)} for t in students],
            "students_sync": self.sync.name,
            "per_student": [_student_line(orch, t) for t in students],
            "merged": merged,
            "stage_seconds": stages,
            "seconds": time.time() - self.t0,
            "events": list(orch.events),
        }
        atomic_write_json(out / "distill_summary.json", _jsonable(summary))
        return summary

    def close(self) -> None:
        self.progress.close()
        self.orch.shutdown_distill()


def run_distill(cfg: DistillSettings, orch, *, output_dir: str | Path, mode: str = "teacher_student",
                quiet: bool = True,
                on_update: Callable[[list[dict[str, Any]], list[dict[str, Any]]], None] | None = None,
                should_stop: Callable[[], str | None] | None = None, resume: bool = False) -> dict[str, Any]:
    """Teachers, students, aggregation on `orch` (a DistillTasks session); returns (and writes) the
    summary: a `DistillFlow` stepped until its tasks end (see it for `on_update` and `should_stop`)."""
    flow = DistillFlow(cfg, orch, output_dir=output_dir, mode=mode, quiet=quiet, on_update=on_update,
                       should_stop=should_stop, resume=resume)
    try:
        flow.start()
        while not flow.step():
            orch.tick(0.5)
        return flow.finish()
    finally:
        flow.close()


def distill_plans(cfg: DistillSettings, mode: str, out: Path, resume: bool = False) -> tuple[TeacherPlan, StudentPlan]:
    """The run's teacher and student plans from its settings: the seeds' two calls a run is (into
    `out/teacher_outputs/`, its students reading that store), checked by the builders the seeds' calls
    ask (`plans.plan_teachers`, `plans.plan_students`). SmolforgeError for what they refuse."""
    teachers = TeacherCall(
        cfg.teacher, cfg.data, out, batch_size=cfg.teacher_batch_size, max_samples=cfg.max_samples,
        num_teachers=cfg.num_teachers, compress_outputs=cfg.compress_outputs, top_k=cfg.top_k,
        temperature=cfg.gen_temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
        samples_per_prompt=cfg.samples_per_prompt, num_shards=cfg.num_shards, backend=cfg.teacher_backend,
        cpus_per_teacher=cfg.cpus_per_teacher, device=cfg.device, dtype=cfg.teacher_dtype,
        ollama_host=cfg.ollama_host, teacher_url=cfg.teacher_url, teacher_key_file=cfg.teacher_key_file, seed=cfg.seed,
        responses=cfg.teacher_responses, teacher_on_coordinator=cfg.teacher_on_coordinator, quant=cfg.teacher_quant,
        # a GGUF file's vocabulary must be the (first) student's; an HF teacher's export keeps its own tokenizer
        tokenizer=teacher_backend(cfg.teacher_backend).tokenizer_for(cfg.students))
    students = StudentCall(
        cfg.students, out / "teacher_outputs", num_students=cfg.num_students, peft_type=cfg.peft,
        peft_config=cfg.peft_config, output_dir=out, split_shards=cfg.split_shards, kd_loss=cfg.kd_loss,
        kd_ratio=cfg.kd_ratio, temperature=cfg.temperature, beta=cfg.beta, max_steps=cfg.max_steps,
        epochs=cfg.epochs, batch_size=cfg.batch_size, grad_accum=cfg.grad_accum, lr=cfg.lr,
        warmup_steps=cfg.warmup_steps, max_length=cfg.max_length, seed=cfg.seed, save_every=cfg.save_every,
        replace_timeout_s=cfg.replace_timeout_s, on_policy_ratio=cfg.on_policy_ratio,
        on_policy_temperature=cfg.on_policy_temperature, on_policy_start=cfg.on_policy_start,
        cpus_per_student=cfg.cpus_per_student, eval_data=cfg.data if cfg.eval else None,
        eval_path=cfg.eval_data if cfg.eval else None,
        max_eval_samples=cfg.max_eval_samples, max_new_tokens=cfg.eval_max_new_tokens, device=cfg.device,
        dtype=cfg.student_dtype, teacher_dtype=cfg.teacher_dtype,
        resume=resume, students_sync=cfg.students_sync, students_strategy=cfg.students_strategy)
    return plan_teachers(teachers), plan_students(students, mode)


def _aggregate(cfg: DistillSettings, orch, out: Path, students: list[str],
               sync: type[AverageSync] | type[DataParallelSync]) -> dict[str, Any]:
    """Merge each student base's adapters into `merged_model/` (`cfg.aggregate`); prefix and prompt
    adapters, which cannot be merged, are skipped saying why."""
    merged: dict[str, Any] = {}
    if cfg.aggregate == "none":
        return merged
    for base in cfg.students:
        mine = [t for t in students if orch.task_status(t).get("output_dir") and _base_of(orch, t) == base]
        target = out / "merged_model" / ("final_adapter" if len(cfg.students) == 1 else f"{_slug(base)}/final_adapter")
        try:
            merged[base] = {**orch.aggregate_student_outputs(mine, target, method=cfg.aggregate,
                                                             rank=cfg.aggregate_rank),
                            "students_sync": sync.name, "merge": sync.merges}
        except SmolforgeError as err:
            from smolforge.models.peft import peft_method

            if not peft_method(cfg.peft).aggregates:
                merged[base] = {"skipped": err.what}
            else:
                raise
    return merged


def _base_of(orch, task_id: str) -> str | None:
    task = orch._dstate().tasks.get(task_id)
    return task.plan.config.base_model if task is not None and task.plan is not None else None


def _student_line(orch, task_id: str) -> dict[str, Any]:
    """One student's line of the summary: its base, steps, final loss, eval and where its adapter is
    (none for the other ranks of a ddp group: their group's adapter is its first member's)."""
    task = orch._dstate().tasks[task_id]
    seat = task.seat
    return {"task_id": task_id, "base": _base_of(orch, task_id), "state": task.state,
            "steps": task.result.get("steps", task.step), "loss": task.result.get("final_loss", task.loss),
            "kd": task.result.get("mode"), "eval": dict(task.result.get("eval", {})), "output_dir": task.output_dir,
            "group": {"members": list(seat.members), "rank": seat.rank, "strategy": seat.strategy} if seat else None}


def _eval_of(orch, task_id: str) -> dict[str, Any]:
    task = orch._dstate().tasks.get(task_id)
    return dict(task.result.get("eval", {})) if task is not None else {}


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))
