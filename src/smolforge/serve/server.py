"""`smolforge serve` in one process: check the options, bind the port, load the model, start the
engine, listen, run uvicorn.

Why the socket is bound here, before the model loads and before uvicorn starts: a port in use or a
bad address then ends in one message and exit 2 within a second (uvicorn alone logs a traceback and
exits 1), and `--port 0` prints the port it really got. The token comes from `--token-file`,
`$SMOLFORGE_TOKEN` or `$SMOLFORGE_TOKEN_FILE` (`given_token`: `serve --stages` on the embedded
cluster takes it the same way), else it is made once into the state dir (0600); only that file's
path is ever printed, never the token.

Why a watchdog on the engine: the engine restarts its own loop after an error, but should its
thread end anyway, a server that goes on answering `/health` would hide it; instead uvicorn is
told to stop and `serve` exits 1 with the reason (`EngineStopped`).
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from smolforge.auth import check_token_format, load_or_create_token, resolve_token
from smolforge.errors import SmolforgeError
from smolforge.models.names import check_adapter_dir, check_local_model
from smolforge.paths import home

log = logging.getLogger(__name__)


@dataclass
class ServeOptions:
    model: str
    adapter: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    token_file: str | None = None
    state_dir: str | None = None
    max_batch: int = 8
    model_name: str | None = None
    device: str = "auto"
    dtype: str = "fp32"  # the weights' dtype, a --dtype choice (smolforge.models.dtypes)
    num_threads: int | None = None
    batch_window_ms: float = 5.0
    engine: str = "auto"  # a name of `engines.ENGINES`, or auto (`engines.AUTO_RULE`)
    quant: str | None = None  # the llamacpp engine's GGUF quantization (None: engines.DEFAULT_QUANT)


def given_token(token_file: str | None) -> str | None:
    """The token the user gave: `--token-file`, else `$SMOLFORGE_TOKEN`, else `$SMOLFORGE_TOKEN_FILE`;
    None when none was given. The one rule of every `serve`, staged or not."""
    given = resolve_token(token_file=token_file)
    return check_token_format(given) if given else None


def server_token(opts: ServeOptions) -> tuple[str, Path | None]:
    """(token, the file it was made into) — the file only when we made or reused our own."""
    given = given_token(opts.token_file)
    if given:
        return given, None
    path = Path(opts.state_dir).expanduser() if opts.state_dir else home() / "serve"
    path = path / "token"
    return load_or_create_token(path), path


def check_options(opts: ServeOptions) -> None:
    """Refuse bad numbers and names before anything loads (a port out of range is a message, not a traceback)."""
    from smolforge.serve.engines import check_engine, check_quant

    check_engine(opts.engine)
    if opts.quant is not None:
        check_quant(opts.quant)
    if not 0 <= opts.port <= 65535:
        raise SmolforgeError(f"--port {opts.port} is not a port", fix="give a port from 1 to 65535 (0: any free port)")
    if not 1 <= opts.max_batch <= 1024:
        raise SmolforgeError(f"--max-batch must be at least 1 (and at most 1024), not {opts.max_batch}",
                             fix="e.g. --max-batch 8")
    if opts.num_threads is not None and not 1 <= opts.num_threads <= 1024:
        raise SmolforgeError(f"--num-threads {opts.num_threads} is not a number of threads", fix="e.g. --num-threads 4")
    if not 0 <= opts.batch_window_ms <= 10_000:
        raise SmolforgeError(f"the batch window of {opts.batch_window_ms} ms is out of range", fix="give 0 to 10000 ms")


def bind(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise SmolforgeError(f"port {port} is not a port", fix="give a port from 1 to 65535 (0: any free port)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except (OSError, UnicodeError) as err:  # UnicodeError: a host name IDNA cannot encode
        sock.close()
        why = getattr(err, "strerror", None) or str(err)
        raise SmolforgeError(f"cannot listen on {host}:{port}: {why}",
                             fix="pick another --port (0: any free port) or --host, or stop what uses this one") from None
    sock.set_inheritable(True)
    return sock


def serve(opts: ServeOptions, announce: Callable[[str], None] = print) -> None:
    """Serve until SIGINT/SIGTERM. Bad options are refused before torch and the model load."""
    check_options(opts)
    token, token_path = server_token(opts)
    check_local_model(opts.model)
    if opts.adapter:
        check_adapter_dir(opts.adapter)
    # Bound now, so a port in use is refused before the model loads; listening only once it has
    # loaded, so a client meanwhile is refused at once rather than left waiting.
    sock = bind(opts.host, opts.port)
    try:
        served, label, engine, app = _load(opts, token, announce)
    except BaseException:
        sock.close()
        raise
    sock.listen(128)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    base = f"http://{shown}:{port}"
    announce(f"serving {served.name} on {base} (max batch {opts.max_batch}, {label})")
    announce(f"  API base:  {base}/v1   (openai.OpenAI(base_url=\"{base}/v1\", api_key=<token>))")
    announce(f"  chat page: {base}/chat#token=<token>")
    announce(f"  token:     in {token_path} (mode 0600)" if token_path else
             "  token:     the one you gave (--token-file / $SMOLFORGE_TOKEN)")
    import uvicorn

    server = uvicorn.Server(serve_config(app, sock))
    stop_when_engine_dies(engine, server)
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop()
        sock.close()
    if engine.failure:
        from smolforge.serve.engine import EngineStopped

        raise EngineStopped(f"the generation engine stopped: {engine.failure}",
                            fix="the log above has its traceback; start `smolforge serve` again")


def serve_config(app: Any, sock: socket.socket) -> Any:
    """The uvicorn settings of every serve listener (one process or staged): the coordinator's bounds
    on slow clients and connections (`smolforge.http_limits`), on this already bound socket."""
    from smolforge.http_limits import server_config

    host, port = sock.getsockname()[:2]
    return server_config(app, host, port, log_level="warning", access_log=False, lifespan="off",
                         timeout_graceful_shutdown=3)


def stop_when_engine_dies(engine: Any, server: Any) -> None:
    """Tell uvicorn to stop when the engine's thread ends on its own (the caller then exits 1)."""

    def died(reason: str) -> None:
        log.error("the generation engine stopped (%s): shutting the server down", reason)
        server.should_exit = True

    engine.on_death = died


def _load(opts: ServeOptions, token: str, say: Callable[[str], None] = lambda line: None):
    """The model (from the engine `--engine` names: `engines.ENGINES`), its running engine thread
    and the app serving them."""
    from smolforge.serve.api import create_app
    from smolforge.serve.engine import Engine
    from smolforge.serve.engines import EngineSpec, load_engine

    spec = EngineSpec(model=opts.model, name=opts.model_name or opts.model, adapter=opts.adapter, device=opts.device,
                      dtype=opts.dtype, quant=opts.quant, threads=opts.num_threads, max_batch=opts.max_batch)
    loaded = load_engine(opts.engine, spec, say)
    served = loaded.model
    engine = Engine(served, max_batch=opts.max_batch, window_s=opts.batch_window_ms / 1000).start()
    return served, loaded.label, engine, create_app(served, engine, token=token, model_name=served.name)
