"""The coordinator's control service (FastAPI): REST API, /metrics, /health and the dashboard.

Every route needs `Authorization: Bearer <token>`, checked before any body byte is read
(`gate.py`, which also bounds bodies: 413), except two that carry no data: `/health` (for load
balancers and `worker join`'s reachability check) and the `/dashboard` page shell, which a browser
loads before it has the token; the page then calls the API with the token it reads from the URL
fragment (`/dashboard#token=…`, never sent to the server) or a login box. Its static files (script,
vendored chart library) are open too, at fixed paths from `smolforge.dashboard.ASSETS`: each path
names one packaged file, nothing from the URL reaches the filesystem.

Errors are JSON `{"error", "where", "fix"}` with 400 (bad request: also a parameter out of range, a
body that is not JSON or nests too deep; see `cluster/api_input.py`), 401 (token), 404 (unknown job).
Handlers are plain `def`: FastAPI runs them in its thread pool, which suits SQLite and Ray calls.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from smolforge.cluster.api_input import (ERRORS, After, ApiError, BoundedJsonRoute, GrepText, JobFilter, JobId,
                                         JoinRequest, LeaveRequest, LevelWord, NodeId, NodeName, SeriesName, Since,
                                         SinceTime, StateList, TaskName, document_errors, rows, validation_error)
from smolforge.auth import bearer_of, tokens_match
from smolforge.gate import Gate
from smolforge.http_limits import page_headers
from smolforge.cluster.nodes.heartbeat import Heartbeat
from smolforge.cluster.metrics import render
from smolforge.cluster.nodes.ray_tls import ensure_ca, sign_request
from smolforge.cluster.control.states import parse_states
from smolforge.dashboard import ASSETS, asset, asset_paths, page
from smolforge.errors import SmolforgeError
from smolforge.input_rules import shown
from smolforge.paths import safe_join

MAX_UPLOAD_BYTES = int(os.environ.get("SMOLFORGE_MAX_UPLOAD_BYTES", str(20 * 2**30)))
# All uploads together; unreferenced ones are collected first when a new one would pass it.
UPLOAD_QUOTA_BYTES = int(os.environ.get("SMOLFORGE_UPLOAD_QUOTA_BYTES", str(50 * 2**30)))
# Every other route takes JSON (job specs, heartbeats): 4 MiB is far above any of them.
MAX_BODY_BYTES = int(os.environ.get("SMOLFORGE_MAX_BODY_BYTES", str(4 * 2**20)))
OPEN_PATHS = ("/health", "/dashboard", *asset_paths())


def job_view(job: dict, tasks: list[dict] | None = None) -> dict:
    out = dict(job)
    if tasks is not None:
        out["tasks"] = tasks
    return out


class CertificateRequest(BaseModel):
    csr: str = Field(max_length=16_384)


def create_app(core: Any) -> FastAPI:
    """`core` is a cluster.coordinator.CoordinatorCore (token, store, artifacts, manager, monitor, info).

    The routes are registered by group (what they serve), in the order they were always matched."""
    app = FastAPI(title="smolforge coordinator", docs_url=None, redoc_url=None, responses=ERRORS)  # /openapi.json: token
    app.router.route_class = BoundedJsonRoute  # JSON nesting counted before any parse
    document_errors(app)
    app.add_exception_handler(RequestValidationError, validation_error)
    # The token and the size bound before any body byte is read (see gate.py); the
    # dependency below stays as a second check on every route.
    app.add_middleware(Gate, token=lambda: core.token, open_paths=OPEN_PATHS, max_body=MAX_BODY_BYTES,
                       stream_paths={"/api/v1/uploads": MAX_UPLOAD_BYTES})

    def require_token(request: Request) -> None:
        if not tokens_match(bearer_of(request.headers.get("authorization")), core.token):
            raise HTTPException(status_code=401, detail="missing or wrong token",
                                headers={"WWW-Authenticate": "Bearer"})

    auth = [Depends(require_token)]
    _error_handlers(app)
    _open_routes(app, core)
    _cluster_routes(app, core, auth)
    _job_routes(app, core, auth)
    _log_routes(app, core, auth)
    _upload_routes(app, core, auth)
    return app


def _error_handlers(app: FastAPI) -> None:
    """Every refusal as `{"error", "where", "fix"}` (and `field`, the spec key path a refusal of a submitted
    spec names: the client finds its line, `config.placed`): ours (SmolforgeError) and Starlette's own."""

    @app.exception_handler(SmolforgeError)
    def _smolforge_error(request: Request, err: SmolforgeError):
        status = 404 if err.what.startswith("no job") else 400
        # a message may echo what the client sent: escaped, so that rendering it never fails (a 500)
        body: dict[str, Any] = {key: None if text is None else shown(text, 2000, controls=False) for key, text in
                                (("error", err.what), ("where", err.where), ("fix", err.fix))}
        if err.field:  # keys of the client's own spec, as it sent them: escaped as the message is
            named = [[part if isinstance(part, int) else shown(str(part), 200, controls=False) for part in f[:32]]
                     for f in err.fields[:8]]
            body["field"] = named[0]
            if len(named) > 1:  # a refusal across settings: each of them, the first leading (`config.placed`)
                body["fields"] = named
        return JSONResponse(body, status_code=status)

    @app.exception_handler(OSError)
    def _path_error(request: Request, err: OSError):
        """A name from the request the file system refuses (too long, not a name): the client's to fix, a
        400; never the path itself, which may be this machine's. Any other OSError is a bug (a 500)."""
        if err.filename is None:
            raise err
        return JSONResponse({"error": f"a name in the request cannot be a path here: {err.strerror}",
                             "where": None, "fix": "give a shorter name (each part of a path at most 255 "
                                                   "bytes) of letters, digits, '-', '_', '.' and '/'"},
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)  # FastAPI's own too: a body it cannot parse, an unknown path
    def _http_error(request: Request, err: StarletteHTTPException):
        fix = {401: "pass the cluster token (Authorization: Bearer <token>)",
               507: "set SMOLFORGE_UPLOAD_QUOTA_BYTES higher on the coordinator, or end the jobs that name old uploads "
                    "(uploads no pending, running or paused job names are collected after an hour)"}.get(err.status_code)
        return JSONResponse({"error": str(err.detail), "where": None, "fix": fix}, status_code=err.status_code,
                            headers=getattr(err, "headers", None))


def _open_routes(app: FastAPI, core: Any) -> None:
    """What answers without a token: /health and the dashboard's page shell and packaged files."""

    @app.get("/health")
    def health():
        return {"ok": True, "service": "smolforge-coordinator", "uptime_s": round(time.time() - core.started, 1)}

    @app.get("/dashboard", response_class=HTMLResponse)
    def dashboard():
        return HTMLResponse(page(), headers=page_headers(page()))

    @app.get("/dashboard/assets/{name}", responses={200: {"description": "one packaged file", "content": {
        media.split(";")[0]: {} for _, media in ASSETS.values()}}})
    def dashboard_asset(name: str):
        found = asset(name)  # an allow-list lookup: any other name is a 404, never a file path
        if found is None:
            raise HTTPException(status_code=404, detail=f"no dashboard file {name!r}")
        body, media_type = found
        return Response(body, media_type=media_type,
                        headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"})


def _cluster_routes(app: FastAPI, core: Any, auth: list) -> None:
    """The cluster as a whole: metrics, status, nodes (heartbeats, Ray TLS certificates), resources, events."""

    @app.get("/metrics", dependencies=auth, response_class=PlainTextResponse)
    def metrics():
        body, ctype = render(core)
        return Response(body, media_type=ctype)

    @app.get("/api/v1/auth/check", dependencies=auth)
    def auth_check():
        return {"ok": True, **core.public_info()}

    @app.get("/api/v1/status", dependencies=auth)
    def status():
        nodes = core.monitor.snapshot()
        active = core.store.list_jobs(states=("pending", "running", "paused"))
        return {"coordinator": core.public_info(), "nodes": nodes, "jobs": active,
                "recent_jobs": core.store.list_jobs(limit=20)}

    @app.get("/api/v1/nodes", dependencies=auth)
    def list_nodes():
        return core.monitor.snapshot()

    @app.post("/api/v1/ray-tls/certificate", dependencies=auth,
              responses={409: {"model": ApiError, "description": "this cluster does not use TLS"}})
    def ray_tls_certificate(req: CertificateRequest):
        """A joining node's certificate for Ray's TLS, signed by this cluster's CA (see cluster/nodes/ray_tls.py)."""
        if not core.info.get("ray_tls"):
            raise HTTPException(status_code=409, detail="this cluster does not use TLS")
        ca_cert, ca_key = ensure_ca(core.state.root / "tls")
        return {"certificate": sign_request(req.csr, ca_cert, ca_key), "ca": ca_cert.read_text()}

    @app.post("/api/v1/nodes/{node_id}/heartbeat", dependencies=auth,
              responses={404: {"model": ApiError, "description": "no node of this id has joined the cluster"}})
    def heartbeat(node_id: NodeId, sample: Heartbeat):
        if not core.monitor.heartbeat(node_id, sample.model_dump()):  # kept for joined nodes only
            return JSONResponse({"error": f"no node {node_id} has joined this cluster", "where": None,
                                 "fix": "join the node first (`smolforge worker join`); its agent then reports by "
                                        "itself"}, status_code=404)
        return {"ok": True}

    @app.get("/api/v1/resources", dependencies=auth)
    def resources():
        return [{"name": n["name"], "role": n["role"], "state": n["state"], "total": n["ray_resources"],
                 "available": n["available"], "usage": n["usage"]} for n in core.monitor.snapshot()]

    @app.get("/api/v1/events", dependencies=auth)
    def cluster_events(since: Since = 0, limit: int = rows(500)):
        return core.store.events(None, since_id=since, limit=limit)


def _job_routes(app: FastAPI, core: Any, auth: list) -> None:
    """Jobs: list, submit, show, their events, logs, metrics and artifacts, and the moves (pause, resume,
    cancel, join, leave) the manager makes."""

    @app.get("/api/v1/jobs", dependencies=auth)
    def list_jobs(state: StateList = None, limit: int = rows(200)):
        return core.store.list_jobs(states=parse_states(state), limit=limit)

    @app.post("/api/v1/jobs", dependencies=auth)
    def submit_job(spec: dict):
        job_id = core.manager.submit(spec)
        return {"job_id": job_id, "job": core.store.get_job(job_id)}

    @app.get("/api/v1/jobs/{job_id}", dependencies=auth)
    def get_job(job_id: JobId):
        job = core.store.get_job(job_id)
        return job_view(job, core.store.tasks(job["id"]))

    @app.get("/api/v1/jobs/{job_id}/events", dependencies=auth)
    def job_events(job_id: JobId, since: Since = 0, limit: int = rows(1000)):
        job = core.store.get_job(job_id)
        return core.store.events(job["id"], since_id=since, limit=limit)

    @app.get("/api/v1/jobs/{job_id}/logs", dependencies=auth)
    def job_logs(job_id: JobId, since: Since = 0, task: TaskName = None, limit: int = rows(1000)):
        """What the job's tasks printed and logged (`r0`, `teacher0`...), oldest first, after line `since`."""
        job = core.store.get_job(job_id)
        return core.store.logs(job["id"], since_id=since, task=task, limit=limit)

    @app.get("/api/v1/jobs/{job_id}/metrics", dependencies=auth)
    def job_metrics(job_id: JobId, name: SeriesName = None):
        job = core.store.get_job(job_id)
        return core.store.metrics(job["id"], name)

    @app.post("/api/v1/jobs/{job_id}/pause", dependencies=auth)
    def pause(job_id: JobId):
        return core.manager.pause(job_id)

    @app.post("/api/v1/jobs/{job_id}/resume", dependencies=auth)
    def resume(job_id: JobId):
        return core.manager.resume(job_id)

    @app.post("/api/v1/jobs/{job_id}/cancel", dependencies=auth)
    def cancel(job_id: JobId):
        return core.manager.cancel(job_id)

    @app.delete("/api/v1/jobs/{job_id}", dependencies=auth)
    def delete_job(job_id: JobId):
        """Remove a finished (or damaged) job and its artifacts; a running or paused one is refused (400)."""
        return core.manager.delete(job_id)

    @app.post("/api/v1/jobs/{job_id}/join", dependencies=auth)
    def join(job_id: JobId, body: JoinRequest | None = None):
        return core.manager.join(job_id, body.node if body else None)

    @app.post("/api/v1/jobs/{job_id}/leave", dependencies=auth)
    def leave(job_id: JobId, body: LeaveRequest | None = None):
        """Give back a node lent with `join` (default: the coordinator); it leaves at the job's next boundary."""
        return core.manager.leave(job_id, body.node if body else None)

    @app.get("/api/v1/jobs/{job_id}/artifacts", dependencies=auth)
    def artifacts(job_id: JobId):
        job = core.store.get_job(job_id)
        return core.artifacts.all_for_job(job["id"])

    @app.get("/api/v1/jobs/{job_id}/artifacts/{kind}/{name}/{path:path}", dependencies=auth,
             response_class=FileResponse, responses={200: {"description": "the file's bytes",
                                                           "content": {"application/octet-stream": {}}}})
    def artifact_file(job_id: JobId, kind: str, name: str, path: str):
        job = core.store.get_job(job_id)
        if not core.artifacts.verify(job["id"], kind, name):
            raise SmolforgeError(f"artifact {kind}/{name} of {job['id']} is missing or corrupt",
                                 fix="list artifacts with `smolforge job show ID`")
        target = safe_join(core.artifacts.path(job["id"], kind, name), path)
        if not target.is_file():
            raise SmolforgeError(f"no file {path} in {kind}/{name}", fix="list the artifact's files first")
        return FileResponse(target, media_type="application/octet-stream")


def _log_routes(app: FastAPI, core: Any, auth: list) -> None:
    """Task lines across jobs and nodes: `smolforge logs` and the dashboard's log view."""

    @app.get("/api/v1/logs", dependencies=auth)
    def search_logs(job: JobFilter = None, node: NodeName = None, task: TaskName = None, level: LevelWord = None,
                    grep: GrepText = None, regex: bool = False, since: SinceTime = None, after: After = None,
                    limit: int = rows(1000)):
        """What every job's tasks printed and logged, oldest first (`{"id", "job_id", "task", "node", "ts",
        "level", "line"}`): the newest `limit` lines that match, or with `after` the first `limit` after
        that line id. A level, time or pattern it cannot read is a 400 naming the parameter."""
        try:
            return core.store.search_logs(job=job, node=node, task=task, level=level, grep=grep, regex=regex,
                                          since=since, since_id=after, limit=limit)
        except SmolforgeError as err:
            if err.where in ("level", "since", "grep"):
                raise SmolforgeError(err.what, where=f"query.{err.where}", fix=err.fix) from None
            raise


def _upload_routes(app: FastAPI, core: Any, auth: list) -> None:
    """Uploads: a raw body streamed to a content-addressed file within the size bound and the quota."""

    @app.post("/api/v1/uploads", dependencies=auth,
              responses={507: {"model": ApiError, "description": "the upload quota is full"}})
    async def upload(request: Request):
        """Raw body in, content-addressed file out: `upload:<sha256>` can then be used in a job spec."""
        up_dir = core.artifacts.root / "uploads"
        up_dir.mkdir(parents=True, exist_ok=True)
        h = hashlib.sha256()
        size = 0
        declared = int(request.headers.get("content-length") or 0)
        used = core.artifacts.uploads_bytes()
        if used + declared > UPLOAD_QUOTA_BYTES:
            core.collect_uploads()
            used = core.artifacts.uploads_bytes()

        def over_quota() -> HTTPException:
            return HTTPException(status_code=507, detail=f"the coordinator's upload quota ({UPLOAD_QUOTA_BYTES:,} bytes, "
                                 f"{used:,} used by uploads that live jobs still name) is full")

        if used + declared > UPLOAD_QUOTA_BYTES:
            raise over_quota()
        fd, tmp = tempfile.mkstemp(dir=up_dir, prefix=".upload.")
        try:
            with os.fdopen(fd, "wb") as f:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > MAX_UPLOAD_BYTES:
                        raise SmolforgeError(f"upload larger than {MAX_UPLOAD_BYTES} bytes",
                                             fix="set SMOLFORGE_MAX_UPLOAD_BYTES on the coordinator")
                    if used + size > UPLOAD_QUOTA_BYTES:
                        raise over_quota()
                    h.update(chunk)
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            digest = h.hexdigest()
            os.replace(tmp, up_dir / digest)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return {"id": digest, "ref": f"upload:{digest}", "bytes": size}
