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
and re-placement (`stage`, with the stage's peak RSS); the job's `result.stages` is each stage's node,
layers, peak RSS and its node's memory limit, kept current while it serves (`job show`); what the
API actor and each stage print is the job's log (tasks `api`, `stage0`, `stage1`...); a stage that
dies fails only the requests of its batch (see `stages.py`). Cancel (or pause) stops uvicorn, the
engine and every actor. Resume starts them all again. Stages that fail to start, or an API actor that goes away, cost an attempt: the job's
FailurePolicy (the base runner's) starts them all again or fails the job with the reason.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from smolforge.cluster.nodes import ray_glue
from smolforge.cluster.control.runner import (
    POLL_S, Cancelled, Failed, JobRunner, Outcome, Paused, RunnerContext, own_making, short_error,
)
from smolforge.cluster.control.specs import ServeJob
from smolforge.errors import SmolforgeError
from smolforge.telemetry.tasklog import LineBuffer, start_capture, this_node
from smolforge.train.faults import fault_once

STATUS_EVERY_S = 2.0


class ServeApi:
    """Ray actor class: the stage group, the engine over it and the HTTP server, on the coordinator's node."""

    def __init__(self, spec: ServeJob, token_file: str, embedded: bool):
        # what this process prints (uvicorn, the engine), task `api`, shipped with `status` with the stages'
        self.lines = LineBuffer("api", this_node())
        start_capture(self.lines)  # for the actor's life: its process is its own
        self.spec = spec  # validated at submit; Ray ships the object
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
        if fault_once("serve-start-fail"):  # fault injection (train/faults.py): the stages fail to start, once
            raise RuntimeError("fault injection: the stages failed to start")
        self.group = StageGroup(spec.model, stages, adapter=spec.adapter, cpus_per_stage=spec.cpus_per_stage,
                                device=spec.device, dtype=spec.dtype, step_timeout_s=spec.step_timeout_s,
                                load_timeout_s=spec.load_timeout_s, embedded=self.embedded,
                                name=spec.model_name or spec.model, allowed=spec.stage_nodes)
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
    """Runs one serve job until it is cancelled (or paused); an attempt is one API actor and its stages."""

    def __init__(self, ctx: RunnerContext, job_id: str, spec: ServeJob, reason: str):
        super().__init__(ctx, job_id, spec, reason)
        self.spec: ServeJob = spec
        self.actor: Any = None
        self.starting: Any = None  # the API actor's `start` call, until it answers
        self.deadline = 0.0
        self.url: str | None = None
        self.last_status = 0.0
        self._events_seen = 0
        self._stages_kept: list[dict[str, Any]] = []  # the stages as the job's result last recorded them

    def running_message(self) -> str:
        return f"starting {self.spec.stages} stages of {self.spec.model} ({self.reason})"

    def start_attempt(self) -> Outcome | None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        spec = self.spec
        if spec.adapter and not self.ctx.embedded:  # a coordinator never reads where a network peer tells it to
            return Failed("adapter is for the embedded cluster only", retryable=False,
                          error="a serve job's adapter directory is read on the coordinator's machine: only the "
                                "embedded cluster (this machine) takes one; serve a merged model instead")
        ray_glue.connect()
        token_file = (self.ctx.embedded and self.ctx.serve_token_file()) or os.environ.get("RAY_AUTH_TOKEN_PATH")
        head = ray_glue.head_node_id()
        if not token_file or head is None:
            err = SmolforgeError("the serve job runs only in a coordinator (or the embedded cluster)",
                                 fix="submit it to a coordinator: smolforge serve --stages N --coordinator H:P")
            return Failed(err.what, retryable=False, error=err.render())
        self._events_seen, self.url = 0, None
        self.actor = ray.remote(ServeApi).options(
            num_cpus=0, max_concurrency=4, max_restarts=0, max_task_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False),
        ).remote(spec, token_file, self.ctx.embedded)
        self.starting = self.actor.start.remote()
        self.deadline = time.monotonic() + spec.start_timeout_s()
        return None

    def poll(self) -> Outcome | None:
        return self._poll_start() if self.url is None else self._poll_serving()

    def _poll_start(self) -> Outcome | None:
        """Until the API answers its `start`: its URL, or why the stages did not start."""
        import ray

        ready, _ = ray.wait([self.starting], timeout=POLL_S)
        if not ready:
            self._mirror()
            if self.want:
                return self.stopped(self.want)
            if time.monotonic() > self.deadline:
                return Failed("the stages did not start in time")
            return None
        try:
            url = ray.get(self.starting, timeout=30)
        except Exception as err:  # noqa: BLE001 - a stage (or its node) failed as it started
            self._mirror()
            return Failed(f"the stages did not start: {short_error(err)}", retryable=not own_making(err),
                          error=short_error(err))
        self.url, self.last_status = url, time.monotonic()
        stages = len(self._mirror()["stages"])
        self.store.add_event(self.job_id, "serving", f"serving {self.spec.model_name or self.spec.model} at "
                             f"{url}/v1 ({stages} stage{'s' * (stages != 1)}; bearer token: the cluster token)",
                             {"url": url, "stages": stages})
        self.ctx.placed(self.job_id)  # its stages hold their nodes now: the queue's claim can go
        self.recovered(f"serving again at {url}/v1", {"url": url})
        return None

    def _poll_serving(self) -> Outcome | None:
        """While it serves: a stop request, or an API actor (or its node) gone."""
        if self.want:
            return self.stopped(self.want)
        time.sleep(POLL_S)
        if time.monotonic() - self.last_status >= STATUS_EVERY_S:
            self.last_status = time.monotonic()
            try:
                self._mirror(raise_errors=True)
            except Exception as err:  # noqa: BLE001 - the API actor (or its node) died
                return Failed(f"the API server went away: {short_error(err)}", retryable=not own_making(err),
                              error=short_error(err))
        return None

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
        if st["stages"] and st["stages"] != self._stages_kept:  # `job show`: each stage's node, layers, peak RSS
            self._stages_kept = st["stages"]
            self.store.update_job(self.job_id, result={"stages": st["stages"]})
        return st

    def stopped(self, what: str, where: str = "") -> Outcome:
        if what == "pause":
            return Paused("paused: the API and every stage stopped")
        return Cancelled("cancelled; the API and every stage stopped")

    def end_attempt(self) -> None:
        import ray

        if self.actor is None:
            return
        actor, self.actor = self.actor, None
        try:
            ray.get(actor.stop.remote(), timeout=20)
        except Exception:  # noqa: BLE001
            pass  # gone already, or stuck: the kill below ends it (and the stage actors it owns)
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001
            pass
