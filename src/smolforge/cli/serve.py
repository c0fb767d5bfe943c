"""`smolforge serve`: chat with a model (plus adapter) through an OpenAI-compatible API and a web page.

Imports stay inside the command so `smolforge --help` does not load torch or FastAPI.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

import typer

from smolforge.cli.common import PRIORITY_HELP, quiet_libraries, run_cli
from smolforge.errors import SmolforgeError
from smolforge.models.dtypes import DTYPE_HELP, parse_dtype
from smolforge.models.export.cache import TEACHER_QUANTS
from smolforge.serve.engines import DEFAULT_QUANT, ENGINE_HELP, check_engine


def register(app: typer.Typer) -> None:
    @app.command()
    @run_cli
    def serve(
        model: str = typer.Option(..., help="HF id, local dir, Ollama name or preset (tiny-llama)"),
        adapter: Optional[str] = typer.Option(None, help="a lora/ia3/adapter directory from `smolforge train` "
                                              "(LoRA and IA3 are merged into the weights)"),
        host: str = typer.Option("127.0.0.1", help="address to listen on; 0.0.0.0 exposes it to your network"),
        port: int = typer.Option(8000, help="port to listen on (0: any free port)"),
        token_file: Optional[str] = typer.Option(None, "--token-file", help="a file holding the token clients must "
                                                 "send (else $SMOLFORGE_TOKEN, else one made into the state dir)"),
        state_dir: Optional[str] = typer.Option(None, help="where a made token is kept (default $SMOLFORGE_HOME/serve)"),
        max_batch: int = typer.Option(8, help="most requests generated together in one batch"),
        model_name: Optional[str] = typer.Option(None, help="the name clients use in `model` (default: --model as given)"),
        device: str = typer.Option("auto", help="auto|cpu|cuda"),
        dtype: str = typer.Option("fp32", "--dtype", help=DTYPE_HELP + "; fp16 serves on a CPU too"),
        num_threads: Optional[int] = typer.Option(None, "--num-threads", "--threads",
                                                  help="the engine's threads (default: the CPUs this process may use)"),
        engine: str = typer.Option("auto", help="what computes the tokens: " + ENGINE_HELP),
        quant: Optional[str] = typer.Option(None, help="the llamacpp engine's GGUF quantization: "
                                            f"{' | '.join(TEACHER_QUANTS)} (default {DEFAULT_QUANT}); the model is "
                                            "exported once per node and cached, as for --teacher-backend llamacpp"),
        front: str = typer.Option("process", help="where the HTTP side runs: process (its own, so the engine's "
                                  "process keeps its GIL for the model: the faster one on a CPU) | thread "
                                  "(beside the engine, one process)"),
        stages: Optional[str] = typer.Option(None, help="cut the model into N stages, one Ray actor each on nodes "
                                             "holding it: a `serve` job on the coordinator, or on an embedded "
                                             "cluster of this machine; auto: the placement plan chooses from "
                                             "each node's measured speed and memory (one node when faster)"),
        coordinator: Optional[str] = typer.Option(None, help="with --stages: the coordinator HOST:PORT (default: "
                                                  "$SMOLFORGE_COORDINATOR or a running one; none: embedded cluster)"),
        cpus_per_stage: float = typer.Option(1.0, help="with --stages: CPUs each stage actor reserves (its torch threads)"),
        priority: str = typer.Option("normal", help="with --stages: " + PRIORITY_HELP),
    ):
        """Serve a model from this process: OpenAI-compatible /v1 API (streaming) and a chat page at /chat.

        No cluster or Ray needed. Clients send the token as `Authorization: Bearer <token>`; the
        chat page takes it from its URL fragment (`/chat#token=...`).

        Example: smolforge serve --model tiny-llama --adapter outputs/run/lora_adapter --port 8000

        With --stages N the model is cut into N stages served by Ray actors on the nodes that hold it
        (a `serve` job: `smolforge jobs` shows it, `smolforge job cancel ID` stops it). The API then
        runs on the coordinator's machine and takes the cluster token; --token-file is the cluster
        token file for talking to the coordinator. Without a coordinator an embedded cluster of this
        machine serves until Ctrl-C, with the token one-process serve would take (--token-file, else
        $SMOLFORGE_TOKEN, else the embedded cluster's). The placement plan (printed) sizes each stage to its node's
        measured speed and memory; --stages auto also picks how many (one node when that is faster).

        Example: smolforge serve --model qwen2.5:0.5b --stages 2 --coordinator 192.168.1.10:8765

        Example: smolforge serve --model qwen2.5:0.5b --dtype bf16  (half the memory of fp32; auto: the checkpoint's own)

        Example: smolforge serve --model qwen2.5:0.5b --engine llamacpp --quant q8_0 --threads 4
        """
        dtype = parse_dtype(dtype)  # one message before anything starts, staged or not
        quiet_libraries()
        from smolforge.cluster.face import check_port

        check_port(port, "--port", zero_picks=True)  # one message before anything starts, staged or not
        check_engine(engine)
        if stages is not None:
            from smolforge.cli.common import cli_token

            if engine == "llamacpp" or quant is not None:
                raise SmolforgeError("--stages serves with the torch engine: stage actors hold torch layers",
                                     where="--engine llamacpp" if engine == "llamacpp" else "--quant",
                                     fix="drop --stages to serve with llama.cpp in one process, or drop --engine/--quant")

            spec = {"kind": "serve", "model": model, "stages": _stages(stages), "host": host, "port": port,
                    "max_batch": max_batch, "cpus_per_stage": cpus_per_stage, "priority": priority,
                    "device": "cpu" if device == "auto" else device, "dtype": dtype}
            if adapter:
                spec["adapter"] = str(Path(adapter).expanduser().resolve())
            if model_name:
                spec["model_name"] = model_name
            serve_staged(spec, coordinator=coordinator, token=cli_token(None, token_file), state_dir=state_dir,
                         token_file=token_file)
            return
        from smolforge.serve.server import ServeOptions, serve as run

        def announce(line: str) -> None:
            typer.echo(line)
            sys.stdout.flush()

        run(ServeOptions(model=model, adapter=adapter, host=host, port=port, token_file=token_file,
                         state_dir=state_dir, max_batch=max_batch, model_name=model_name, device=device,
                         dtype=dtype, num_threads=num_threads, engine=engine, quant=quant, front=front),
            announce=announce)


def serve_staged(spec: dict, *, coordinator: str | None, token: str | None, state_dir: str | None,
                 token_file: str | None = None) -> None:
    """Submit a `serve` job and say where it serves. On a coordinator it keeps serving after this
    command returns; on the embedded cluster it serves until Ctrl-C (or SIGTERM), then stops."""
    from smolforge.client import backend_for
    from smolforge.cluster.control.kinds import parse
    from smolforge.serve.server import given_token

    job = parse(spec)  # a bad setting is a message now, not after a cluster has started
    given = given_token(token_file)  # an unreadable token file too
    backend = backend_for(coordinator, token, state_dir, embedded_ok=True)
    embedded = backend.runs_in_process
    job_id = None
    api_token = _embedded_api_token(backend, given) if embedded else None
    try:
        job_id = backend.submit_job(spec)
        typer.echo(f"submitted {job_id} (serve, {job.stages} stages" + (", embedded cluster" if embedded else "") + ")",
                   err=True)
        url, events = wait_serving(backend, job_id, job.start_timeout_s() + 30)
        for e in events:
            if e["kind"] == "plan":
                typer.echo(e["message"])
        stages = next((e["data"].get("stages") for e in events if e["kind"] == "serving"), job.stages)
        typer.echo(f"serving {job.model_name or job.model} on {url} ({stages} stage{'s' * (stages != 1)}, "
                   f"max batch {job.max_batch})")
        typer.echo(f"  API base:  {url}/v1   (openai.OpenAI(base_url=\"{url}/v1\", api_key=<token>))")
        typer.echo(f"  chat page: {url}/chat#token=<token>")
        if not embedded:
            typer.echo("  token:     the cluster token")
            typer.echo(f"  stop it:   smolforge job cancel {job_id}")
            return
        typer.echo("  token:     the one you gave (--token-file / $SMOLFORGE_TOKEN)" if api_token else
                   f"  token:     the embedded cluster's, in {backend.state.token_path} (mode 0600)")
        sys.stdout.flush()
        _serve_until_stopped(backend, job_id)
    finally:
        if api_token is not None:
            api_token.unlink(missing_ok=True)
        if embedded and job_id is not None and backend.get_job_status(job_id)["state"] in ("pending", "running"):
            backend.cancel_job(job_id)
        backend.close()


def _embedded_api_token(backend: Any, given: str | None) -> Path | None:
    """The token the user gave, in a 0600 file of the embedded state dir that the serve job's API
    actor reads (not through Ray); None: the API takes the embedded cluster's token."""
    if given is None:
        return None
    from smolforge.auth import write_token

    path = backend.state.root / "serve-api-token"
    write_token(path, given)
    backend.manager.serve_token_file = str(path)
    return path


def _stages(value: str) -> int | str:
    """--stages: a number, or auto."""
    if value.strip().lower() == "auto":
        return "auto"
    try:
        return int(value)
    except ValueError:
        raise SmolforgeError(f"--stages {value!r} is not a number of stages",
                             fix="give a number of stages (--stages 2) or let the plan choose (--stages auto)") from None


def wait_serving(backend: Any, job_id: str, timeout: float) -> tuple[str, list[dict]]:
    """The job's URL once its API answers (with the job's events so far); its error if it fails first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = backend.job_events(job_id)
        for e in events:
            if e["kind"] == "serving":
                return e["data"]["url"], events
        st = backend.get_job_status(job_id)
        if st["state"] not in ("pending", "running"):
            raise SmolforgeError(f"serve job {job_id} {st['state']}: {st.get('error') or st.get('message') or ''}",
                                 fix=f"see `smolforge job show {job_id}`")
        time.sleep(0.5)
    raise SmolforgeError(f"serve job {job_id} did not start serving within {timeout:.0f} s",
                         fix=f"see `smolforge job show {job_id}`; cancel it with `smolforge job cancel {job_id}`")


def _serve_until_stopped(backend: Any, job_id: str) -> None:
    def stop(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, stop)
    try:
        while backend.get_job_status(job_id)["state"] == "running":
            time.sleep(1.0)
        st = backend.get_job_status(job_id)
        if st["state"] == "failed":
            raise SmolforgeError(f"serve job {job_id} failed: {st.get('error')}", fix="see the log above")
    except KeyboardInterrupt:
        typer.echo("stopping", err=True)
    finally:
        signal.signal(signal.SIGTERM, old)
