"""The HTTP side of `smolforge serve` in a process of its own (`--front process`, the default):
the same app (`api.create_app`) over `channel.RemoteEngine`, on the socket `serve` bound.

`serve` (`server.py` `run_front`) starts `python -m smolforge.serve.front` with two inherited file
descriptors, the listening socket and its end of the engine channel, and writes its settings as
one JSON object to its standard input, then closes it. The token travels that way: never on an
argv, in the environment or in a file of ours. The tokenizer comes from a directory `serve` saved
it to (`save_pretrained`), so the front renders and counts exactly as the engine's process would,
whatever the model's tokenizer was built from (a hub id, a twin made in code, a GGUF's HF side).

Why the front dies with the engine: the channel's end of file means the engine's process has gone
(even killed with SIGKILL); uvicorn is told to stop, and this process exits 3. Why this module
imports no torch: it is the HTTP side only, on a laptop's second core, and torch's import is a
second and ~300 MB it would never use.
"""

from __future__ import annotations

import json
import logging
import socket
import sys
from dataclasses import dataclass
from typing import Any

from smolforge.serve.channel import ENGINE_GONE_EXIT

log = logging.getLogger(__name__)


@dataclass
class FrontModel:
    """All the HTTP side reads of the model: its name and its tokenizer (a `ServedModel` has both)."""

    name: str
    tokenizer: Any
    model_type: str | None = None  # the family's answers (tool-call format) without the weights


@dataclass
class FrontSettings:
    listen_fd: int
    channel_fd: int
    token: str
    name: str
    tokenizer_dir: str
    max_positions: int
    log_level: str = "WARNING"
    max_batch: int | None = None  # the engine's rows at once
    model_type: str | None = None
    fingerprint: str | None = None  # `system_fingerprint`, made by `serve` from what it loaded


def run(settings: FrontSettings) -> int:
    """Serve until told to stop (SIGINT/SIGTERM) or until the engine's process goes; the exit code."""
    import uvicorn
    from transformers import AutoTokenizer

    from smolforge.serve.api import create_app
    from smolforge.serve.channel import RemoteEngine
    from smolforge.serve.server import serve_config

    sock = socket.socket(fileno=settings.listen_fd)
    channel = socket.socket(fileno=settings.channel_fd)
    tokenizer = AutoTokenizer.from_pretrained(settings.tokenizer_dir)
    engine = RemoteEngine(channel, settings.max_positions, settings.max_batch)
    app = create_app(FrontModel(settings.name, tokenizer, settings.model_type), engine, token=settings.token,  # type: ignore[arg-type]
                     model_name=settings.name, fingerprint=settings.fingerprint)
    server = uvicorn.Server(serve_config(app, sock))
    gone: list[str] = []

    def engine_died(reason: str) -> None:
        gone.append(reason)
        server.should_exit = True

    engine.on_death = engine_died
    engine.start()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        channel.close()
    return ENGINE_GONE_EXIT if gone else 0


def main() -> None:
    raw = sys.stdin.buffer.read(1 << 20)
    settings = FrontSettings(**json.loads(raw))
    logging.basicConfig(level=settings.log_level, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(run(settings))


if __name__ == "__main__":
    main()
