"""`smolforge.Client`: the coordinator's REST API from Python, with the seeds' method names.

    from smolforge import Client
    c = Client("192.168.1.10", 5000, token="…")
    job_id = c.submit_job("job.yaml")            # or a dict; local data files are uploaded first
    c.get_job_status(job_id)                     # state, progress, samples, ETA, nodes, error
    c.pause_job(job_id); c.resume_job(job_id); c.cancel_job(job_id)
    c.join_job(job_id)                           # lend the coordinator node at the next checkpoint
    c.job_logs(job_id); c.list_nodes(); c.list_jobs()
    c.wait_for_job(job_id); c.download_adapter(job_id, "outputs/run")

Errors come back as SmolforgeError with the server's what / where / fix.
"""

from __future__ import annotations

import copy
import hashlib
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from smolforge.cluster.control.kinds import apply_job_overrides, check_fields, read_named, stage_spec
from smolforge.config import placed
from smolforge.cluster.control.specs import from_seed_task
from smolforge.cluster.control.jobview import format_event, job_status
from smolforge.errors import SmolforgeError

if TYPE_CHECKING:
    from smolforge.cluster.face import Backend
    from smolforge.cluster.nodes.ray_glue import ClusterHandle


class Client:
    runs_in_process = False  # jobs run on the coordinator: commands may return while they run
    def __init__(self, host: str | None = None, port: int | None = None, token: str | None = None, *,
                 token_file: str | Path | None = None, tls_fingerprint: str | None = None, timeout: float = 60.0,
                 state_dir: str | Path | None = None):
        """`Client()` alone talks to the coordinator running from this machine's state dir (default
        $SMOLFORGE_HOME), with its token; otherwise give HOST[:PORT] and the token, best as a file
        (`token_file`) or $SMOLFORGE_TOKEN / $SMOLFORGE_TOKEN_FILE. An `https://` address needs the
        certificate fingerprint `coordinator start --tls` printed (`tls_fingerprint` or
        $SMOLFORGE_TLS_FINGERPRINT; the local coordinator's is read from its state dir)."""
        import httpx

        from smolforge.auth import resolve_token
        from smolforge.cluster.nodes.statedir import StateDir
        from smolforge.cluster.nodes.worker import parse_coordinator, tls_for

        local = StateDir.at(state_dir) if (host is None or state_dir is not None) else None
        info = (local.read_coordinator() or {}) if local else {}
        if host is None:
            host, port = info.get("api") or info.get("host_for_clients", "127.0.0.1"), port or info.get("port")
        scheme, host, port = parse_coordinator(host, int(port or 5000))
        self.host, self.port = host, port
        self.base = f"{scheme}://{self.host}:{self.port}"
        if scheme == "https" and not tls_fingerprint and info.get("api") == self.base:
            tls_fingerprint = info.get("tls_fingerprint")  # the coordinator of this machine's state dir
        verify = tls_for(scheme, host, port, tls_fingerprint)
        token = resolve_token(token, token_file, local.root if local else None)
        self.token = token
        self._http = httpx.Client(base_url=self.base, timeout=timeout,
                                  headers={"Authorization": f"Bearer {token}"} if token else {},
                                  **({"verify": verify} if verify is not None else {}))

    def __repr__(self) -> str:
        return f"Client({self.base})"

    def close(self) -> None:
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- plumbing ---------------------------------------------------------------------------------

    def _request(self, method: str, path: str, raw: bool = False, retry: bool | None = None, **kw) -> Any:
        """One API call. GETs (and calls marked retry=True) are retried on a dropped connection:
        a keep-alive connection closed by the server just as we reuse it is not an error."""
        import httpx

        retry = method == "GET" if retry is None else retry
        attempts = 3 if retry else 1
        for attempt in range(attempts):
            try:
                body = kw.get("content")
                if callable(body):  # a fresh stream per attempt (uploads)
                    kw = {**kw, "content": body()}
                r = self._http.request(method, path, **{k: v for k, v in kw.items()})
                break
            except (httpx.RemoteProtocolError, httpx.ConnectError, httpx.ReadError) as err:
                if attempt + 1 < attempts:
                    time.sleep(0.5 * (attempt + 1))
                    continue
                raise SmolforgeError(f"cannot reach the coordinator at {self.base} ({type(err).__name__})",
                                     fix="start it with `smolforge coordinator start`, or pass --coordinator HOST:PORT") from None
            except httpx.HTTPError as err:
                raise SmolforgeError(f"cannot reach the coordinator at {self.base} ({type(err).__name__})",
                                     fix="start it with `smolforge coordinator start`, or pass --coordinator HOST:PORT") from None
        if r.status_code == 401:
            raise SmolforgeError("coordinator rejected the token", where=self.base,
                                 fix="pass --token-file F, a copy of the coordinator's token file (or set SMOLFORGE_TOKEN); "
                                     "`smolforge coordinator start` prints where it is")
        if r.status_code >= 400:
            try:
                body = r.json()
            except ValueError:
                body = {"error": r.text[:300]}
            # the spec key paths a refusal of a spec names (`config.placed`): one, or several across settings
            named = body.get("fields") or ([body.get("field")] if body.get("field") is not None else [])
            fields = tuple(tuple(f) for f in named if isinstance(f, list)) if isinstance(named, list) else ()
            raise SmolforgeError(str(body.get("error") or body.get("detail") or r.status_code),
                                 where=body.get("where") or self.base, fix=body.get("fix"), fields=fields)
        if not raw and r.headers.get("content-type", "").startswith("application/json"):
            return r.json()
        return r.content

    # -- cluster ----------------------------------------------------------------------------------

    def health(self) -> dict:
        return self._request("GET", "/health")

    def check_token(self) -> dict:
        return self._request("GET", "/api/v1/auth/check")

    def status(self) -> dict:
        return self._request("GET", "/api/v1/status")

    def ray_tls_env(self, node_dir: str | Path | None = None) -> dict[str, str]:
        """For a Ray driver on a TLS cluster: a certificate from the coordinator's CA, and Ray's environment."""
        from smolforge.cluster.nodes.ray_tls import request_node_env
        from smolforge.paths import home

        d = Path(node_dir) if node_dir else home() / "ray-tls" / f"{self.host}-{self.port}"
        return request_node_env(lambda path, body: self._request("POST", path, json=body), d)

    def ray_cluster(self) -> "ClusterHandle":
        """This process joined to the coordinator's Ray cluster as a driver (a `ray_glue.ClusterHandle`),
        with a certificate from the cluster's CA first where it runs TLS."""
        from smolforge.cluster.nodes import ray_glue

        info = self.check_token()
        if info.get("ray_tls"):  # this driver needs its own certificate from the cluster's CA
            os.environ.update(self.ray_tls_env())
        return ray_glue.connect(info["ray_address"], token=self.token)

    def list_nodes(self) -> list[dict]:
        return self._request("GET", "/api/v1/nodes")

    def resources(self) -> list[dict]:
        return self._request("GET", "/api/v1/resources")

    def metrics_text(self) -> str:
        return self._request("GET", "/metrics").decode()

    # -- jobs ---------------------------------------------------------------------------------------

    def upload(self, path: str | Path) -> str:
        """Send a local file to the coordinator; returns `upload:<sha256>` for a job spec."""
        path = Path(path)
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        digest = h.hexdigest()

        def stream():
            with open(path, "rb") as f:
                yield from iter(lambda: f.read(1 << 20), b"")

        # content-addressed, so sending it twice is harmless: safe to retry
        out = self._request("POST", "/api/v1/uploads", content=stream, retry=True,
                            headers={"Content-Type": "application/octet-stream"})
        if out["id"] != digest:
            raise SmolforgeError(f"upload of {path} arrived corrupted", fix="retry")
        return out["ref"]

    def submit_job(self, spec: dict | str | Path, overrides: list[str] | None = None) -> str:
        """Submit a job spec (dict, or a YAML file); returns the job id. Local data files are uploaded.

        The seeds' task shape is a data-parallel job: `{"model": M, "dataset": D, "priority": "high",
        "resources": {"gpu_ids": [0, 1], "cpu_cores": 16, "ram_gb": 32}, "max_retries": 3,
        "checkpointing": True}` (specs.from_seed_task). A job whose nodes are busy is queued
        (`pending`, with its `pending_reason`); one no node could ever run fails here, listing the nodes.
        """
        from smolforge.config import load_yaml

        data = load_yaml(spec) if isinstance(spec, (str, Path)) else copy.deepcopy(dict(spec))
        data = from_seed_task(data)
        apply_job_overrides(data, overrides or [])
        data = read_named(data)
        check_fields(data)  # a spec file's bad field as file:line, before any upload
        data = stage_spec(data, self.upload)
        try:
            return self._request("POST", "/api/v1/jobs", json=data)["job_id"]
        except SmolforgeError as err:  # the coordinator's refusal names the field: at the file's line
            raise placed(err, data) from None

    def remember_output_dir(self, job_id: str, output_dir: str | Path) -> None:
        """Nothing to remember: a coordinator's job outlives the command, and `job resume` of it
        downloads nothing (`EmbeddedCluster.remember_output_dir` is where it matters)."""

    def list_jobs(self, state: str | None = None) -> list[dict]:
        return self._request("GET", "/api/v1/jobs", params={"state": state} if state else None)

    def get_job(self, job_id: str) -> dict:
        return self._request("GET", f"/api/v1/jobs/{job_id}")

    def get_job_status(self, job_id: str) -> dict:
        job = self.get_job(job_id)
        st = job_status(job)
        st["tasks"] = job.get("tasks", [])
        return st

    def pause_job(self, job_id: str) -> dict:
        return job_status(self._request("POST", f"/api/v1/jobs/{job_id}/pause"))

    def resume_job(self, job_id: str) -> dict:
        return job_status(self._request("POST", f"/api/v1/jobs/{job_id}/resume"))

    def cancel_job(self, job_id: str) -> dict:
        return job_status(self._request("POST", f"/api/v1/jobs/{job_id}/cancel"))

    def delete_job(self, job_id: str) -> dict:
        """Remove a finished (or damaged) job and its artifacts: {"job_id", "deleted": True}."""
        return self._request("DELETE", f"/api/v1/jobs/{job_id}")

    def join_job(self, job_id: str, node: str | None = None) -> dict:
        """Lend the coordinator node (or `node`) to a running data-parallel job."""
        return job_status(self._request("POST", f"/api/v1/jobs/{job_id}/join", json={"node": node}))

    def leave_job(self, job_id: str, node: str | None = None) -> dict:
        """Give back the coordinator node (or `node`), lent with `join_job`, at the job's next boundary."""
        return job_status(self._request("POST", f"/api/v1/jobs/{job_id}/leave", json={"node": node}))

    def job_events(self, job_id: str, since: int = 0) -> list[dict]:
        return self._request("GET", f"/api/v1/jobs/{job_id}/events", params={"since": since})

    def job_logs(self, job_id: str, since: int = 0) -> list[str]:
        return [format_event(e) for e in self.job_events(job_id, since)]

    def task_logs(self, job_id: str, since: int = 0, task: str | None = None) -> list[dict]:
        """The lines the job's tasks printed (`{"id", "task", "node", "ts", "line"}`) after line `since`."""
        params: dict = {"since": since}
        if task:
            params["task"] = task
        return self._request("GET", f"/api/v1/jobs/{job_id}/logs", params=params)

    def search_logs(self, job: str | None = None, node: str | None = None, task: str | None = None,
                    level: str | None = None, grep: str | None = None, regex: bool = False, since: str | None = None,
                    after: int | None = None, limit: int = 1000) -> list[dict]:
        """Task lines across jobs (`GET /api/v1/logs`; `JobStore.search_logs` says the filters), oldest first:
        the newest `limit` that match, or the first `limit` after line id `after`."""
        params = {k: v for k, v in (("job", job), ("node", node), ("task", task), ("level", level), ("grep", grep),
                                    ("since", since), ("after", after)) if v is not None}
        return self._request("GET", "/api/v1/logs", params={**params, "limit": limit, **({"regex": "true"} if regex
                                                                                          else {})})

    def job_metrics(self, job_id: str, name: str | None = None) -> list[dict]:
        return self._request("GET", f"/api/v1/jobs/{job_id}/metrics", params={"name": name} if name else None)

    def wait_for_job(self, job_id: str, timeout: float | None = None, poll: float = 1.0,
                     callback: Callable[[dict], None] | None = None, until_paused: bool = True) -> dict:
        """Poll until the job is completed, failed, cancelled (or paused); returns its status."""
        deadline = None if timeout is None else time.time() + timeout
        while True:
            st = job_status(self.get_job(job_id))
            if callback:
                callback(st)
            if st["state"] in ("completed", "failed", "cancelled") or (until_paused and st["state"] == "paused"):
                return st
            if deadline and time.time() > deadline:
                raise SmolforgeError(f"job {job_id} still {st['state']} after {timeout:.0f} s",
                                     fix="wait longer or check `smolforge job logs " + job_id + "`")
            time.sleep(poll)

    def list_artifacts(self, job_id: str) -> list[dict]:
        return self._request("GET", f"/api/v1/jobs/{job_id}/artifacts")

    def download_artifact(self, job_id: str, kind: str, name: str, dest: str | Path, overwrite: bool = False) -> Path:
        """Fetch one artifact directory, checking every file's sha256; written atomically. A `dest`
        that already holds exactly this artifact is left as it is; one holding other files is
        refused unless `overwrite`."""
        from smolforge.parallel.transfer import check_download_dest, unpack_dir

        entry = next((a for a in self.list_artifacts(job_id) if a["kind"] == kind and a["name"] == name), None)
        if entry is None:
            raise SmolforgeError(f"job {job_id} has no artifact {kind}/{name}", fix="list them with Client.list_artifacts")
        if check_download_dest(dest, entry["sha256"], overwrite):
            return Path(dest)
        files = {rel: self._request("GET", f"/api/v1/jobs/{job_id}/artifacts/{kind}/{name}/{rel}", raw=True)
                 for rel in entry["files"]}
        return unpack_dir({"files": files, "sha256": entry["sha256"]}, dest)

    def download_adapter(self, job_id: str, output_dir: str | Path, overwrite: bool = False) -> Path:
        """The finished job's adapter into `<output_dir>/<method>_adapter/`."""
        adapters = [a for a in self.list_artifacts(job_id) if a["kind"] == "adapter"]
        if not adapters:
            raise SmolforgeError(f"job {job_id} has no adapter yet", fix="wait for it to complete")
        name = adapters[-1]["name"]
        return self.download_artifact(job_id, "adapter", name, Path(output_dir) / name, overwrite)


def backend_for(coordinator: str | None = None, token: str | None = None, state_dir: str | Path | None = None,
                embedded_ok: bool = False, num_cpus: int | None = None, token_file: str | Path | None = None) -> "Backend":
    """A Client for the given/configured coordinator, else (if allowed) the embedded cluster.

    Configured means: --coordinator / $SMOLFORGE_COORDINATOR, or a coordinator recorded in the state
    dir (default $SMOLFORGE_HOME) that answers /health.
    """
    from smolforge.cluster.nodes.statedir import StateDir, port_open

    coordinator = coordinator or os.environ.get("SMOLFORGE_COORDINATOR")
    sd = StateDir.at(state_dir)
    if not coordinator:
        info = sd.read_coordinator()
        if info and port_open(info.get("host_for_clients", "127.0.0.1"), int(info.get("port", 0)), 0.5):
            coordinator = info.get("api") or f"{info.get('host_for_clients', '127.0.0.1')}:{info['port']}"
    if coordinator:
        return Client(coordinator, None, token=token, token_file=token_file, state_dir=sd.root)
    if embedded_ok:
        from smolforge.cluster.embedded import EmbeddedCluster  # starts Ray: only when it is the choice

        return EmbeddedCluster(num_cpus=num_cpus)
    raise SmolforgeError("no coordinator given and none running from " + str(sd.root),
                         fix="pass --coordinator HOST:PORT --token-file F (or set SMOLFORGE_COORDINATOR / SMOLFORGE_TOKEN), "
                             "or start one with `smolforge coordinator start`")
