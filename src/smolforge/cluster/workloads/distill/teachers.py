"""Teacher tasks: shard the prompts over the nodes holding the teacher, collect shards as they finish,
retry a failed teacher's shards elsewhere."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import Any

from smolforge.cluster.workloads.distill.controller import (
    ShardFound, ShardWritten, Task, TaskAdded, TaskEnded, TaskFailed, TaskPlaced,
)
from smolforge.cluster.workloads.distill.decide import shard_key
from smolforge.cluster.workloads.distill.remotes import new_broker, remotes
from smolforge.cluster.workloads.distill.state import (
    GET_TIMEOUT_S,
    DistillTask,
    SessionState,
    StoreState,
    is_local_model,
    short_error,
)
from smolforge.cluster.workloads.distill.plans import TeacherCall, TeacherPlan, plan_teachers
from smolforge.cluster.workloads.distill.task_plans import teacher_task_plan
from smolforge.cluster.nodes.ray_glue import Requirements
from smolforge.cluster.control.distill_placement import own_cpus, teacher_nodes
from smolforge.distill import backends
from smolforge.distill.planner import model_backend, model_nodes, plan_shards, teacher_assignment
from smolforge.distill.store import (
    CorruptShardError,
    StorePlan,
    decode_shard,
    quarantine_shard,
    read_shard_bytes,
    ready_shards,
    write_shard_bytes,
)
from smolforge.distill.teacher import prompts_from_dataset
from smolforge.errors import SmolforgeError
from smolforge.models.names import built_from_code


class TeacherTasks:
    """Plumbing shared by every distill task, and the teacher tasks (a mixin of DistillTasks)."""

    # -- plumbing ------------------------------------------------------------------------------------

    def _dstate(self) -> SessionState:
        st = getattr(self, "_distill_state", None)
        if st is None:
            st = SessionState()
            self._distill_state = st
        return st

    def _devent(self, kind: str, message: str, **data: Any) -> None:
        log = getattr(self, "log_event", None)
        if log is not None:
            log(kind, message, **data)

    def _dlines(self, lines: list[dict[str, Any]]) -> None:
        """Task output lines for whoever keeps them (the job runner: `DistillSession.log_lines`)."""
        keep = getattr(self, "log_lines", None)
        if keep is not None and lines:
            keep(lines)

    def _nodes(self) -> list[Any]:
        nodes = self.cluster.nodes()
        self._dstate().node_names.update({n.node_id: n.name for n in nodes})
        return nodes

    def _busy_cpus(self) -> dict[str, float]:
        return own_cpus((t.node_id, t.cpus) for t in self._dstate().tasks.values()
                         if t.kind in ("teacher", "student") and not t.queued and t.state in ("pending", "running"))

    def _model_nodes(self, model: str, role: str, backend: str = "hf",
                     on_coordinator: bool = False) -> tuple[list[Any], str | None]:
        """(nodes that may run a task needing `model`, GPU first; the model resource to request or None).

        `backend` is how the task loads it: students and `hf`/`reference` teachers need the weights
        (a node's `models`), an `ollama` teacher the Ollama tag (its `ollama_models`).
        `on_coordinator`: the coordinator (head) node only, which the user lent to the teachers
        (`--teacher-on-coordinator`); otherwise the worker nodes only. Presets are built offline from
        config on any node; a local directory counts as held by every node of an embedded
        (one-machine) cluster. See `planner.model_nodes`.
        """
        loader = model_backend(backend)
        embedded = bool(getattr(self.cluster, "embedded", False))
        how = backends.loader(loader)
        any_ok = how.anywhere or how.weights and (built_from_code(model) or (embedded and is_local_model(model)))
        return model_nodes(self._nodes(), model, role, any_node_ok=any_ok, backend=loader,
                           on_coordinator=on_coordinator)

    def _options(self, node, model: str | None, cpus: float, backend: str = "hf",
                 on_coordinator: bool = False) -> dict[str, Any]:
        req = Requirements(model=model, cpus=cpus, gpu="preferred" if node.gpus >= 1 else "no",
                           allowed_nodes=[node.name], model_backend=model_backend(backend),
                           on_coordinator=on_coordinator)
        opts = req.ray_options(self._nodes())
        if "label_selector" not in opts and "scheduling_strategy" not in opts:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node.node_id, soft=False)
        return opts

    def _thread(self, target, args: tuple, name: str) -> threading.Thread:
        """Start a driver thread and remember it: shutdown joins them all before Ray goes away
        (a thread still inside a Ray call when Ray shuts down can crash the process)."""
        st = self._dstate()
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        with st.lock:
            st.threads = [x for x in st.threads if x.is_alive()] + [t]
        t.start()
        return t

    def _ensure_monitor(self) -> None:
        st = self._dstate()
        with st.lock:
            if st.driven:
                return  # whoever drives the run calls `step`
            if st.monitor is None or not st.monitor.is_alive():
                st.monitor = self._thread(self._monitor_loop, (), "distill-monitor")

    # -- teachers ------------------------------------------------------------------------------------

    def create_teacher_task(self, model_path: str, dataset_path: str, output_dir: str | Path, batch_size: int = 8,
                            max_samples: int | None = None, **kwargs: Any) -> str:
        """One teacher over the whole dataset (the seeds' name); returns its task id."""
        return self.create_parallel_teacher_tasks(model_path, dataset_path, output_dir, 1, batch_size=batch_size,
                                                  max_samples=max_samples, **kwargs)[0]

    def create_parallel_teacher_tasks(self, model_path: str, dataset_path: str, output_dir: str | Path,
                                      num_teachers: int | None = None, batch_size: int = 8,
                                      compress_outputs: bool = True, max_samples: int | None = None,
                                      **kwargs: Any) -> list[str]:
        """The seeds' call: shard the dataset's prompts over `num_teachers` teachers (None: one per
        eligible node); returns their task ids. Every argument, its default and meaning:
        `plans.TeacherCall` (a name it does not hold is Python's TypeError); checked once into a
        `TeacherPlan` (`teacher_plan`), then `start_teachers`."""
        return self.start_teachers(self.teacher_plan(
            model_path=model_path, dataset_path=dataset_path, output_dir=output_dir, num_teachers=num_teachers,
            batch_size=batch_size, compress_outputs=compress_outputs, max_samples=max_samples, **kwargs))

    @staticmethod
    def teacher_plan(**call: Any) -> TeacherPlan:
        """The seeds' `create_parallel_teacher_tasks` keyword arguments (`plans.TeacherCall`) as a checked
        plan: the one place a seed call's teachers are validated (`plans.plan_teachers`)."""
        return plan_teachers(TeacherCall(**call))

    def start_teachers(self, plan: TeacherPlan) -> list[str]:
        """The plan's teachers on the nodes that can load its model (GPU nodes first; this raises at once
        when none can), over the shards of its dataset not already valid in `plan.store_dir`, which they
        fill as they finish. A failed teacher's shards go to another eligible node, `plan.max_retries`
        times per shard. Returns the teacher task ids."""
        st = self._dstate()
        store_dir = plan.store_dir
        store_dir.mkdir(parents=True, exist_ok=True)
        store_dir = store_dir.resolve()
        eligible, req_model = self._model_nodes(plan.model, "teacher", plan.backend,
                                                plan.on_coordinator)  # fails fast, before reading data
        items = prompts_from_dataset(plan.dataset, plan.max_samples, plan.data_format)
        n_teachers = len(eligible) if plan.num_teachers is None else plan.num_teachers
        settings = plan.settings
        shards = plan_shards(len(items), num_shards=plan.num_shards, shard_size=plan.shard_size,
                             min_shards=2 * n_teachers, teacher=plan.model, dataset=plan.dataset, k=settings.top_k,
                             samples_per_prompt=settings.samples_per_prompt)
        shards.generation, shards.compress, shards.backend = asdict(settings), plan.compress, plan.backend
        self._check_store(store_dir, shards)
        shards.write(store_dir)
        broker = new_broker({**asdict(shards), "assigned": {}})
        store = StoreState(dir=store_dir, plan=shards, items=items, teacher=plan.model, backend=plan.backend,
                           settings=replace(settings), compress=plan.compress, broker=broker, teacher_nodes=eligible,
                           teacher_req_model=req_model, cpus_per_teacher=plan.cpus, device=plan.device,
                           ollama_host=plan.ollama_host, teacher_tokenizer=plan.tokenizer, max_retries=plan.max_retries,
                           teacher_on_coordinator=plan.on_coordinator, dtype=plan.dtype, quant=plan.quant,
                           teacher_url=plan.teacher_url, teacher_key_file=plan.teacher_key_file, teacher_plan=plan)
        with st.lock:
            st.stores[str(store_dir.resolve())] = store
        todo = self._reuse_shards(store)
        assignment = teacher_assignment(len(todo), n_teachers) if todo else []
        ids = []
        for positions, node in zip(assignment, teacher_nodes(eligible, len(assignment))):
            ids.append(self._launch_teacher(store, [todo[p] for p in positions], node))
        self._devent("teachers_planned", f"{shards.num_shards} shards of {len(items)} prompts over {len(ids)} teachers "
                     f"({len(todo)} to generate, {shards.num_shards - len(todo)} reused)", store=str(store_dir),
                     shards=shards.num_shards, teachers=ids, reused=shards.num_shards - len(todo))
        self._ensure_monitor()
        return ids

    @staticmethod
    def _check_store(store_dir: Path, plan: StorePlan) -> None:
        """Refuse a store that holds shards of another teacher run (another teacher, dataset or sharding)."""
        old = StorePlan.read(store_dir)
        if old is not None:
            same = (old.teacher, old.dataset, old.num_examples, old.shards) == (plan.teacher, plan.dataset,
                                                                                  plan.num_examples, plan.shards)
            if not same and ready_shards(store_dir):
                raise SmolforgeError(f"{store_dir} holds shards of a different teacher run",
                                     fix="use a new --output-dir, or delete that teacher_outputs/ directory")

    def _reuse_shards(self, store: StoreState) -> list[int]:
        """Register valid shards already on disk; quarantine corrupt ones. Returns the shards to generate."""
        import ray

        todo = []
        for sid in range(store.plan.num_shards):
            try:
                got = read_shard_bytes(store.dir, sid)
                if got is None:
                    todo.append(sid)
                    continue
                decode_shard(*got)
            except CorruptShardError as err:
                quarantine_shard(store.dir, sid)
                self._devent("shard_corrupt", f"shard {sid} on disk failed its checksum; regenerating it",
                             store=str(store.dir), shard=sid, error=err.what, source="disk")
                store.regenerating.add(sid)
                todo.append(sid)
                continue
            manifest, data = got
            store.broker.add.remote(sid, json.dumps(manifest), [ray.put((json.dumps(manifest), data))])
            store.written.add(sid)
            self._record(ShardFound(shard_key(self._store_no(store), sid)))
            self._absorb_manifest(store, manifest)
        return todo

    def _absorb_manifest(self, store: StoreState, manifest: dict[str, Any]) -> None:
        if not store.plan.tokenizer_hash:
            store.plan.tokenizer_hash = manifest.get("tokenizer_hash", "")
            store.plan.vocab_size = int(manifest.get("vocab_size", 0))
            store.plan.k = int(manifest.get("k", store.plan.k))
            store.plan.write(store.dir)

    def _launch_teacher(self, store: StoreState, shard_ids: list[int], node, note: str = "",
                        task_id: str | None = None) -> str:
        """Start a teacher on `node` over `shard_ids`: a new one (the run is told of it), or `task_id`, one
        the run made and planned (a failed teacher's shards, a corrupt shard). Returns its task id."""
        st = self._dstate()
        self._synced()
        if task_id is None:
            task_id = f"teacher-{st.run.teachers_made}"
            eligible = frozenset(n.node_id for n in store.teacher_nodes) if store.teacher_nodes else None
            no = self._store_no(store)
            self._record(TaskAdded(Task(task_id=task_id, kind="teacher", cpus=store.cpus_per_teacher,
                                        shards=tuple(shard_key(no, s) for s in shard_ids), eligible=eligible)))
        shards = {sid: tuple(store.plan.shards[sid]) for sid in shard_ids}
        assert store.teacher_plan is not None  # (start_teachers' plan, or a stored store's)
        plan = teacher_task_plan(task_id, node.name, store.teacher_plan, store.items, shards)
        task = DistillTask(task_id=task_id, kind="teacher", store=str(store.dir), node=node.name, node_id=node.node_id,
                           cpus=store.cpus_per_teacher, shards=list(shard_ids),
                           samples_total=sum(b - a for a, b in shards.values()))
        opts = self._options(node, store.teacher_req_model, store.cpus_per_teacher, store.backend,
                             store.teacher_on_coordinator)
        gen = remotes()["teacher"].options(**opts).remote(plan)
        with st.lock:
            st.tasks[task_id] = task
            st.handles[task_id] = gen
            self._record(TaskPlaced(task_id, node.node_id, st.run.tasks[task_id].attempt))
        self._devent("teacher_submitted", f"{task_id} on {node.name}: shards {shard_ids}{note}", task_id=task_id,
                     node=node.name, shards=list(shard_ids))
        with st.lock:
            st.watch[task_id] = (gen, partial(self._teacher_ready, store, task, gen))
        return task_id

    def _teacher_ready(self, store: StoreState, task: DistillTask, gen) -> bool:
        """A teacher's generator has news (`step` waited on it): its next shard, written and handed to the
        broker; its end; or its failure, which gives its unfinished shards to another teacher. Returns
        whether to go on waiting on it."""
        import ray

        if self._dstate().closing or task.state == "cancelled" or not ray.is_initialized():
            return False  # (a Ray call after shutdown would start a fresh local Ray)
        try:
            try:
                ref = next(gen)
            except StopIteration:
                task.state, task.finished, task.progress = "completed", time.time(), 1.0
                self._record(TaskEnded(task.task_id, "completed", task.attempt))
                self._devent("teacher_finished", f"{task.task_id} finished on {task.node}", task_id=task.task_id,
                             node=task.node)
                self._after_finish(task)
                return False
            self._take_shard(store, task, ray.get(ref, timeout=GET_TIMEOUT_S))
            return True
        except Exception as err:  # a dead node, a failing model load: the task fails, students are told
            task.state, task.finished = "failed", time.time()
            task.error = short_error(err)
            self._devent("teacher_failed", f"{task.task_id} failed: {task.error}", task_id=task.task_id,
                         node=task.node, error=task.error)
            if not self._dstate().closing:
                self._teacher_lost_shards(store, task.task_id, task.error)
                self._place_waiting()
            return False

    def _take_shard(self, store: StoreState, task: DistillTask, got: tuple[str, bytes]) -> None:
        """One shard a teacher yielded: (manifest JSON, safetensors bytes) into `teacher_outputs/`
        (checksum verified first) and, as the driver's own copy, to the store's broker."""
        import ray

        manifest_json, data = got
        manifest = json.loads(manifest_json)
        if "log" in manifest:  # what the teacher printed, not part of the shard's manifest
            self._dlines(manifest.pop("log"))
            manifest_json = json.dumps(manifest)
        sid = int(manifest["shard"])
        if task.state == "pending":
            task.state, task.started = "running", task.started or time.time()
        write_shard_bytes(store.dir, manifest, data)  # verifies the checksum first
        # The driver's own copy: the teacher's object lives on the teacher's node, and a
        # student restarted after that node died must still find the shard.
        store.broker.add.remote(sid, manifest_json, [ray.put((manifest_json, data))])
        self._absorb_manifest(store, manifest)
        with self._dstate().lock:
            store.written.add(sid)
            self._record(ShardWritten(task.task_id, shard_key(self._store_no(store), sid), task.attempt))
            task.done_shards.append(sid)
            task.samples_done += manifest["example_range"][1] - manifest["example_range"][0]
            task.progress = len(task.done_shards) / max(1, len(task.shards))
        regen = sid in store.regenerating
        store.regenerating.discard(sid)
        self._devent("shard_regenerated" if regen else "shard_written",
                     f"shard {sid} written by {task.task_id} on {manifest.get('node')} "
                     f"({manifest['num_response_tokens']} tokens, {manifest['bytes_per_token']:.1f} B/token)",
                     task_id=task.task_id, shard=sid, node=manifest.get("node"), node_id=manifest.get("node_id"),
                     sha256=manifest["sha256"], at=time.time(), pid=manifest.get("pid"))

    def _teacher_lost_shards(self, store: StoreState, task_id: str, error: str, worker_lost: bool = True) -> None:
        """A teacher failed: the run gives its unfinished shards to a new teacher (which the next plan
        places), each within its retries, or fails the store once they are spent (its students are told)."""
        st = self._dstate()
        before = st.run.store_failed
        known = st.run.tasks.get(task_id)
        run = self._record(TaskFailed(task_id, error, worker_lost, known.attempt if known else 0))
        if run.store_failed and run.store_failed != before:
            store.broker.fail.remote(run.store_failed)

    def _store_no(self, store: StoreState) -> int:
        """The store's number in this session (its shards' keys, `decide.shard_key`)."""
        st = self._dstate()
        with st.lock:
            key = str(store.dir)
            if key not in st.store_nos:
                st.store_nos.append(key)
            return st.store_nos.index(key)
