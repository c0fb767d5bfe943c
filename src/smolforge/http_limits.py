"""What one client may hold of a smolforge HTTP listener: time, connections and JSON nesting.

Used by the coordinator (`cluster/api.py`, `cluster/coordinator.py`) and the embedded dashboard; it
lives below the layers so `smolforge serve` can use it without importing `smolforge.cluster`.

Why each bound (the README's "Limits" lists the numbers):
- **Header timeout.** uvicorn times out idle kept-alive connections, but not a request whose head
  never ends: a client sending one header byte a minute held its connection forever.
  `BoundedH11Protocol` closes a connection that has not sent a whole request head `HEADER_TIMEOUT_S`
  after it connected (or after the first byte of its next request), and one whose request body
  stalls for `BODY_IDLE_S` (a body may take long, an upload over Wi-Fi, but must keep coming).
- **Connections per listener.** Each open connection costs memory and a file descriptor; beyond
  `MAX_CONNECTIONS` a new one is closed as soon as it is accepted.
- **JSON nesting.** Python's parser (and pydantic, and `json.dumps` when the value is stored)
  recurse once per level: a body of 100 000 `[` raised RecursionError deep inside a handler.
  `json_depth` counts the nesting of the raw bytes, strings skipped, in linear time, before any
  parser runs; a service refuses bodies deeper than `MAX_JSON_DEPTH` with a 400.
"""

from __future__ import annotations

import asyncio
import os
import re
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = float(os.environ.get("SMOLFORGE_HEADER_TIMEOUT_S", "10"))
KEEP_ALIVE_S = 5  # an idle kept-alive connection is closed after this (uvicorn's own timer)
BODY_IDLE_S = float(os.environ.get("SMOLFORGE_BODY_IDLE_S", "60"))  # a request body may not stall longer
MAX_CONNECTIONS = int(os.environ.get("SMOLFORGE_MAX_CONNECTIONS", "256"))
MAX_JSON_DEPTH = 32  # job specs and chat requests nest 6 deep at most

# A JSON string, escapes included; the closing quote is optional so a match never fails and
# rescans (an unterminated string just runs to the end): linear time on any input.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_BRACKET = bytes(c for c in range(256) if c not in b"[]{}")
_INNERMOST = re.compile(rb"\[\]|\{\}")


def json_depth(body: bytes, limit: int = MAX_JSON_DEPTH) -> int:
    """How deep `[` and `{` nest in a JSON text, counted up to `limit + 1` (enough to refuse it).

    Strings are skipped first, so brackets inside a prompt do not count; each pass then removes the
    innermost pairs, so the passes until nothing is left are the depth (each pass is linear, and at
    most `limit + 1` run). Brackets that never close are left to the parser, which refuses them."""
    brackets = _STRING.sub(b"", body).translate(None, _NOT_BRACKET)
    depth = 0
    while brackets and depth <= limit:
        shorter = _INNERMOST.sub(b"", brackets)
        if len(shorter) == len(brackets):
            break  # unbalanced: not JSON, the parser says so
        brackets, depth = shorter, depth + 1
    return depth


def too_deep_message(depth: int) -> str:
    return f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels" if depth > MAX_JSON_DEPTH else ""


class BoundedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with time limits on sending a request and a cap on connections."""

    _read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > MAX_CONNECTIONS:
            transport.close()  # connection_lost follows and forgets it
            return
        self._arm(HEADER_TIMEOUT_S)

    def data_received(self, data: bytes) -> None:
        next_request = self.timeout_keep_alive_task is not None  # its first bytes, on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state is h11.SEND_BODY:
            self._arm(BODY_IDLE_S)  # a body may take long (uploads), but not stall
        elif self.conn.their_state is not h11.IDLE:
            self._cancel()  # the whole request is in
        elif next_request:
            self._arm(HEADER_TIMEOUT_S)  # the head's clock runs from its first byte, not per byte

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        super().connection_lost(exc)

    def _arm(self, seconds: float) -> None:
        self._cancel()
        self._read_timer = self.loop.call_later(seconds, self._too_slow)

    def _cancel(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _too_slow(self) -> None:
        self._read_timer = None
        waiting_for_client = self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.flow.read_paused
        if waiting_for_client and not self.transport.is_closing():
            self.transport.close()


def server_config(app: Any, host: str, port: int, **kwargs: Any):
    """A uvicorn.Config with the bounds above; `kwargs` as uvicorn's (TLS files, log level). No
    `limit_concurrency`: HTTP/1.1 runs one request per connection at a time, so the connection cap
    bounds requests in flight too."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, http=BoundedH11Protocol, timeout_keep_alive=KEEP_ALIVE_S,
                          **kwargs)
