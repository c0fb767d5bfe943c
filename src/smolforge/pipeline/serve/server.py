"""`smolforge serve` in one process: check the options, bind the port, load the model, start the
engine, listen, run uvicorn.

Why the socket is bound here, before the model loads and before uvicorn starts: a port in use or a
bad address then ends in one message and exit 2 within a second (uvicorn alone logs a traceback and
exits 1), and `--port 0` prints the port it really got. The token comes from `--token-file`, `$SMOLFORGE_TOKEN` or `$SMOLFORGE_TOKEN_FILE`, else
it is made once into the state dir (0600); only that file's path is ever printed, never the token.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

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
    num_threads: int | None = None
    batch_window_ms: float = 5.0


def server_token(opts: ServeOptions) -> tuple[str, Path | None]:
    """(token, the file it was made into) — the file only when we made or reused our own."""
    given = resolve_token(token_file=opts.token_file)
    if given:
        return check_token_format(given), None
    path = Path(opts.state_dir).expanduser() if opts.state_dir else home() / "serve"
    path = path / "token"
    return load_or_create_token(path), path


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise SmolforgeError(f"cannot listen on {host}:{port}: {err.strerror}",
                             fix="pick another --port (0: any free port), or stop what uses this one") from None
    sock.set_inheritable(True)
    return sock


def serve(opts: ServeOptions, announce: Callable[[str], None] = print) -> None:
    """Serve until SIGINT/SIGTERM. Bad options are refused before torch and the model load."""
    if opts.max_batch < 1:
        raise SmolforgeError(f"--max-batch must be at least 1, not {opts.max_batch}", fix="e.g. --max-batch 8")
    token, token_path = server_token(opts)
    check_local_model(opts.model)
    if opts.adapter:
        check_adapter_dir(opts.adapter)
    # Bound now, so a port in use is refused before the model loads; listening only once it has
    # loaded, so a client meanwhile is refused at once rather than left waiting.
    sock = bind(opts.host, opts.port)
    try:
        served, engine, app = _load(opts, token)
    except BaseException:
        sock.close()
        raise
    sock.listen(128)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    base = f"http://{shown}:{port}"
    announce(f"serving {served.name} on {base} (max batch {opts.max_batch}, {served.device})")
    announce(f"  API base:  {base}/v1   (openai.OpenAI(base_url=\"{base}/v1\", api_key=<token>))")
    announce(f"  chat page: {base}/chat#token=<token>")
    announce(f"  token:     in {token_path} (mode 0600)" if token_path else
             "  token:     the one you gave (--token-file / $SMOLFORGE_TOKEN)")
    import uvicorn

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=3)
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop()
        sock.close()


def _load(opts: ServeOptions, token: str):
    """The model, its running engine and the app serving them."""
    import torch

    from smolforge.pipeline.serve.api import create_app
    from smolforge.pipeline.serve.engine import Engine
    from smolforge.pipeline.serve.model import ServedModel

    if opts.num_threads:
        torch.set_num_threads(opts.num_threads)
    served = ServedModel.load(opts.model, opts.adapter, name=opts.model_name or opts.model, device=opts.device)
    engine = Engine(served, max_batch=opts.max_batch, window_s=opts.batch_window_ms / 1000).start()
    return served, engine, create_app(served, engine, token=token, model_name=served.name)
