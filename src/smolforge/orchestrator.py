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
`aggregate_student_outputs`, `reassign_idle_teacher_as_student`) are the cluster's
`smolforge.cluster.workloads.distill.session.DistillTasks`: it gets `self.cluster` (a connected
`ray_glue.ClusterHandle`) and `self.log_event(kind, message, **data)` / `self.events` from here, and its
`_local_task_status` lets `monitor_tasks` report teacher and student tasks too.
"""

from __future__ import annotations

import atexit
import os
import time
import weakref
from pathlib import Path
from typing import Any, Callable

from smolforge.client import backend_for
from smolforge.cluster.workloads.distill.session import DistillTasks
from smolforge.cluster.control.specs import TaskConfig
from smolforge.errors import SmolforgeError

MODES = ("data_parallel", "teacher_student", "hybrid")
FINAL_STATES = ("completed", "failed", "cancelled")

class Orchestrator(DistillTasks):
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

    def __repr__(self) -> str:
        return f"Orchestrator(mode={self.mode!r}, backend={self.backend!r})"

    # -- shared plumbing -------------------------------------------------------------------------

    @property
    def cluster(self):
        """The Ray cluster behind the backend, connected on first use (ray_glue.ClusterHandle)."""
        if self._cluster is None:
            from smolforge.cluster.nodes import ray_glue

            handle = getattr(self.backend, "handle", None)
            if handle is not None:
                self._cluster = handle
            else:
                info = self.backend.check_token()
                if info.get("ray_tls"):  # this driver needs its own certificate from the cluster's CA
                    os.environ.update(self.backend.ray_tls_env())
                self._cluster = ray_glue.connect(info["ray_address"], token=self.backend.token)
            # A seed script just ends: our driver threads must stop before Ray's own exit hook shuts
            # Ray down (a thread still calling Ray then kills the process with exit code 1). atexit runs
            # hooks last-registered first, and Ray registered its hook when this process connected.
            atexit.register(_shutdown_at_exit, weakref.ref(self))
        return self._cluster

    def log_event(self, kind: str, message: str, **data: Any) -> None:
        self.events.append({"ts": time.time(), "kind": kind, "message": message, "data": data})

    def close(self) -> None:
        close = getattr(self.backend, "close", None)
        if close:
            close()

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

    def create_data_parallel_tasks(self, model_path: str, dataset_path: str, num_workers: int = 2,
                                   batch_size: int = 4, epochs: float = 1.0, max_length: int = 256,
                                   peft: str = "lora", lora_r: int = 8, lora_alpha: float = 16,
                                   max_steps: int | None = None, lr: float | None = None,
                                   save_every: int | None = None, seed: int = 0, max_retries: int | None = None,
                                   cpus_per_worker: float | None = None, name: str | None = None,
                                   task_config: TaskConfig | None = None, **train_overrides: Any) -> list[str]:
        """Submit one data-parallel job (a group of `num_workers` ranks); returns `[job_id]`.

        `batch_size` is per worker; the global batch is batch_size x num_workers. `task_config` (the
        seeds' TaskConfig) sets the job's name, priority, per-worker resources, max_retries and
        checkpointing (an argument that says otherwise is an error).
        """
        train: dict[str, Any] = {"model": model_path, "data": {"path": dataset_path, "max_length": max_length},
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
        st = self._local_task_status(task_id)
        if st is not None:
            return st
        return self.backend.get_job_status(task_id)

    def monitor_tasks(self, task_ids: list[str], callback: Callable[[str, dict], None] | None = None,
                      poll: float = 1.0, timeout: float | None = None) -> dict[str, dict[str, Any]]:
        """Watch tasks until each is completed, failed or cancelled (or paused).

        `callback(task_id, status)` runs whenever a task's state or progress changes; status holds
        state, progress, node (and nodes), samples_done/total, eta_s and error.
        """
        deadline = None if timeout is None else time.time() + timeout
        last: dict[str, tuple] = {}
        statuses: dict[str, dict] = {}
        while True:
            for tid in task_ids:
                st = self.task_status(tid)
                statuses[tid] = st
                key = (st.get("state"), round(float(st.get("progress") or 0.0), 4), st.get("node"))
                if last.get(tid) != key:
                    last[tid] = key
                    if callback:
                        callback(tid, st)
            if all(s.get("state") in FINAL_STATES + ("paused",) for s in statuses.values()):
                return statuses
            if deadline and time.time() > deadline:
                return statuses
            time.sleep(poll)

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


def _shutdown_at_exit(ref: "weakref.ref[Orchestrator]") -> None:
    orch = ref()
    if orch is not None and getattr(orch, "_distill_state", None) is not None:
        orch.shutdown_distill()


def create_distributed_training(mode: str = "data_parallel", config: dict[str, Any] | None = None, *,
                                coordinator: str | None = None, token: str | None = None,
                                state_dir: str | Path | None = None) -> Orchestrator:
    """An Orchestrator on the given/configured coordinator, or on an embedded cluster of this machine."""
    return Orchestrator(mode, config, coordinator=coordinator, token=token, state_dir=state_dir)
