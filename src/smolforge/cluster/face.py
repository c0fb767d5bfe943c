"""The cluster's face: what `cli/`, `orchestrator.py` and the seeds' scripts use of the cluster.

`Backend` is the one interface over the two ways to run jobs: `smolforge.Client` (a coordinator's
REST API) and `cluster.embedded.EmbeddedCluster` (the cluster of this machine, in this process).
Both implement every method below (`tests/test_backend_face.py` compares their methods and
signatures with this protocol), so a caller never asks which one it holds: `runs_in_process` is the
one difference it may act on (a job started here must be followed to its end, and writes where the
command said, not into a coordinator's store).

The callers of jobs import nothing from `cluster/workloads/` or `cluster/nodes/` (an import-linter
contract, `.importlinter` `face`): what they need of those packages is named here. Importing this
module is cheap: those names are imported on first use (PEP 562), Ray and torch where they are used.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:
    from smolforge.cluster.nodes.discovery import check_node_name
    from smolforge.cluster.nodes.ray_glue import ClusterHandle
    from smolforge.cluster.nodes.statedir import check_port
    from smolforge.cluster.nodes.worker import WorkerNode, WorkerOptions, request_rescan
    from smolforge.cluster.workloads.distill.runner import split_task_id
    from smolforge.cluster.workloads.distill.session import DistillSession
    from smolforge.cluster.workloads.distill.plans import StudentCall, TeacherCall, plan_students, plan_teachers, store_dir_of

__all__ = ["Backend", "holds_jobs", "check_node_name", "check_port", "WorkerNode", "WorkerOptions", "request_rescan",
           "split_task_id", "DistillSession", "TeacherCall", "StudentCall", "plan_teachers", "plan_students",
           "store_dir_of"]


@runtime_checkable
class Backend(Protocol):
    """Jobs and nodes of one cluster: a coordinator's (`Client`) or this machine's (`EmbeddedCluster`).

    Statuses are `jobview.job_status` dicts (state, progress, nodes, error, result, ...); a job id may
    be a unique prefix or the job's name. Errors are `SmolforgeError` (an unknown job, a refused spec,
    a coordinator that cannot be reached)."""

    runs_in_process: bool  # True: a job started or resumed here runs in this process, which must follow it
    base: str  # the coordinator's URL, or "embedded"

    def close(self) -> None: ...
    def __enter__(self) -> Any: ...
    def __exit__(self, *exc: Any) -> None: ...

    def status(self) -> dict: ...
    def list_nodes(self) -> list[dict]: ...
    def resources(self) -> list[dict]: ...
    def ray_cluster(self) -> "ClusterHandle": ...

    def upload(self, path: str | Path) -> str: ...
    def submit_job(self, spec: dict | str | Path, overrides: list[str] | None = None) -> str: ...
    def remember_output_dir(self, job_id: str, output_dir: str | Path) -> None: ...
    def list_jobs(self, state: str | None = None) -> list[dict]: ...
    def get_job(self, job_id: str) -> dict: ...
    def get_job_status(self, job_id: str) -> dict: ...
    def pause_job(self, job_id: str) -> dict: ...
    def resume_job(self, job_id: str) -> dict: ...
    def cancel_job(self, job_id: str) -> dict: ...
    def delete_job(self, job_id: str) -> dict: ...
    def join_job(self, job_id: str, node: str | None = None) -> dict: ...
    def leave_job(self, job_id: str, node: str | None = None) -> dict: ...
    def job_events(self, job_id: str, since: int = 0) -> list[dict]: ...
    def job_logs(self, job_id: str, since: int = 0) -> list[str]: ...
    def task_logs(self, job_id: str, since: int = 0, task: str | None = None) -> list[dict]: ...
    def search_logs(self, job: str | None = None, node: str | None = None, task: str | None = None,
                    level: str | None = None, grep: str | None = None, regex: bool = False, since: str | None = None,
                    after: int | None = None, limit: int = 1000) -> list[dict]: ...
    def job_metrics(self, job_id: str, name: str | None = None) -> list[dict]: ...
    def wait_for_job(self, job_id: str, timeout: float | None = None, poll: float = 1.0,
                     callback: Callable[[dict], None] | None = None, until_paused: bool = True) -> dict: ...
    def list_artifacts(self, job_id: str) -> list[dict]: ...
    def download_artifact(self, job_id: str, kind: str, name: str, dest: str | Path,
                          overwrite: bool = False) -> Path: ...
    def download_adapter(self, job_id: str, output_dir: str | Path, overwrite: bool = False) -> Path: ...


def holds_jobs(given: object) -> bool:
    """Whether what an `Orchestrator` was given runs jobs (a Backend, or a test's stand-in with its
    `submit_job`) or only holds a bare Ray handle (`.handle`, `.close()`: the distill tests' clusters),
    whose tasks then run in this process. Not a question about which Backend: both have every method."""
    return callable(getattr(given, "submit_job", None))


_LAZY = {
    "check_node_name": "smolforge.cluster.nodes.discovery",
    "check_models_dir": "smolforge.cluster.nodes.discovery",
    "discover": "smolforge.cluster.nodes.discovery",
    "discover_models": "smolforge.cluster.nodes.discovery",
    "by_backend": "smolforge.cluster.nodes.discovery",
    "check_port": "smolforge.cluster.nodes.statedir",
    "WorkerNode": "smolforge.cluster.nodes.worker",
    "WorkerOptions": "smolforge.cluster.nodes.worker",
    "request_rescan": "smolforge.cluster.nodes.worker",
    "split_task_id": "smolforge.cluster.workloads.distill.runner",
    "DistillSession": "smolforge.cluster.workloads.distill.session",
    "TeacherCall": "smolforge.cluster.workloads.distill.plans",
    "StudentCall": "smolforge.cluster.workloads.distill.plans",
    "plan_teachers": "smolforge.cluster.workloads.distill.plans",
    "plan_students": "smolforge.cluster.workloads.distill.plans",
    "store_dir_of": "smolforge.cluster.workloads.distill.plans",
}


def __getattr__(name: str) -> Any:
    """The names above, imported from their modules on first use (AttributeError for any other)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
