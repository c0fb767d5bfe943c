"""A `serve` job: a model served from stage actors, behind the OpenAI-compatible API, until cancelled.

The runner starts one `ServeApi` actor on the coordinator's node (the API listens where the user
said: 127.0.0.1 unless the spec's host says otherwise). That actor places the stage actors
(`stages.StageGroup`, on nodes holding the model), runs the generation engine over
them and uvicorn with the same app and limits as single-process `smolforge serve`. Its bearer token
is the cluster token: the actor reads the coordinator's token file itself (same machine), so the
token never travels through Ray. On the embedded cluster, a token the user gave (`--token-file`,
`$SMOLFORGE_TOKEN`: the rule of one-process `serve`) is put in a file by the CLI, which names it in
`manager.serve_token_file`; the actor reads that one instead. The stage actors are owned by the API
actor: killing it takes them too. Should the engine's thread end, `status()` raises: the job fails.

The job's events carry the placement plan (`plan`), the URL (`serving`) and every stage placement
and re-placement (`stage`); what the API actor and each stage print is the job's log (tasks `api`,
`stage0`, `stage1`...); a stage that dies fails only the requests of its batch (see
`stages.py`). Cancel (or pause) stops uvicorn, the engine and every actor. Resume starts them
all again.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from smolforge.cluster.nodes import ray_glue
from smolforge.cluster.control.runner import POLL_S, JobRunner, short_error
from smolforge.cluster.control.specs import ServeJob
from smolforge.errors import SmolforgeError
from smolforge.telemetry.tasklog import LineBuffer, start_capture, this_node

STATUS_EVERY_S = 2.0


class ServeApi:
    """Ray actor class: the stage group, the engine over it and the HTTP server, on the coordinator's node."""

    def __init__(self, spec: dict[str, Any], token_file: str, embedded: bool):
        # what this process prints (uvicorn, the engine), task `api`, shipped with `status` with the stages'
        self.lines = LineBuffer("api", this_node())
        start_capture(self.lines)  # for the actor's life: its process is its own
        self.spec = ServeJob.model_validate(spec)
        self.token_file, self.embedded = token_file, embedded
        self.group = self.engine = self.server = self.sock = None
        self.thread: threading.Thread | None = None

    def start(self) -> str:
        import uvicorn

        from smolforge.auth import check_token_format
        from smolforge.cluster.workloads.serve.stages import StageGroup
        from smolforge.serve.api import create_app
        from smolforge.serve.engine import Engine
        from smolforge.serve.server import bind, serve_config, stop_when_engine_dies

        spec = self.spec
        token = check_token_format(open(self.token_file).read().strip())
        self.lines.secrets.append(token)  # masked in every line this actor ships (the cluster token)
        stages = None if spec.stages == "auto" else spec.stages  # None: the placement plan chooses
        self.group = StageGroup(spec.model, stages, adapter=spec.adapter, cpus_per_stage=spec.cpus_per_stage,
                                device=spec.device, dtype=spec.dtype, step_timeout_s=spec.step_timeout_s,
                                load_timeout_s=spec.load_timeout_s, embedded=self.embedded,
                                name=spec.model_name or spec.model)
        model = self.group.start()
        self.sock = bind(spec.host, spec.port)
        host, port = self.sock.getsockname()[:2]
        self.engine = Engine(model, max_batch=spec.max_batch).start()
        app = create_app(model, self.engine, token=token, model_name=model.name)
        self.server = uvicorn.Server(serve_config(app, self.sock))
        stop_when_engine_dies(self.engine, self.server)  # and status() says so: the job fails with the reason
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="serve-http")
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise SmolforgeError(f"the HTTP server on {host}:{port} did not start", fix="see the coordinator's log")
            time.sleep(0.05)
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}"

    def status(self) -> dict[str, Any]:
        if self.engine is not None and self.engine.failure:
            raise SmolforgeError(f"the generation engine stopped: {self.engine.failure}")
        lines = self.lines.drain() + (self.group.take_lines() if self.group else [])
        return {"stages": self.group.describe() if self.group else [], "events": list(self.group.events) if self.group else [],
                "batches": self.engine.batches if self.engine else 0, "pid": os.getpid(), "lines": lines}

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(10)
        if self.engine is not None:
            self.engine.stop()
        if self.group is not None:
            self.group.close()
        if self.sock is not None:
            self.sock.close()


class ServeRunner(JobRunner):
    """Runs one serve job until it is cancelled (or paused), or its API actor dies."""

    def __init__(self, mgr, job_id: str, reason: str):
        super().__init__(mgr, job_id, reason)
        self.actor: Any = None
        self._events_seen = 0

    def _stopping(self) -> bool:
        return bool(self.want or self.abandon)

    def _run(self) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        spec = self._spec_to_run(ServeJob)
        if spec is None:
            return
        if spec.adapter and not self.mgr.embedded:  # a coordinator never reads where a network peer tells it to
            self.store.set_state(self.job_id, "failed", "failed: adapter is for the embedded cluster only",
                                 error="a serve job's adapter directory is read on the coordinator's machine: only "
                                       "the embedded cluster (this machine) takes one; serve a merged model instead")
            return
        self.store.set_state(self.job_id, "running", f"starting {spec.stages} stages of {spec.model} ({self.reason})")
        ray_glue.connect()
        token_file = (self.mgr.embedded and getattr(self.mgr, "serve_token_file", None)) or \
            os.environ.get("RAY_AUTH_TOKEN_PATH")
        head = ray_glue.head_node_id()
        if not token_file or head is None:
            raise SmolforgeError("the serve job runs only in a coordinator (or the embedded cluster)",
                                 fix="submit it to a coordinator: smolforge serve --stages N --coordinator H:P")
        self.actor = ray.remote(ServeApi).options(
            num_cpus=0, max_concurrency=4, max_restarts=0, max_task_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False),
        ).remote(spec.model_dump(mode="json"), token_file, self.mgr.embedded)
        started = self.actor.start.remote()
        deadline = time.monotonic() + spec.start_timeout_s()
        while True:
            ready, _ = ray.wait([started], timeout=POLL_S)
            if ready:
                break
            self._mirror()
            if self._stopping():
                if self.want:
                    self._finish_stopped(self.want)
                return
            if time.monotonic() > deadline:
                self.store.set_state(self.job_id, "failed", "failed: the stages did not start in time",
                                     error="the stages did not start in time")
                return
        try:
            url = ray.get(started, timeout=30)
        except Exception as err:
            self._mirror()
            self.store.set_state(self.job_id, "failed", f"failed: {short_error(err)}", error=short_error(err))
            return
        stages = len(self._mirror()["stages"])
        self.store.add_event(self.job_id, "serving", f"serving {spec.model_name or spec.model} at {url}/v1 "
                             f"({stages} stage{'s' * (stages != 1)}; bearer token: the cluster token)",
                             {"url": url, "stages": stages})
        self.mgr.placed(self.job_id)  # its stages hold their nodes now: the queue's claim can go
        self.store.set_state(self.job_id, "running", f"serving at {url}/v1")
        last = time.monotonic()
        while not self._stopping():
            time.sleep(POLL_S)
            if time.monotonic() - last >= STATUS_EVERY_S:
                last = time.monotonic()
                try:
                    self._mirror(raise_errors=True)
                except Exception as err:  # the API actor (or its node) died
                    self.store.set_state(self.job_id, "failed", f"failed: the API server went away: "
                                         f"{short_error(err)}", error=short_error(err))
                    return
        if self.want:
            self._finish_stopped(self.want)

    def _mirror(self, raise_errors: bool = False) -> dict[str, Any]:
        """The stage group's plan and placements as job events; the API actor's status."""
        import ray

        try:
            st = ray.get(self.actor.status.remote(), timeout=30)
        except Exception:
            if raise_errors:
                raise
            return {"stages": [], "events": []}
        for event in st["events"][self._events_seen:]:
            self.store.add_event(self.job_id, event["kind"], event["message"], event["data"])
        self._events_seen = len(st["events"])
        self.store.add_logs(self.job_id, st.get("lines") or [])
        return st

    def _finish_stopped(self, what: str) -> None:
        self._cleanup()
        if what == "pause":
            self.store.set_state(self.job_id, "paused", "paused: the API and every stage stopped")
        else:
            self.store.set_state(self.job_id, "cancelled", "cancelled; the API and every stage stopped", force=True)

    def _cleanup(self) -> None:
        import ray

        if self.actor is None:
            return
        actor, self.actor = self.actor, None
        try:
            ray.get(actor.stop.remote(), timeout=20)
        except Exception:
            pass  # gone already, or stuck: the kill below ends it (and the stage actors it owns)
        try:
            ray.kill(actor, no_restart=True)
        except Exception:
            pass
