"""`create_distributed_training(...)` and the `Orchestrator`, with the seeds' names.

    from smolforge import create_distributed_training
    orch = create_distributed_training(mode="data_parallel", coordinator="192.168.1.10:5000", token="…")
    orch.discover_nodes()
    [job] = orch.create_data_parallel_tasks("tiny-llama", "data.jsonl", num_workers=2, batch_size=4, max_steps=100)
    orch.monitor_tasks([job], callback=lambda task_id, status: print(task_id, status["state"], status["progress"]))

With no coordinator given or configured, the orchestrator runs an embedded cluster of this machine
(the same scheduler and worker-group code). A data-parallel worker group is one task: its id is the
job id, and its status names every node of the group.

The distillation tasks (`create_teacher_task`, `create_parallel_teacher_tasks`, `create_student_tasks`,
`aggregate_student_outputs`, `reassign_idle_teacher_as_student`) are jobs: each call submits one
`distill_task` job (specs.DistillTaskJob: a teacher, students or aggregate stage) to the coordinator,
or to the embedded cluster when none is configured, as every command does. So they show in
`smolforge jobs` and on the dashboard, outlive the script on a coordinator (and its restart), and a
task id is `<job>-teacher-N` / `<job>-student-N`: `monitor_tasks` follows it from any process. Students
read a finished teacher job's store (their job waits for it); `create_student_tasks` without
`teacher_outputs_dir` takes this orchestrator's last teacher task's, and says so. On a coordinator the
results come back to the paths the calls named: a task's outputs are downloaded when `monitor_tasks`
sees its job complete, the merged adapter when `aggregate_student_outputs` returns (the embedded
cluster writes them there itself).

`wait_distill` waits for tasks as `monitor_tasks` follows them, and raises if one failed (the demo's
wait, `smolforge demo`); `shutdown_distill` stops what runs in this process (a job runs on its cluster).

On a bare Ray handle (a backend with no jobs: the distill tests' clusters) the same calls run the
tasks in this process: the orchestrator holds a `DistillSession` (`smolforge.cluster.face`, what the
distill job runner drives) on that handle, made at the first call, and hands the calls to it; its
events are this orchestrator's `events`, its tasks' output lines go to `log_lines` when one is set.
Only the seeds' calls named here go to it; a caller that looks inside its run asks `distill_session()`.
"""

from __future__ import annotations

import atexit
import sys
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from smolforge.client import backend_for
from smolforge.cluster.control.jobview import job_task_status
from smolforge.cluster.control.specs import TaskConfig
from smolforge.cluster.face import (StudentCall, TeacherCall, holds_jobs, plan_students, plan_teachers, split_task_id,
                                    store_dir_of)
from smolforge.config import EVAL_SPLIT_KEY, check_call_dataset
from smolforge.distill.aggregate import final_adapter_path
from smolforge.errors import SmolforgeError

if TYPE_CHECKING:
    from smolforge.cluster.face import DistillSession

MODES = ("data_parallel", "teacher_student", "hybrid")
FINAL_STATES = ("completed", "failed", "cancelled")
UNREACHABLE_GRACE_S = 180.0  # monitor_tasks rides out a coordinator restart this long

class Orchestrator:
    """The seeds' façade over a Backend's jobs (the module docstring), or over a bare Ray handle's
    in-process DistillSession."""

    log_lines: Callable[[list[dict[str, Any]]], None] | None = None  # a bare handle's tasks' output lines

    def __init__(self, mode: str = "data_parallel", config: dict[str, Any] | None = None, *, backend: Any = None,
                 coordinator: str | None = None, token: str | None = None, state_dir: str | Path | None = None):
        if mode not in MODES:
            raise SmolforgeError(f"unknown mode {mode!r}", fix=f"use one of {', '.join(MODES)}")

        self.mode = mode
        self.config = dict(config or {})
        host, port = self.config.pop("sollol_host", None), self.config.pop("sollol_port", None)
        if host and not coordinator:  # the seeds' way to name the server: config={"sollol_host": H, "sollol_port": P}
            coordinator = f"{host}:{port or 5000}"
        self.backend = backend or backend_for(coordinator, token, state_dir, embedded_ok=True)
        self.events: list[dict[str, Any]] = []
        self._cluster = None
        self._token = token
        # The seeds' tasks as jobs, unless the backend is a bare Ray handle (no job API): in-process
        self._as_jobs = holds_jobs(self.backend)
        self._mine: dict[str, dict[str, Any]] = {}  # task id -> {job, fetch: (kind, name, local dir) or None}
        self._teacher_jobs: dict[str, str] = {}  # a teacher store's local path -> its job
        self._student_dirs: dict[str, str] = {}  # a student's local output dir -> its task id
        self._last_teacher: tuple[str, Path] | None = None  # (job, local store) of the last teacher call
        self._next_student = 0  # student_N numbering across this orchestrator's calls (the seeds' layout)
        self._fetched: set[tuple[str, str, str]] = set()
        self._exit_hook = False
        self._unreachable_since: float | None = None  # monitor_tasks: since when the coordinator is silent
        self._session: Any = None  # on a bare Ray handle: the DistillSession the seeds' calls go to

    def __repr__(self) -> str:
        return f"Orchestrator(mode={self.mode!r}, backend={self.backend!r})"

    # -- shared plumbing -------------------------------------------------------------------------

    @property
    def cluster(self):
        """The Ray cluster behind the backend, connected on first use (ray_glue.ClusterHandle)."""
        if self._cluster is None:
            # a Backend's cluster (Client: joined as a driver; embedded: its own), or the bare handle held
            self._cluster = self.backend.ray_cluster() if self._as_jobs else self.backend.handle
            # A seed script just ends: our driver threads must stop before Ray's own exit hook shuts
            # Ray down (a thread still calling Ray then kills the process with exit code 1). atexit runs
            # hooks last-registered first, and Ray registered its hook when this process connected.
            atexit.register(_shutdown_at_exit, weakref.ref(self))
        return self._cluster

    def log_event(self, kind: str, message: str, **data: Any) -> None:
        self.events.append({"ts": time.time(), "kind": kind, "message": message, "data": data})

    def _in_process(self) -> DistillSession:
        """The DistillSession the seeds' distillation calls go to on a bare Ray handle (made on first
        use, on `cluster`; monitor-thread driven). SmolforgeError on a Backend: its tasks are jobs."""
        if self._as_jobs:
            raise SmolforgeError("this orchestrator's distillation tasks are jobs, not in this process",
                                 fix="follow them by task id (monitor_tasks, task_status)")
        if self._session is None:
            from smolforge.cluster.face import DistillSession

            self._session = DistillSession(self.cluster, self.mode, events=self.events, on_lines=self._task_lines)
        return self._session

    def _task_lines(self, lines: list[dict[str, Any]]) -> None:
        if self.log_lines is not None:
            self.log_lines(lines)

    def distill_session(self) -> DistillSession:
        """The DistillSession this orchestrator's distillation calls go to on a bare Ray handle, for a caller
        that looks inside the run (a test: its `_dstate()`, `_eval_examples`). SmolforgeError on a Backend:
        its tasks are jobs, followed by task id (`task_status`, `monitor_tasks`)."""
        return self._in_process()

    def close(self) -> None:
        self.backend.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the seeds' API ----------------------------------------------------------------------------

    def discover_nodes(self) -> list[dict[str, Any]]:
        """Every node with CPUs, RAM, GPUs, models, role and state: today's flat keys (cpus, gpus,
        ram_gb, models, ollama_models) and the seeds' nested ones (`n['resources']['gpu']['count']`,
        `['cpu']['cores']`, `['memory']['total_gb']`, `['ollama_models']`); see cluster/nodes/nodeview.py."""
        nodes = self.backend.list_nodes()
        self.log_event("discover", f"{len(nodes)} nodes", names=[n["name"] for n in nodes])
        return nodes

    def create_data_parallel_tasks(self, model_path: str, dataset_path: str | None = None, num_workers: int = 2,
                                   batch_size: int = 4, epochs: float = 1.0, max_length: int = 256,
                                   peft: str = "lora", lora_r: int = 8, lora_alpha: float = 16,
                                   max_steps: int | None = None, lr: float | None = None,
                                   save_every: int | None = None, seed: int = 0, max_retries: int | None = None,
                                   cpus_per_worker: float | None = None, name: str | None = None,
                                   task_config: TaskConfig | None = None, dataset_name: str | None = None,
                                   dataset_config: str | None = None, dataset_split: str | None = None,
                                   dataset_column: str | None = None, dataset_eval_split: str | None = None,
                                   **train_overrides: Any) -> list[str]:
        """Submit one data-parallel job (a group of `num_workers` ranks); returns `[job_id]`.

        `batch_size` is per worker; the global batch is batch_size x num_workers. `task_config` (the
        seeds' TaskConfig) sets the job's name, priority, per-worker resources, max_retries and
        checkpointing (an argument that says otherwise is an error). The data is `dataset_path` (a JSONL
        file or 'bundled') or a dataset by name, as `--dataset-name` ... `--dataset-eval-split`: the spec's
        `train.data.dataset_name` ... fields, read where the job is submitted. SmolforgeError for both,
        neither, or a companion without `dataset_name` (`config.check_call_dataset`).
        """
        named = check_call_dataset("create_data_parallel_tasks", "dataset_path", dataset_path, {
            "dataset_name": dataset_name, "dataset_config": dataset_config, "dataset_split": dataset_split,
            "dataset_column": dataset_column, EVAL_SPLIT_KEY: dataset_eval_split},
            eval_file=train_overrides.get("eval_path", self.config.get("train", {}).get("eval_path")))
        data = {"path": dataset_path} if dataset_path is not None else named
        train: dict[str, Any] = {"model": model_path, "data": {**data, "max_length": max_length},
                                 "peft": {"method": peft, "r": lora_r, "alpha": lora_alpha},
                                 "batch_size": batch_size, "epochs": epochs, "seed": seed}
        for key, value in (("max_steps", max_steps), ("lr", lr), ("save_every", save_every)):
            if value is not None:
                train[key] = value
        data_keys = {"format", "eval_path", "eval_fraction", "max_eval_samples", "max_samples", "packing",
                     "skip_bad_lines"}
        for key, value in {**self.config.get("train", {}), **train_overrides}.items():
            if key in data_keys:
                train["data"][key] = value
            else:
                train[key] = value
        spec = {"kind": "data_parallel", "name": name, "num_workers": num_workers, "train": train,
                **{k: v for k, v in self.config.items() if k != "train"}}
        for key, value in {**(task_config.job_fields() if task_config else {}),
                           "max_retries": max_retries, "cpus_per_worker": cpus_per_worker}.items():
            if value is None:
                continue
            if spec.get(key) is not None and spec[key] != value:
                raise SmolforgeError(f"{key} is {spec[key]} in one place and {value} in another",
                                     where="create_data_parallel_tasks", fix=f"give {key} once")
            spec[key] = value
        job_id = self.backend.submit_job(spec)
        self.log_event("submitted", f"data-parallel job {job_id} on {num_workers} workers", job_id=job_id)
        return [job_id]

    def task_status(self, task_id: str) -> dict[str, Any]:
        """A task's status from any process: a job id, a job's task (`<job>-student-N`), or a task this
        orchestrator runs in-process."""
        return self._statuses([task_id])[task_id]

    def _statuses(self, task_ids: list[str]) -> dict[str, dict[str, Any]]:
        """Each task's status, asking each job once."""
        jobs: dict[str, dict[str, Any]] = {}
        out = {}
        for tid in task_ids:
            st = self._session._local_task_status(tid) if self._session is not None else None
            if st is not None:
                out[tid] = st
                continue
            job_id, name = split_task_id(tid) or (tid, None)
            if job_id not in jobs:
                jobs[job_id] = self.backend.get_job_status(job_id)
            out[tid] = jobs[job_id] if name is None else job_task_status(jobs[job_id], f"{job_id}-{name}")
        return out

    def monitor_tasks(self, task_ids: list[str], callback: Callable[[str, dict], None] | None = None,
                      poll: float = 1.0, timeout: float | None = None) -> dict[str, dict[str, Any]]:
        """Watch tasks until each is completed, failed or cancelled (or paused).

        `callback(task_id, status)` runs whenever a task's state or progress changes; status holds
        state, progress, node (and nodes), samples_done/total, eta_s and error. Without a callback the
        seeds' progress lines are printed (`[⠋] Task ID - RUNNING (node)`, `[✓] All tasks completed`). Any process can follow
        any task (ids are `<job>-<task>`); this orchestrator's own tasks also bring their outputs to the
        paths their calls named when their job completes. A coordinator that is restarting is waited
        for (UNREACHABLE_GRACE_S).
        """
        if callback is None:  # the seeds' lines (telemetry/task_lines.py), and theirs to close
            from smolforge.telemetry.task_lines import SeedLines

            lines = SeedLines()
            statuses = self.monitor_tasks(task_ids, lines, poll, timeout)
            lines.done(statuses)
            return statuses
        deadline = None if timeout is None else time.time() + timeout
        last: dict[str, tuple] = {}
        statuses: dict[str, dict] = {}
        while True:
            got = self._poll_statuses(task_ids)
            for tid in task_ids if got is not None else []:
                st = statuses[tid] = got[tid]
                self._fetch_outputs(tid, st)
                key = (st.get("state"), round(float(st.get("progress") or 0.0), 4), st.get("node"))
                if last.get(tid) != key:
                    last[tid] = key
                    callback(tid, st)
            if got is not None and all(s.get("state") in FINAL_STATES + ("paused",) for s in statuses.values()) \
                    and not any(self._publishing(tid, st) for tid, st in statuses.items()):
                return statuses
            if deadline and time.time() > deadline:
                return statuses
            time.sleep(poll)

    def _poll_statuses(self, task_ids: list[str]) -> dict[str, dict[str, Any]] | None:
        """The tasks' statuses, or None while the coordinator does not answer (a restart), for a while."""
        try:
            got = self._statuses(task_ids)
        except SmolforgeError as err:
            if not err.what.startswith("cannot reach the coordinator"):
                raise
            self._unreachable_since = self._unreachable_since or time.time()
            if time.time() - self._unreachable_since > UNREACHABLE_GRACE_S:
                raise
            return None
        self._unreachable_since = None
        return got

    def wait_distill(self, task_ids: list[str], timeout: float | None = None,
                     callback: Callable[[str, dict], None] | None = None) -> dict[str, dict[str, Any]]:
        """Wait until the distillation tasks end (completed, failed, cancelled or paused); returns their
        statuses. Jobs are followed as `monitor_tasks` follows them (so their outputs come to the paths
        the calls named), `callback(task_id, status)` as it calls it (default: silent); on a bare Ray
        handle, the session's wait. SmolforgeError when one failed, or one has not ended in `timeout` s."""
        if not self._as_jobs:
            return self._in_process().wait_distill(task_ids, timeout=timeout, callback=callback)
        statuses = self.monitor_tasks(task_ids, callback or _silent, timeout=timeout)
        ended = FINAL_STATES + ("paused",)
        running = [t for t in dict.fromkeys(task_ids) if statuses.get(t, {}).get("state") not in ended]
        if running:  # (only past a timeout: monitor_tasks returns when every one has ended)
            raise SmolforgeError(f"distillation tasks did not finish within {timeout or 0:.0f}s: {', '.join(running)}",
                                 fix="check `smolforge jobs`, or raise the timeout")
        failed = [(t, st) for t, st in statuses.items() if st["state"] == "failed"]
        if failed:
            tid, st = failed[0]
            raise SmolforgeError(f"{tid} failed: {st.get('error')}",
                                 fix=f"see `smolforge job logs {(split_task_id(tid) or (tid,))[0]}`")
        return statuses

    def shutdown_distill(self, timeout: float = 15.0) -> None:
        """Stop what runs in this process: a bare Ray handle's session (its threads joined, its actors
        killed; call before Ray goes away). Nothing on a Backend: its jobs run on their cluster (`close`
        ends an embedded one)."""
        if self._session is not None:
            self._session.shutdown_distill(timeout)

    # -- the seeds' distillation tasks, as jobs ------------------------------------------------------

    def create_teacher_task(self, model_path: str, dataset_path: str | None = None, output_dir: str | Path | None = None,
                            batch_size: int = 8, max_samples: int | None = None, **kwargs: Any) -> str:
        """One teacher over the whole dataset (the seeds' name); returns its task id. The dataset as
        `create_parallel_teacher_tasks` takes it (a file, or `dataset_name=` ...)."""
        return self.create_parallel_teacher_tasks(model_path, dataset_path, output_dir, 1, batch_size=batch_size,
                                                  max_samples=max_samples, **kwargs)[0]

    def create_parallel_teacher_tasks(self, model_path: str, dataset_path: str | None = None,
                                      output_dir: str | Path | None = None, num_teachers: int | None = None,
                                      batch_size: int = 8, compress_outputs: bool = True,
                                      max_samples: int | None = None, dataset_name: str | None = None,
                                      dataset_config: str | None = None, dataset_split: str | None = None,
                                      dataset_column: str | None = None, **kwargs: Any) -> list[str]:
        """One teacher job: `num_teachers` teachers (None: one per node holding the model) write the
        store `<output_dir>/teacher_outputs/` (every argument: `cluster/workloads/distill/plans.py`
        TeacherCall; checked here, into its TeacherPlan). Returns the teacher task ids,
        `<job>-teacher-N`; with `num_teachers` None they are known once the job has started, so this
        waits for that. On a bare Ray handle the plan's teachers start in this process. The prompts are
        `dataset_path` or a dataset by name (`dataset_name` [`dataset_config`, `dataset_split`,
        `dataset_column`], read here into one JSONL file by `data.hub`, uploaded as any); SmolforgeError
        for both or neither (`config.check_call_dataset`), or no output_dir."""
        if output_dir is None:
            raise SmolforgeError("no output_dir given", where="create_parallel_teacher_tasks",
                                 fix="pass output_dir (the run dir that gets teacher_outputs/)")
        named = check_call_dataset("create_parallel_teacher_tasks", "dataset_path", dataset_path, {
            "dataset_name": dataset_name, "dataset_config": dataset_config, "dataset_split": dataset_split,
            "dataset_column": dataset_column})
        dataset_path = _read_named(named, "dataset_path").get("dataset_path", dataset_path)
        call = dict(model_path=model_path, dataset_path=dataset_path, output_dir=output_dir, num_teachers=num_teachers,
                    batch_size=batch_size, compress_outputs=compress_outputs, max_samples=max_samples, **kwargs)
        plan = plan_teachers(TeacherCall(**call))  # checked here, at once: a wrong name, what a teacher cannot honour
        if not self._as_jobs:
            return self._in_process().start_teachers(plan)
        args = _call_args(call, drop=("output_dir",))
        out = Path(output_dir).expanduser().resolve()
        job_id = self._submit("teacher", args, name=f"teacher {model_path}", output_dir=out)
        store = store_dir_of(out)
        self._teacher_jobs[str(store)] = job_id
        self._last_teacher = (job_id, store)
        ids = ([f"{job_id}-teacher-{i}" for i in range(num_teachers)] if num_teachers
               else self._started_tasks(job_id, "teacher"))
        for tid in ids:
            self._mine[tid] = {"job": job_id, "fetch": ("store", "teacher_outputs", store)}
        self.log_event("submitted", f"teacher job {job_id}: {len(ids)} teachers of {model_path} into {store}",
                       job_id=job_id, task_ids=ids)
        return ids

    def create_student_tasks(self, base_model: str | list[str], teacher_outputs_dir: str | Path | None = None,
                             num_students: int = 2, peft_type: str = "lora",
                             peft_config: dict[str, Any] | None = None, dataset_name: str | None = None,
                             dataset_config: str | None = None, dataset_split: str | None = None,
                             dataset_column: str | None = None, dataset_eval_split: str | None = None,
                             **kwargs: Any) -> list[str]:
        """One students job on a teacher's store (every argument: `cluster/workloads/distill/plans.py`
        StudentCall; checked here, into its StudentPlan); returns the student task ids,
        `<job>-student-N`. `teacher_outputs_dir` is a store
        this orchestrator's teacher calls wrote (or a teacher task or job id; on the embedded cluster,
        any store); without it, this orchestrator's last teacher task's. The job starts training when
        that teacher job has completed. Outputs: `<output_dir>/output/student_N/` (default: the store's
        parent), N counting on across this orchestrator's calls. The held-out set is `eval_data` (its
        held-out split) / `eval_path` (whole), or a dataset by name: `dataset_name` [...] for eval_data,
        `dataset_eval_split` for eval_path, read here as the teacher's (`config.check_call_dataset`)."""
        named = check_call_dataset("create_student_tasks", "eval_data", kwargs.get("eval_data"), {
            "dataset_name": dataset_name, "dataset_config": dataset_config, "dataset_split": dataset_split,
            "dataset_column": dataset_column, EVAL_SPLIT_KEY: dataset_eval_split},
            eval_file=kwargs.get("eval_path"), required=False)
        kwargs.update(_read_named(named, "eval_data", "eval_path"))
        call = dict(base_model=base_model, teacher_outputs_dir=teacher_outputs_dir, num_students=num_students,
                    peft_type=peft_type, peft_config=peft_config, **kwargs)
        if not self._as_jobs:
            return self._in_process().start_students(plan_students(StudentCall(**call), self.mode))
        # the call checked here, at once (its store is the job's to find: the seeds may name a job, or none)
        plan_students(StudentCall(**{**call, "teacher_outputs_dir": "-"}), self.mode)
        args = _call_args(call, drop=("teacher_outputs_dir", "output_dir", "resume"))
        source, store = self._teacher_source(teacher_outputs_dir)
        base = Path(kwargs.get("output_dir") or store.parent).expanduser().resolve()
        n = (1 if isinstance(base_model, str) else len(base_model)) * num_students
        first, self._next_student = self._next_student, self._next_student + n
        job_id = self._submit("students", args, name=f"students {base_model}", first_student=first,
                              output_dir=base, **source)
        ids = [f"{job_id}-student-{k}" for k in range(first, first + n)]
        for k, tid in zip(range(first, first + n), ids):
            local = base / "output" / f"student_{k}"
            self._mine[tid] = {"job": job_id, "fetch": ("student", f"student_{k}", local)}
            self._student_dirs[str(local)] = tid
        self.log_event("submitted", f"students job {job_id}: {n} students of {base_model} on {store}",
                       job_id=job_id, task_ids=ids)
        return ids

    def aggregate_student_outputs(self, student_output_dirs: list[str | Path], output_path: str | Path,
                                  method: str = "mean", **kwargs: Any) -> dict[str, Any]:
        """Merge students' adapters into `<output_path>/final_adapter/` as an aggregate job, and wait
        for it (the seeds' call returns the merge's report). Student task ids, or the output dirs of
        this orchestrator's students (on the embedded cluster, any), wait for their jobs to complete."""
        if not self._as_jobs:
            return self._in_process().aggregate_student_outputs(student_output_dirs, output_path, method=method,
                                                                **kwargs)
        tasks, dirs = [], []
        for d in student_output_dirs:
            tid = str(d) if split_task_id(str(d)) else self._student_dirs.get(str(Path(d).expanduser().resolve()))
            if tid is not None:
                tasks.append(tid)
            elif self._embedded:
                dirs.append(str(Path(d).expanduser().resolve()))
            else:
                raise SmolforgeError(f"{d} is not a student of this orchestrator", where="aggregate_student_outputs",
                                     fix="pass the task ids create_student_tasks returned, or their output dirs")
        final = final_adapter_path(Path(output_path).expanduser().resolve())
        job_id = self._submit("aggregate", {"method": method, **kwargs}, name="aggregate", student_tasks=tasks,
                              student_dirs=dirs, output_dir=final)
        self.log_event("submitted", f"aggregate job {job_id}: {len(tasks) + len(dirs)} students into {final}",
                       job_id=job_id)
        st = self.backend.wait_for_job(job_id)
        if st["state"] != "completed":
            raise SmolforgeError(f"aggregation job {job_id} {st['state']}: {st.get('error')}",
                                 fix=f"see `smolforge job logs {job_id}`")
        if not self._embedded:
            self.backend.download_artifact(job_id, "adapter", final.name, final, overwrite=True)
        return {**(st.get("result") or {}), "output": str(final), "task_id": f"{job_id}-aggregate-0", "job_id": job_id}

    def reassign_idle_teacher_as_student(self, task_id: str) -> str | None:
        """A finished teacher's node goes to the next waiting student: the cluster's queue does that as
        soon as a node frees, so this checks the teacher has finished and returns the first of this
        orchestrator's students still waiting for a node (which the queue places next), or None."""
        if not self._as_jobs:
            return self._in_process().reassign_idle_teacher_as_student(task_id)
        parts = split_task_id(task_id)
        if parts is None or not parts[1].startswith("teacher-"):
            raise SmolforgeError(f"{task_id} is not a teacher task", fix="pass an id returned by create_parallel_teacher_tasks")
        state = self.task_status(task_id)["state"]
        if state not in FINAL_STATES:
            raise SmolforgeError(f"teacher {task_id} is still {state}", fix="reassign it once it has finished its shards")
        students = [t for t in self._mine if split_task_id(t)[1].startswith("student-")]
        waiting = [t for t, st in self._statuses(students).items() if st["state"] == "pending"]
        self.log_event("teacher_reassigned", f"{task_id} finished; the queue gives its node to "
                       f"{waiting[0] if waiting else 'the next waiting job'}", teacher=task_id,
                       student=waiting[0] if waiting else None)
        return waiting[0] if waiting else None

    @property
    def _embedded(self) -> bool:
        return self.backend.runs_in_process

    def _submit(self, stage: str, args: dict[str, Any], *, name: str, output_dir: Path, **fields: Any) -> str:
        """One distill_task job; an embedded one writes where the call said, a coordinator's in its state dir."""
        spec = {"kind": "distill_task", "stage": stage, "mode": _distill_mode(self.mode), "name": name,
                "args": args, **{k: v for k, v in fields.items() if v}}
        if self._embedded:
            spec["output_dir"] = str(output_dir)
        job_id = self.backend.submit_job(spec)
        if self._embedded and not self._exit_hook:  # after the cluster started: our hook runs before Ray's
            atexit.register(_close_at_exit, weakref.ref(self))
            self._exit_hook = True
        return job_id

    def _teacher_source(self, teacher_outputs_dir: str | Path | None) -> tuple[dict[str, Any], Path]:
        """(the spec fields naming the store a students job reads, its local path)."""
        if teacher_outputs_dir is None:
            if self._last_teacher is None:
                raise SmolforgeError("no teacher_outputs_dir given and this orchestrator has created no teacher task",
                                     where="create_student_tasks",
                                     fix="call create_teacher_task first, or pass teacher_outputs_dir")
            job_id, store = self._last_teacher
            note = (f"create_student_tasks: no teacher_outputs_dir given; using the outputs of this orchestrator's "
                    f"last teacher task (job {job_id}, {store})")
            self.log_event("students_use_last_teacher", note, job_id=job_id, store=str(store))
            print(f"[smolforge] {note}", file=sys.stderr)
            return {"teacher_job": job_id}, store
        text = str(teacher_outputs_dir)
        parts = split_task_id(text)
        if parts is not None or text.startswith("job-") and not Path(text).exists():
            return {"teacher_job": parts[0] if parts else text}, Path.cwd() / "teacher_outputs"
        store = store_dir_of(Path(text).expanduser()).resolve()
        if str(store) in self._teacher_jobs:
            return {"teacher_job": self._teacher_jobs[str(store)]}, store
        if self._embedded:
            return {"store_dir": str(store)}, store
        raise SmolforgeError(f"{teacher_outputs_dir} was not written by a teacher task of this orchestrator",
                             where="create_student_tasks", fix="pass the teacher task (or job) id, or leave "
                             "teacher_outputs_dir out to use this orchestrator's last teacher task")

    def _started_tasks(self, job_id: str, kind: str) -> list[str]:
        """The job's `kind` task ids once it has started them (or it ended first: then none)."""
        while True:
            st = self.backend.get_job_status(job_id)
            ids = [t["id"] for t in st.get("tasks", []) if t["kind"] == kind]
            if ids or st["state"] in FINAL_STATES + ("paused",):
                if st["state"] == "failed" and not ids:
                    raise SmolforgeError(f"{kind} job {job_id} failed: {st.get('error')}",
                                         fix=f"see `smolforge job logs {job_id}`")
                return sorted(ids, key=lambda t: int(t.rsplit("-", 1)[1]))
            time.sleep(0.5)

    def _publishing(self, task_id: str, status: dict[str, Any]) -> bool:
        """Our completed task whose job has not finished yet: its outputs are published as the job ends."""
        return (task_id in self._mine and not self._embedded and status.get("state") == "completed"
                and status.get("job_state") not in FINAL_STATES + ("paused",))

    def _fetch_outputs(self, task_id: str, status: dict[str, Any]) -> None:
        """On a coordinator, a completed job's outputs into the local paths this orchestrator's call named."""
        mine = self._mine.get(task_id)
        if mine is None or self._embedded or status.get("job_state") != "completed":
            return
        kind, name, local = mine["fetch"]
        key = (mine["job"], kind, name)
        if key in self._fetched:
            return
        self._fetched.add(key)
        try:
            self.backend.download_artifact(mine["job"], kind, name, local)
            self.log_event("fetched", f"{task_id}'s outputs are in {local}", task_id=task_id, path=str(local))
        except SmolforgeError as err:
            self.log_event("fetch_failed", f"{task_id}'s outputs stay on the coordinator: {err.what}", task_id=task_id)
            print(f"[smolforge] {task_id}'s outputs stay on the coordinator: {err.render()}", file=sys.stderr)

    def get_job_status(self, job_id: str) -> dict[str, Any]:
        return self.backend.get_job_status(job_id)

    def pause(self, job_id: str) -> dict:
        return self.backend.pause_job(job_id)

    def resume(self, job_id: str) -> dict:
        return self.backend.resume_job(job_id)

    def cancel(self, job_id: str) -> dict:
        return self.backend.cancel_job(job_id)

    def join(self, job_id: str, node: str | None = None) -> dict:
        return self.backend.join_job(job_id, node)

    def leave(self, job_id: str, node: str | None = None) -> dict:
        """Give back the coordinator node (or `node`), lent with `join`, at the job's next boundary."""
        return self.backend.leave_job(job_id, node)


def _read_named(named: dict[str, Any], file_key: str, eval_key: str | None = None) -> dict[str, Any]:
    """NAMED (a call's `dataset_name` ..., checked) read into FILE_KEY (and its eval split into EVAL_KEY) by
    `data.hub.resolve_in`, the one reader specs use: {} when no name was given."""
    if not named:
        return {}
    from smolforge.data.hub import resolve_in

    return resolve_in(named, file_key, eval_key)


def _call_args(call: dict[str, Any], drop: tuple[str, ...]) -> dict[str, Any]:
    """The call's arguments (checked already, by its plan) as JSON for the job: a TaskConfig as its
    fields, paths as strings."""
    out: dict[str, Any] = {}
    for key, value in call.items():
        if key in drop or value is None:
            continue
        if isinstance(value, TaskConfig):
            value = value.model_dump(exclude_none=True)
        out[key] = str(value) if isinstance(value, Path) else value
    return out


def _silent(task_id: str, status: dict[str, Any]) -> None:
    """A monitor_tasks callback that says nothing (wait_distill's default)."""


def _distill_mode(mode: str) -> str:
    """The distill mode of the orchestrator's mode: hybrid stays, the others are teacher_student."""
    return "hybrid" if mode == "hybrid" else "teacher_student"


def _close_at_exit(ref: "weakref.ref[Orchestrator]") -> None:
    """An embedded cluster's job threads stop before Ray's exit hook shuts Ray down (a script just ends)."""
    orch = ref()
    if orch is not None:
        orch.close()


def _shutdown_at_exit(ref: "weakref.ref[Orchestrator]") -> None:
    orch = ref()
    if orch is not None:
        orch.shutdown_distill()


def create_distributed_training(mode: str = "data_parallel", config: dict[str, Any] | None = None, *,
                                coordinator: str | None = None, token: str | None = None,
                                state_dir: str | Path | None = None) -> Orchestrator:
    """An Orchestrator on the given/configured coordinator, or on an embedded cluster of this machine."""
    return Orchestrator(mode, config, coordinator=coordinator, token=token, state_dir=state_dir)
