"""Student tasks: stream the shards, checkpoint to the driver, restart on a lost worker."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from ray.exceptions import RayError

from smolforge.cluster.workloads.distill.controller import TaskEnded, TaskFailed
from smolforge.cluster.workloads.distill.groups import StudentGroups, node_gone
from smolforge.cluster.workloads.distill.placing import Placing
from smolforge.cluster.workloads.distill.remotes import new_broker
from smolforge.cluster.workloads.distill.plans import store_dir_of, stored_teacher_plan
from smolforge.cluster.workloads.distill.state import GET_TIMEOUT_S, DistillTask, StoreState, short_error
from smolforge.cluster.workloads.distill.plans import StudentCall, StudentPlan, plan_students
from smolforge.cluster.workloads.distill.task_plans import ResumePoint, student_config, student_record
from smolforge.cluster.control.specs import TaskConfig
from smolforge.config import DataSpec
from smolforge.data.splits import read_spec
from smolforge.distill.prompts import GenSettings
from smolforge.distill.store import StorePlan
from smolforge.distill.teacher import prompts_from_dataset
from smolforge.errors import SmolforgeError
from smolforge.parallel.transfer import pack_dir, unpack_dir
from smolforge.paths import atomic_write_json, safe_join
from smolforge.train import checkpoint as ckpt


class StudentTasks(StudentGroups, Placing):
    """The student tasks (a mixin of DistillTasks); a ddp group's own rules are StudentGroups'."""

    # -- students ------------------------------------------------------------------------------------

    def create_student_tasks(self, base_model: str | list[str], teacher_outputs_dir: str | Path,
                             num_students: int = 2, peft_type: str = "lora",
                             peft_config: dict[str, Any] | None = None, *,
                             lora_config: dict[str, Any] | None = None, task_config: TaskConfig | None = None,
                             **kwargs: Any) -> list[str]:
        """The seeds' call: students that stream the teacher's shards as they appear; returns their task
        ids. Every argument, its default and meaning: `plans.StudentCall` (a name it does not hold is
        Python's TypeError); checked once into a `StudentPlan` (`student_plan`), then `start_students`."""
        return self.start_students(self.student_plan(
            base_model=base_model, teacher_outputs_dir=teacher_outputs_dir, num_students=num_students,
            peft_type=peft_type, peft_config=peft_config, lora_config=lora_config, task_config=task_config, **kwargs))

    def student_plan(self, **call: Any) -> StudentPlan:
        """The seeds' `create_student_tasks` keyword arguments (`plans.StudentCall`) as a checked plan for
        this session's mode: the one place a seed call's students are validated (`plans.plan_students`)."""
        return plan_students(StudentCall(**call), getattr(self, "mode", "teacher_student"))

    def start_students(self, plan: StudentPlan) -> list[str]:
        """The plan's students, streaming its store's shards as they appear; returns their task ids.

        Each base gets `plan.num_students` students on the shards `plan.sync` assigns (split, or all);
        a ddp sync makes each base's students one group. Outputs: `<run_dir>/output/student_N/`. With
        `plan.resume` a paused student continues from `student_N/checkpoints/`; without, those go."""
        st = self._dstate()
        if plan.max_retries is not None:
            st.max_restarts = plan.max_retries
        store = self._store_for(plan.store_dir)
        run_dir = plan.run_dir or store.dir.parent
        held_out = plan.eval_path or plan.eval_data
        eval_examples = self._eval_examples(held_out, plan.eval_path, plan.training.max_eval_samples) if held_out else None
        common = plan.student_config(store.plan.teacher)
        ids = []
        assigned: list = []  # the broker is a threaded actor: its calls may run out of order, so wait for these
        for base in plan.bases:
            nodes, req_model = self._model_nodes(base, "student")
            assignment = plan.sync.shards(store.plan.num_shards, plan.num_students, plan.split)
            of_base: list[str] = []
            for shards in assignment:
                task, ref = self._add_student(plan, store, base, shards, run_dir, common, eval_examples, req_model)
                assigned.append(ref)
                ids.append(task.task_id)
                of_base.append(task.task_id)
            for members in plan.sync.groups(of_base):
                self._form_group(plan.sync.group_spec(members, assignment[0]))
        # The broker's plan now knows every assignment (students read their row counts from it).
        import ray

        ray.get(assigned + [store.broker.update_plan.remote({"assigned": dict(store.assigned)})], timeout=60)
        self._place_waiting()
        self._ensure_monitor()
        return ids

    def _add_student(self, plan: StudentPlan, store: StoreState, base: str, shards: list[int], run_dir: Path,
                     common: dict[str, Any], eval_examples: tuple[dict[str, Any], ...] | None,
                     req_model: str | None) -> tuple[DistillTask, Any]:
        """One student of `base` on `shards`: its number and rank, its typed record (`task_plans.student_record`:
        `common`, the stage's shared config, with its base and output dir), its task in the run's state (its
        node must hold `req_model`), its assignment sent to the broker (the returned ref) and its
        `student_created` event. Not placed yet."""
        st = self._dstate()
        with st.lock:
            rank = store.next_rank
            store.next_rank += 1
            n = next(st.counters["student"])
        store.assigned[str(rank)] = shards
        ref = store.broker.assign.remote(rank, shards)
        task_id = f"student-{n}"
        out = run_dir / "output" / f"student_{n}"
        config = student_config({"base_model": base, "output_dir": str(out), **common})
        record = student_record(task_id, config, store.plan.tokenizer_hash or None, eval_examples,
                                self._resume_point(out, plan.resume))
        rows = sum(store.plan.shards[s][1] - store.plan.shards[s][0] for s in shards) * store.plan.samples_per_prompt
        epochs, max_steps, per_step = config.epochs, config.max_steps, config.batch_size * config.grad_accum
        task = DistillTask(task_id=task_id, kind="student", store=str(store.dir), cpus=plan.cpus,
                           shards=list(shards), output_dir=str(out), rank=rank, plan=record,
                           replace_timeout_s=plan.replace_timeout_s, req_model=req_model,
                           resumed_step=record.resume.step if record.resume else 0,
                           samples_total=int(rows * epochs) if not max_steps else max_steps * per_step,
                           max_steps=max_steps or max(1, -(-int(rows * epochs) // per_step)))
        with st.lock:
            st.tasks[task_id] = task
        self._devent("student_created", f"{task_id} ({base}, {plan.peft.method}) on shards {shards}",
                     task_id=task_id, shards=shards, base=base)
        if record.resume:
            self._devent("student_resuming", f"{task_id} resumes from its checkpoint at step "
                         f"{record.resume.step}", task_id=task_id, step=record.resume.step)
        return task, ref

    def _eval_examples(self, eval_data: str, eval_path: str | None, max_eval: int | None) -> tuple[dict[str, Any], ...]:
        # prompts_only: a teacher's dataset may hold prompts without answers (read_spec leaves them out of eval);
        # EVAL_PATH (a held-out file: a dataset's eval split) is read whole, as DataSpec reads an eval_path
        spec = DataSpec(path=eval_data, eval_path=eval_path, max_eval_samples=max_eval, max_samples=1)
        _train, eval_ex, _fmt, _skipped = read_spec(spec, prompts_only=True)
        return tuple({"messages": ex.messages} for ex in eval_ex if ex.messages)

    def _store_for(self, teacher_outputs_dir: str | Path) -> StoreState:
        st = self._dstate()
        store_dir = store_dir_of(teacher_outputs_dir).resolve()
        with st.lock:
            store = st.stores.get(str(store_dir))
        if store is not None:
            return store
        plan = StorePlan.read(store_dir)
        if plan is None:
            raise SmolforgeError(f"{store_dir} has no teacher plan (plan.json)",
                                 fix="create the teacher tasks first (create_parallel_teacher_tasks)")
        # Teachers ran earlier: serve what is on disk; missing or corrupt shards need the teacher again.
        broker = new_broker({**asdict(plan), "assigned": {}})
        settings = GenSettings(**plan.generation) if plan.generation else GenSettings(top_k=plan.k)
        store = StoreState(dir=store_dir, plan=plan, items=[], teacher=plan.teacher, backend=plan.backend,
                           settings=settings, compress=plan.compress, broker=broker, teacher_nodes=[],
                           teacher_req_model=None, cpus_per_teacher=1.0, device="auto",
                           teacher_plan=stored_teacher_plan(plan, store_dir, settings))
        todo = self._reuse_shards(store)
        if todo:
            store.items = prompts_from_dataset(plan.dataset)
            store.regenerating.update(todo)
            nodes, store.teacher_req_model = self._model_nodes(plan.teacher, "teacher", plan.backend)
            store.teacher_nodes = nodes
            self._launch_teacher(store, todo, nodes[0], note=" (missing shards)")
        with st.lock:
            st.stores[str(store_dir)] = store
        return store

    def _student_nodes(self, task: DistillTask) -> list[Any]:
        """The live nodes that may run this student now: asked at every placement, so a node that
        joined after the run started counts, and a dead one does not."""
        try:
            nodes, task.req_model = self._model_nodes(task.plan.config.base_model, "student")
        except SmolforgeError:
            return []
        return nodes  # (the run leaves out the nodes it lost: `controller.Task.lost_nodes`)

    def _place_student(self, task: DistillTask, node=None) -> bool:
        """Place the student (its group's members with it) where `plan` says (`Placing._place_waiting`),
        offering `node` alone when given; queued when the plan says wait. Returns whether it was placed
        (or has ended) rather than queued."""
        members = self._members(task)
        if any(m.node_id and m.state in ("pending", "running") for m in members):
            return True  # its group was placed with another member (the queue lists every member)
        return self._place_waiting({m.task_id for m in members}, node).get(task.task_id, False)

    def _student_ready(self, task: DistillTask, actor, ref) -> bool:
        """A student's run has ended (`step` waited on its result): its adapter written, or its
        checkpoint kept on a pause; a failure is decided in a thread of its own (a lost rank's verdict
        may wait for its peers, `LOST_PEER_GRACE_S`). Returns False: nothing more to wait on."""
        import ray

        if self._dstate().closing or not ray.is_initialized():
            return False
        if task.state == "failed":  # the run gave up on it already (its store failed)
            self._kill_quietly(actor)
            return False
        try:
            out = ray.get(ref, timeout=GET_TIMEOUT_S)
            if (self._dstate().handles.get(task.task_id) or (None, None))[1] is not ref:
                self._kill_quietly(actor)
                return False  # a run of its group that a lost rank ended already (`_group_member_failed`)
            self._take_student_result(task, out)
        except Exception as err:
            self._thread(self._student_failed, (task, actor, ref, err), f"{task.task_id}-failed")
            return False
        self._kill_quietly(actor)
        self._after_finish(task)
        return False

    def _take_student_result(self, task: DistillTask, out: dict[str, Any]) -> None:
        """A student's result: stopped (its checkpoint kept) or completed (its adapter written)."""
        result = out["result"]
        if result.get("stopped"):
            task.state = "cancelled" if result["stopped"] == "cancel" else "paused"
            if out.get("checkpoint"):
                self._keep_student_checkpoint(task, out["checkpoint"])
        else:
            if out["adapter"] is not None:  # a group's other ranks write none: rank 0 holds the one adapter
                self._write_student_output(task, result, out["adapter"])
            task.state, task.progress = "completed", 1.0
            task.take_last_step(result)
        task.result = result
        task.finished = time.time()
        self._record(TaskEnded(task.task_id, task.state, task.attempt))
        self._devent("student_finished", f"{task.task_id} {task.state} on {task.node}: "
                     + ", ".join(f"{k} {v:.4f}" for k, v in result.get("eval", {}).items()),
                     task_id=task.task_id, node=task.node, eval=result.get("eval", {}), steps=result.get("steps"),
                     mode=result.get("mode"), shards=[s["shard"] for s in result.get("shards", [])])

    def _student_failed(self, task: DistillTask, actor, ref, err: BaseException) -> None:
        """A student's run ended with `err` (its own thread): its group's or its own verdict, restart or fail."""
        try:
            ended = (self._group_member_failed(task, ref, err) if len(self._members(task)) > 1
                     else self._lone_student_failed(task, err))
        finally:
            self._kill_quietly(actor)
        if ended:
            self._after_finish(task)

    def _lone_student_failed(self, task: DistillTask, err: BaseException) -> bool:
        """A student alone ended with `err`: the run's verdict (`controller.apply` of its `TaskFailed`,
        under the one FailurePolicy): restarted from its last checkpoint when its worker was lost, within
        the budget, else failed saying why. Returns whether it ended here."""
        lost = self._worker_lost(err)
        error = short_error(err)
        with self._dstate().lock:
            if task.state == "failed":
                return False  # failed already, saying why (a lost broker, a store that failed)
        # The node itself gone (`node_gone`): the run never places the student there again.
        gone = lost and node_gone(task.node_id)
        latest = ckpt.latest_checkpoint(task.output_dir)
        with self._dstate().placing:  # the verdict and its restart as one step (as a group's: groups.py)
            run = self._record(TaskFailed(task.task_id, f"on {task.node} ({error})" if lost else error, lost,
                                          task.attempt, latest.name if latest else None, gone))
            verdict = run.tasks[task.task_id]
            error = verdict.error or error
            if verdict.state == "waiting" and not self._dstate().closing:
                try:
                    self._restart_student(task, verdict.error or error, verdict.restarts)
                    return False
                except Exception as again:  # the restart itself failed: the student ends, saying why
                    error = f"{error}; restarting it failed: {short_error(again)}"
                    self._record(TaskFailed(task.task_id, error, False, verdict.attempt))
        task.queued, task.state, task.finished, task.error = False, "failed", time.time(), error
        self._devent("student_failed", f"{task.task_id} failed: {task.error}", task_id=task.task_id,
                     node=task.node, error=task.error)
        return True

    @staticmethod
    def _kill_quietly(actor) -> None:
        import ray

        try:
            if ray.is_initialized():
                ray.kill(actor)
        except (RayError, ValueError):
            pass  # already gone

    @staticmethod
    def _worker_lost(err: BaseException) -> bool:
        """The student's process or node went away (not an error of its own, which would only repeat)."""
        import ray.exceptions as rex

        return isinstance(err, (rex.RayActorError, rex.WorkerCrashedError, rex.NodeDiedError,
                                rex.ObjectLostError, rex.OwnerDiedError))

    def _restart_student(self, task: DistillTask, why: str, restarts: int) -> None:
        """Start a student whose worker was lost again (the run said so: `why`, its `restarts`th), from its
        last kept checkpoint (or the start), where the plan puts it; it is queued when nowhere yet."""
        import ray

        st = self._dstate()
        task.restarts = restarts
        resume = self._resume_point(Path(task.output_dir), True)
        task.plan = replace(task.plan, resume=resume)
        task.resumed_step = resume.step if resume else 0
        task.started, task.progress = None, task.resumed_step / max(1, task.max_steps)
        task.step = task.resumed_step
        lost_on = task.node
        task.state, task.node_id = "pending", None  # its CPU on the old node is no longer ours
        ray.get(st.stores[task.store].broker.restart.remote(task.rank), timeout=60)
        self._devent("student_restarted", f"{why} (from "
                     + (f"step {task.resumed_step})" if resume else "the start)"),
                     task_id=task.task_id, node=lost_on, step=task.resumed_step, restarts=task.restarts)
        self._place_student(task)

    def _keep_student_checkpoint(self, task: DistillTask, shipped: dict[str, Any], why: str = "paused") -> None:
        """Store a student's shipped checkpoint in `<output_dir>/checkpoints/` (verified, atomic), so a
        resumed run, or a restart after its worker died, picks the student up at that step."""
        root = ckpt.checkpoints_dir(task.output_dir)
        with self._dstate().lock:  # the monitor (periodic ones) and a student's result (a pause) both come here
            kept = ckpt.list_checkpoints(task.output_dir)
            dest = safe_join(root, shipped["name"])  # the name comes from a worker
            if kept and ckpt.step_of(kept[-1]) > ckpt.step_of(dest):
                return  # an older one drained late: keep the newer
            unpack_dir(shipped["payload"], dest)
            for old in kept:
                if old != dest:
                    shutil.rmtree(old, ignore_errors=True)
        step = int(json.loads((dest / "state.json").read_text())["step"])
        self._devent("student_checkpoint", f"{task.task_id} {why} a checkpoint at step {step}; kept in {dest}",
                     task_id=task.task_id, step=step, checkpoint=str(dest), why=why)

    def _resume_point(self, out: Path, resume: bool) -> ResumePoint | None:
        """A student's checkpoint to resume from, packed for the worker. Without `resume`, a run dir
        holding one is refused: its steps are never deleted, and never silently continued."""
        latest = ckpt.latest_checkpoint(out)
        if not resume:
            if latest is not None:
                raise SmolforgeError(f"{out} already holds a student checkpoint ({latest.name}) of an earlier run",
                                     fix="resume that run (smolforge distill --resume), or choose a new "
                                         "--output-dir (nothing was deleted)")
            return None
        if latest is None:
            return None
        # Same run dir, same spec (a resumed job): student_N is the same student. Its state.json names
        # the model by the node-local path it ran from, so it is not compared with `base` here.
        state = json.loads((latest / "state.json").read_text())
        return ResumePoint(latest.name, pack_dir(latest), int(state["step"]))

    def _write_student_output(self, task: DistillTask, result: dict[str, Any], adapter: dict[str, Any]) -> None:
        out = Path(task.output_dir)
        method = task.plan.config.peft.method
        final = unpack_dir(adapter, out / f"{method}_adapter")  # checksummed, no path escapes, atomic swap
        result = {**result, "adapter_dir": str(final), "output_dir": str(out), "node": task.node}
        atomic_write_json(out / "summary.json", result)
