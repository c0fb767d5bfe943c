"""The embedded cluster: no coordinator running, so this process is the coordinator.

`ray_glue.connect()` starts an in-process Ray cluster of this machine (advertised as a worker), and
the very same JobManager, worker group and control actor as on a real cluster run the job. The
object implements `cluster.face.Backend`, as `Client` does, so callers do not care which one they
hold. State (job store, artifacts) lives in `$SMOLFORGE_HOME/embedded/`.

Ray starts only when something must run (a submit, a resume, the node table): `smolforge jobs` and
`job show` read the store. A job runs inside the command that started (or resumed) it, which
follows it to the end. If that process dies (killed, a closed laptop lid, a power cut), the next
embedded command finds the job still `running` with no live owner and marks it `paused`
("interrupted"); `smolforge job resume ID` continues it from its last checkpoint.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable

import psutil

from smolforge.cluster.nodes import ray_glue, ray_session
from smolforge.cluster.nodes.ray_glue import ClusterHandle
from smolforge.cluster.control.artifacts import ArtifactStore
from smolforge.cluster.control.kinds import (apply_job_overrides, check_fields, parse, pin_local_models, read_named,
                                           stage_spec)
from smolforge.cluster.control.specs import from_seed_task
from smolforge.cluster.control.jobstore import JobStore
from smolforge.cluster.control.jobview import format_event, job_status
from smolforge.cluster.control.manager import JobManager
from smolforge.cluster.nodes.nodeview import node_view
from smolforge.cluster.nodes.statedir import StateDir
from smolforge.cluster.control.states import parse_states
from smolforge.config import load_yaml, placed
from smolforge.errors import SmolforgeError
from smolforge.parallel.transfer import check_download_dest, unpack_dir
from smolforge.paths import atomic_write_json, home


class EmbeddedCluster:
    runs_in_process = True  # a command that starts or resumes a job here must follow it to its end

    def __init__(self, state_dir: str | Path | None = None, num_cpus: int | None = None):
        self.state = StateDir.at(state_dir or home() / "embedded")
        self.num_cpus = num_cpus
        self._handle = None
        self.store = JobStore(self.state.db_path)
        self.artifacts = ArtifactStore(self.state.artifacts)
        self.manager = JobManager(self.store, self.artifacts, embedded=True, on_start=self._own)
        self.base = "embedded"
        self.reaped = ray_session.reap_dead(self.state.root)  # Ray agents a killed command left behind
        self.interrupted = self._mark_interrupted()

    @property
    def handle(self):
        """The in-process Ray cluster, started on first use."""
        if self._handle is None:
            self._handle = ray_glue.connect(None, state_dir=self.state.root, num_cpus=self.num_cpus)
            ray_session.record(self.state.root)  # so the next command can reap it if this one is killed
        return self._handle

    # -- who runs which job -----------------------------------------------------------------------

    def _owner_file(self, job_id: str) -> Path:
        return self.state.root / "owners" / f"{job_id}.json"

    def _own(self, job_id: str) -> None:
        """Record that this process runs the job (pid and start time: a reused pid is not the owner)."""
        me = psutil.Process()
        atomic_write_json(self._owner_file(job_id), {"pid": me.pid, "started": me.create_time()})

    def _owner_alive(self, job_id: str) -> bool:
        import json

        try:
            owner = json.loads(self._owner_file(job_id).read_text())
            proc = psutil.Process(int(owner["pid"]))
            return abs(proc.create_time() - float(owner["started"])) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE
        except (OSError, ValueError, KeyError, psutil.Error):
            return False

    def _mark_interrupted(self) -> list[str]:
        """Jobs left `running`/`pending` by an embedded command that is gone become `paused`, never
        `running` forever; `job resume` continues them from their last checkpoint."""
        found = []
        for job in self.store.list_jobs(states=("running", "pending")):
            if self._owner_alive(job["id"]):
                continue
            self.manager.mark_interrupted(job["id"])
            found.append(job["id"])
        return found

    def __repr__(self) -> str:
        return f"EmbeddedCluster({self.state.root})"

    def close(self) -> None:
        self.manager.shutdown(timeout=10)
        if self._handle is not None:
            self._handle.shutdown()
            ray_session.forget(self.state.root)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the Client surface (cluster.face.Backend) -------------------------------------------------

    def ray_cluster(self) -> ClusterHandle:
        """The in-process Ray cluster (`handle`), started on first use."""
        return self.handle

    def list_nodes(self) -> list[dict]:
        return [node_view(n, state="online", usage=None, heartbeat_age_s=None) for n in self.handle.nodes()]

    def status(self) -> dict:
        return {"coordinator": {"name": "embedded", "api": None, "ray_address": "local"},
                "nodes": self.list_nodes(), "jobs": self.store.list_jobs(states=("pending", "running", "paused")),
                "recent_jobs": self.store.list_jobs(limit=20)}

    def resources(self) -> list[dict]:
        return [{"name": n["name"], "role": n["role"], "state": n["state"], "total": n["ray_resources"],
                 "available": n["available"], "usage": None} for n in self.list_nodes()]

    def upload(self, path: str | Path) -> str:
        return "upload:" + self.artifacts.add_upload(path)

    def submit_job(self, spec: dict | str | Path, overrides: list[str] | None = None) -> str:
        data = load_yaml(spec) if isinstance(spec, (str, Path)) else copy.deepcopy(dict(spec))
        data = from_seed_task(data)  # before --set, as the client: a --set key goes into the job's train section
        apply_job_overrides(data, overrides or [])
        data = read_named(data)
        check_fields(data)  # a spec file's bad field as file:line, before an upload or the cluster starts
        spec = pin_local_models(stage_spec(data, self.upload))
        try:
            job = parse(spec)  # the kind's value checks, before the cluster starts: a refused field at its line
        except SmolforgeError as err:
            raise placed(err, spec) from None
        self.handle  # noqa: B018  (placement is checked against the live node table)
        return self.manager.submit(spec, job)

    def list_jobs(self, state: str | None = None) -> list[dict]:
        return self.store.list_jobs(states=parse_states(state))

    def get_job(self, job_id: str) -> dict:
        job = self.store.get_job(job_id)
        return {**job, "tasks": self.store.tasks(job["id"])}

    def get_job_status(self, job_id: str) -> dict:
        job = self.get_job(job_id)
        return {**job_status(job), "tasks": job["tasks"]}

    def pause_job(self, job_id: str) -> dict:
        return job_status(self.manager.pause(job_id))

    def resume_job(self, job_id: str) -> dict:
        self.handle  # noqa: B018  (the job runs on this process's cluster)
        return job_status(self.manager.resume(job_id))

    def cancel_job(self, job_id: str) -> dict:
        return job_status(self.manager.cancel(job_id))

    def delete_job(self, job_id: str) -> dict:
        return self.manager.delete(job_id)

    def join_job(self, job_id: str, node: str | None = None) -> dict:
        return job_status(self.manager.join(job_id, node))

    def leave_job(self, job_id: str, node: str | None = None) -> dict:
        return job_status(self.manager.leave(job_id, node))

    def job_events(self, job_id: str, since: int = 0) -> list[dict]:
        return self.store.events(self.store.get_job(job_id)["id"], since_id=since)

    def job_logs(self, job_id: str, since: int = 0) -> list[str]:
        return [format_event(e) for e in self.job_events(job_id, since)]

    def task_logs(self, job_id: str, since: int = 0, task: str | None = None) -> list[dict]:
        return self.store.logs(self.store.get_job(job_id)["id"], since_id=since, task=task)

    def search_logs(self, job: str | None = None, node: str | None = None, task: str | None = None,
                    level: str | None = None, grep: str | None = None, regex: bool = False, since: str | None = None,
                    after: int | None = None, limit: int = 1000) -> list[dict]:
        """Task lines across this machine's jobs (`JobStore.search_logs`; `after` is its `since_id`)."""
        return self.store.search_logs(job=job, node=node, task=task, level=level, grep=grep, regex=regex, since=since,
                                      since_id=after, limit=limit)

    def job_metrics(self, job_id: str, name: str | None = None) -> list[dict]:
        return self.store.metrics(self.store.get_job(job_id)["id"], name)

    def wait_for_job(self, job_id: str, timeout: float | None = None, poll: float = 1.0,
                     callback: Callable[[dict], None] | None = None, until_paused: bool = True) -> dict:
        job = self.manager.wait(job_id, timeout=timeout, on_update=(lambda j: callback(job_status(j))) if callback else None)
        return job_status(job)

    def list_artifacts(self, job_id: str) -> list[dict]:
        return self.artifacts.all_for_job(self.store.get_job(job_id)["id"])

    def remember_output_dir(self, job_id: str, output_dir: str | Path) -> None:
        """Where the command that submitted the job downloads its adapter: `job resume` of the job,
        interrupted, downloads it there too."""
        atomic_write_json(self.state.root / "downloads" / f"{job_id}.json", {"output_dir": str(Path(output_dir).resolve())})

    def output_dir_of(self, job_id: str) -> Path | None:
        import json

        try:
            return Path(json.loads((self.state.root / "downloads" / f"{job_id}.json").read_text())["output_dir"])
        except (OSError, ValueError, KeyError):
            return None

    def adapter_path(self, job_id: str) -> Path | None:
        """The job's newest adapter in this cluster's artifact store (where it is when nothing downloaded it)."""
        names = self.artifacts.list(job_id, "adapter")
        return self.artifacts.path(job_id, "adapter", names[-1]) if names else None

    def download_adapter(self, job_id: str, output_dir: str | Path, overwrite: bool = False) -> Path:
        job_id = self.store.get_job(job_id)["id"]
        names = self.artifacts.list(job_id, "adapter")
        if not names:
            raise SmolforgeError(f"job {job_id} has no adapter yet", fix="wait for it to complete")
        return self.download_artifact(job_id, "adapter", names[-1], Path(output_dir) / names[-1], overwrite)

    def download_artifact(self, job_id: str, kind: str, name: str, dest: str | Path, overwrite: bool = False) -> Path:
        """As Client.download_artifact: the same artifact already there is kept, other files refused."""
        job_id = self.store.get_job(job_id)["id"]
        payload = self.artifacts.get(job_id, kind, name)
        if check_download_dest(dest, payload["sha256"], overwrite):
            return Path(dest)
        return unpack_dir(payload, dest)
