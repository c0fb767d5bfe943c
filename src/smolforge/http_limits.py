"""What one client may hold of a smolforge HTTP listener: time, connections and JSON nesting.

Used by the coordinator (`cluster/api.py`, `cluster/coordinator.py`) and the embedded dashboard; it
lives below the layers so `smolforge serve` can use it without importing `smolforge.cluster`.

Why each bound (the README's "Limits" lists the numbers):
- **Header timeout.** uvicorn times out idle kept-alive connections, but not a request whose head
  never ends: a client sending one header byte a minute held its connection forever.
  `BoundedH11Protocol` closes a connection that has not sent a whole request head `HEADER_TIMEOUT_S`
  after it connected (or after the first byte of its next request), and one whose request body
  stalls for `BODY_IDLE_S` (a body may take long, an upload over Wi-Fi, but must keep coming).
- **Connections per listener, and the share of those not yet proven.** Each open connection costs
  memory and a file descriptor, so a listener holds at most `MAX_CONNECTIONS`. A connection is
  *unproven* until a request on it carries the token (the gate says so: `admit`); at most
  `MAX_UNPROVEN` connections are. Why: with one cap only, 300 connections that each sent a header
  byte every 2 s (no token needed) held all 256 slots, and the token holders' `/health` answered
  1 time in 24. Now a connection that arrives when the unproven share (or the whole listener) is
  full takes the slot of the oldest unproven connection still waiting for its client's bytes,
  which is closed; a new one is refused only when no such connection is left (every slot held by
  a client that proved itself, or by a request being answered). What we follow: nginx keeps idle
  and still-unread connections "reusable" and, short of free connections, closes the oldest of
  them to accept the new one (`ngx_reusable_connection`, `ngx_drain_connections`; "reusing
  connections in advance", nginx 1.19.2; nginx frees only connections that sent no byte yet or
  sit idle between requests, we also those still sending a head or that never sent the token); its `client_header_timeout` and Apache's
  `mod_reqtimeout` are our header timeout. uvicorn's `limit_concurrency` (503 past a count) and
  gunicorn's `worker_connections` count every connection alike, which is the lockout above.
- **JSON nesting.** Python's parser (and pydantic, and `json.dumps` when the value is stored)
  recurse once per level: a body of 100 000 `[` raised RecursionError deep inside a handler.
  `json_depth` counts the nesting of the raw bytes, strings skipped, in linear time, before any
  parser runs; a service refuses bodies deeper than `MAX_JSON_DEPTH` with a 400.
"""

from __future__ import annotations

import asyncio
import os
import re
import weakref
from collections import OrderedDict
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = float(os.environ.get("SMOLFORGE_HEADER_TIMEOUT_S", "10"))
KEEP_ALIVE_S = 5  # an idle kept-alive connection is closed after this (uvicorn's own timer)
# On SIGINT/SIGTERM, requests in flight get this long to finish before uvicorn cancels them and exits. Without
# a bound uvicorn waits for every connection to be gone, and a TLS connection that a client holds open idle is
# gone only when the client answers TLS's close_notify or asyncio's `ssl_shutdown_timeout` (30 s) passes: the
# coordinator took 33.5 s to stop with one idle client connected, 4.6 s with none (measured, s52).
SHUTDOWN_GRACE_S = 3.0
BODY_IDLE_S = float(os.environ.get("SMOLFORGE_BODY_IDLE_S", "60"))  # a request body may not stall longer
MAX_CONNECTIONS = int(os.environ.get("SMOLFORGE_MAX_CONNECTIONS", "256"))
# connections no request with the token has come on yet: a quarter of the slots
MAX_UNPROVEN = int(os.environ.get("SMOLFORGE_MAX_UNPROVEN", str(max(1, MAX_CONNECTIONS // 4))))
ADMIT = "smolforge.admit"  # the scope extension the gate calls once a request carried the token
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


def admit(scope: dict[str, Any]) -> None:
    """Tell the listener that this request's connection proved itself (it carried the token): it no
    longer counts against `MAX_UNPROVEN` and is never evicted. The gate (`gate.py`) calls it; a scope
    from another server (a test client) has no such extension and nothing happens."""
    hook = (scope.get("extensions") or {}).get(ADMIT)
    if hook is not None:
        hook()


class _Slots:
    """One listener's unproven connections, oldest first, and what the rule decided (counters)."""

    def __init__(self) -> None:
        self.unproven: OrderedDict[BoundedH11Protocol, None] = OrderedDict()
        self.leaving: set[BoundedH11Protocol] = set()  # closed by us, `connection_lost` not yet called
        self.evicted = 0  # unproven connections closed to make room for a new one
        self.refused = 0  # new connections closed at once: no slot could be freed
        self.admitted = 0  # connections that proved themselves

    def make_room(self, connections: int) -> bool:
        """Whether a new connection (already counted in `connections`, unproven) may stay: it may when
        the listener and its unproven share have room, or once the oldest unproven connection that waits
        for its client's bytes (no request of it being answered) has been closed to give it its slot."""
        if len(self.unproven) < MAX_UNPROVEN and connections - len(self.leaving) <= MAX_CONNECTIONS:
            return True
        for old in self.unproven:
            if old.waiting_for_client():
                del self.unproven[old]
                self.leaving.add(old)
                self.evicted += 1
                old.transport.close()
                return True
        self.refused += 1
        return False


_SLOTS: weakref.WeakKeyDictionary[Any, _Slots] = weakref.WeakKeyDictionary()


def slots_of(server_state: Any) -> _Slots:
    """The slots of the listener whose uvicorn `ServerState` this is (`uvicorn.Server.server_state`)."""
    slots = _SLOTS.get(server_state)
    if slots is None:
        slots = _SLOTS[server_state] = _Slots()
    return slots


class BoundedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with time limits on sending a request, a cap on connections and a
    smaller one on connections that have not yet proven themselves (the module's docstring says why)."""

    _read_timer: asyncio.TimerHandle | None = None
    _slots: _Slots | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._slots = slots_of(self.server_state)
        if not self._slots.make_room(len(self.connections)):
            self._slots.leaving.add(self)
            transport.close()  # connection_lost follows and forgets it
            return
        self._slots.unproven[self] = None
        self._arm(HEADER_TIMEOUT_S)

    def handle_events(self) -> None:
        before = self.scope
        super().handle_events()
        if self.scope is not before and self.scope is not None:  # a new request: its task has not run yet
            self.scope.setdefault("extensions", {})[ADMIT] = self._admitted  # type: ignore[typeddict-item]

    def _admitted(self) -> None:
        if self._slots is not None and self in self._slots.unproven:
            del self._slots.unproven[self]
            self._slots.admitted += 1

    def waiting_for_client(self) -> bool:
        """No request of this connection is being answered: what it lacks is its client's bytes."""
        return (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing()

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
        if self._slots is not None:
            self._slots.unproven.pop(self, None)
            self._slots.leaving.discard(self)
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
    """A uvicorn.Config with the bounds above (a stop waits at most SHUTDOWN_GRACE_S for requests in flight);
    `kwargs` as uvicorn's (TLS files, log level). No
    `limit_concurrency`: HTTP/1.1 runs one request per connection at a time, so the connection cap
    bounds requests in flight too. No WebSocket: no smolforge route takes one, and an upgraded
    connection would leave this protocol (and its slot accounting) before the gate saw a token."""
    import uvicorn

    kwargs.setdefault("timeout_graceful_shutdown", SHUTDOWN_GRACE_S)
    return uvicorn.Config(app, host=host, port=port, http=BoundedH11Protocol, timeout_keep_alive=KEEP_ALIVE_S,
                          ws="none", **kwargs)


def page_headers(html: str) -> dict[str, str]:
    """The headers every HTML page smolforge serves (the dashboard, serve's chat page) is sent with.

    A Content-Security-Policy that runs only the page's own scripts (its files from this origin, and each
    inline `<script>` by its sha256: CSP level 2's hash source), talks only to this origin, and may not be
    framed (`frame-ancestors 'none'`, with `X-Frame-Options: DENY` for browsers without CSP 2: no
    click-jacking of a page that holds a token); no referrer (the address may hold `#token=`); no caching
    of the shell. Inline styles stay allowed (`style-src 'unsafe-inline'`: the chart library sets element
    styles). Follows OWASP's Secure Headers recommendations for an HTML application."""
    import base64
    import hashlib
    import re

    scripts = re.findall(r"<script>(.*?)</script>", html, flags=re.S)
    hashes = " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()}'" for s in scripts)
    csp = ("default-src 'none'; script-src 'self'" + (f" {hashes}" if hashes else "")
           + "; style-src 'self' 'unsafe-inline'; img-src 'self' data:; connect-src 'self'; "
             "frame-ancestors 'none'; base-uri 'none'; form-action 'self'")
    return {"Content-Security-Policy": csp, "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer", "Cache-Control": "no-store"}
