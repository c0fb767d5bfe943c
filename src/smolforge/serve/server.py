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

Why the HTTP side runs in a process of its own by default (`--front process`; `channel.py` says
why it pays): this process loads the model, runs the engine and starts `serve.front` on the bound
socket, then only supervises. Either side's end ends both: the front's exit (a signal, a crash)
stops the engine; the engine's death stops the front (its channel closes) and `serve` exits 1.
`--front thread` keeps both in this process, as staged serving's API actor does.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from smolforge.auth import check_token_format, load_or_create_token, resolve_token
from smolforge.errors import SmolforgeError
from smolforge.net import bind_refusal
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
    front: str = "process"  # where the HTTP side runs: a name of FRONTS


FRONTS = {"process": "a process of its own (the engine's process keeps its GIL for the model)",
          "thread": "a thread beside the engine, in one process"}
FRONT_STOP_S = 10.0  # a front told to stop gets this long to finish its streams, then is killed


class FrontStopped(SmolforgeError):
    """The HTTP front process ended on its own (ours, not the caller's: exit 1)."""

    exit_code = 1


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
    if opts.front not in FRONTS:
        raise SmolforgeError(f"--front {opts.front!r} is not one of {', '.join(FRONTS)}",
                             fix="give --front process (the default) or --front thread")
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
        refused = bind_refusal(host, port)  # the OS's reason, in the words every listener uses
        if refused is None:  # it binds now: the first bind lost a race
            refused = SmolforgeError(f"cannot listen on {host}:{port}: {getattr(err, 'strerror', None) or err}",
                                     fix="try again, or pick another --port (0: any free port)")
        raise refused from None
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
        served, label, engine = _load(opts, announce)
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
    from smolforge.serve.protocol import system_fingerprint

    fingerprint = system_fingerprint(opts.model, label, opts.adapter)
    try:
        if opts.front == "process":
            run_front(served, engine, sock, token, fingerprint)
        else:
            _run_in_thread(served, engine, sock, token, fingerprint)
    finally:
        engine.stop()
        sock.close()
    if engine.failure:
        from smolforge.serve.events import EngineStopped

        raise EngineStopped(f"the generation engine stopped: {engine.failure}",
                            fix="the log above has its traceback; start `smolforge serve` again")


def _run_in_thread(served: Any, engine: Any, sock: socket.socket, token: str, fingerprint: str | None = None) -> None:
    """`--front thread`: uvicorn on this process's main thread, beside the engine's."""
    import uvicorn

    from smolforge.serve.api import create_app

    app = create_app(served, engine, token=token, model_name=served.name, fingerprint=fingerprint)
    server = uvicorn.Server(serve_config(app, sock))
    stop_when_engine_dies(engine, server)
    server.run(sockets=[sock])


def run_front(served: Any, engine: Any, sock: socket.socket, token: str, fingerprint: str | None = None) -> None:
    """`--front process`: `serve.front` on `sock` and one end of the engine channel; returns once
    either side has ended (a signal to this process ends the front first, gracefully)."""
    from smolforge.serve.channel import EngineHost

    host_end, front_end = socket.socketpair()
    tokenizer_dir = tempfile.mkdtemp(prefix="smolforge-front-")  # 0700: the model's tokenizer, for the front
    proc = None
    try:
        served.tokenizer.save_pretrained(tokenizer_dir)
        EngineHost(engine, host_end).start()
        fds = (sock.fileno(), front_end.fileno())  # the same numbers in the child (`pass_fds`)
        proc = subprocess.Popen([sys.executable, "-m", "smolforge.serve.front"], stdin=subprocess.PIPE, pass_fds=fds)
        front_end.close()
        settings = {"listen_fd": fds[0], "channel_fd": fds[1], "token": token,
                    "name": served.name, "tokenizer_dir": tokenizer_dir, "max_positions": engine.max_positions,
                    "max_batch": engine.max_batch,
                    "model_type": served.model_type, "fingerprint": fingerprint,
                    "log_level": logging.getLevelName(max(logging.WARNING, logging.getLogger().level))}
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(settings).encode())
        proc.stdin.close()
        _supervise(proc, engine)
    finally:
        if proc is not None and proc.poll() is None:
            _stop_front(proc)
        host_end.close()
        front_end.close()
        shutil.rmtree(tokenizer_dir, ignore_errors=True)


def _supervise(proc: subprocess.Popen, engine: Any) -> None:
    """Wait until the front exits, the engine dies, or this process is told to stop (SIGINT, SIGTERM)."""
    stop = threading.Event()
    engine.on_death = lambda reason: stop.set()
    handled = (signal.SIGINT, signal.SIGTERM)
    main = threading.current_thread() is threading.main_thread()
    before = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in handled} if main else {}
    try:
        while not stop.is_set() and proc.poll() is None:
            stop.wait(0.25)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    code = proc.poll()
    if code not in (None, 0) and not stop.is_set() and not engine.failure:
        from smolforge.serve.channel import ENGINE_GONE_EXIT

        raise FrontStopped(f"the HTTP front process ended with exit code {code}"
                             + (" (it lost the engine's channel)" if code == ENGINE_GONE_EXIT else ""),
                             fix="its log is above; start `smolforge serve` again (or try --front thread)")


def _stop_front(proc: subprocess.Popen) -> None:
    """SIGTERM (uvicorn ends its streams), then SIGKILL after FRONT_STOP_S."""
    proc.terminate()
    try:
        proc.wait(FRONT_STOP_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(FRONT_STOP_S)


def serve_config(app: Any, sock: socket.socket) -> Any:
    """The uvicorn settings of every serve listener (one process or staged): the coordinator's bounds
    on slow clients and connections (`smolforge.http_limits`), on this already bound socket."""
    from smolforge.http_limits import server_config

    host, port = sock.getsockname()[:2]
    return server_config(app, host, port, log_level="warning", access_log=False, lifespan="off")


def stop_when_engine_dies(engine: Any, server: Any) -> None:
    """Tell uvicorn to stop when the engine's thread ends on its own (the caller then exits 1)."""

    def died(reason: str) -> None:
        log.error("the generation engine stopped (%s): shutting the server down", reason)
        server.should_exit = True

    engine.on_death = died


def _load(opts: ServeOptions, say: Callable[[str], None] = lambda line: None):
    """The model (from the engine `--engine` names: `engines.ENGINES`) and its running engine thread."""
    from smolforge.serve.engine import Engine
    from smolforge.serve.engines import EngineSpec, load_engine

    spec = EngineSpec(model=opts.model, name=opts.model_name or opts.model, adapter=opts.adapter, device=opts.device,
                      dtype=opts.dtype, quant=opts.quant, threads=opts.num_threads, max_batch=opts.max_batch)
    loaded = load_engine(opts.engine, spec, say)
    served = loaded.model
    engine = Engine(served, max_batch=opts.max_batch, window_s=opts.batch_window_ms / 1000).start()
    return served, loaded.label, engine
