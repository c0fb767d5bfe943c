"""The gate in front of smolforge's HTTP services: the token and the body size, before any body byte.

Used by the coordinator (`cluster/api.py`) and by `smolforge serve` (`serve/api.py`); it
lives below the layers so a service that needs no cluster does not import `smolforge.cluster`.
Each service answers refusals in its own error shape (`error_body`).

Why a raw ASGI middleware and not a FastAPI dependency: FastAPI reads and parses a request's body
before its dependencies run, so a token check written as a dependency let anyone without the token
make the coordinator read, parse and hold a body of any size (a 100 MB JSON post took it from 305 MB
to 892 MB of RSS before the 401). Here a request without the right token is answered 401 before the
application sees it, so nothing reads its body; one with the token may send at most `max_body`
bytes (413 beyond: told by Content-Length at once, or counted as a chunked body streams in). The
upload route streams to disk and has its own, larger bound.

A request that carries the token also tells its listener that its connection proved itself
(`http_limits.admit`): until then the connection counts among the few unproven ones a listener
holds, so slow clients without the token cannot take the slots of those with it.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from fastapi import HTTPException

from smolforge.auth import bearer_of, tokens_match
from smolforge.http_limits import admit

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
# (status, error, fix) -> the JSON body of a refusal
ErrorBody = Callable[[int, str, "str | None"], bytes]

TOKEN_FIX = "pass the cluster token (Authorization: Bearer <token>)"


class Gate:
    """ASGI middleware: 401 without the token (open paths excepted), 413 over the size bound."""

    def __init__(self, app: Callable, *, token: Callable[[], str], open_paths: tuple[str, ...],
                 max_body: int, stream_paths: dict[str, int] | None = None, token_fix: str = TOKEN_FIX,
                 size_fix: str = "send a smaller request (files go through /api/v1/uploads)",
                 error_body: ErrorBody | None = None):
        self.app, self.token, self.open_paths = app, token, open_paths
        self.max_body, self.stream_paths = max_body, dict(stream_paths or {})
        self.token_fix, self.size_fix, self.error_body = token_fix, size_fix, error_body or coordinator_error_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers") or []}
        path = scope.get("path", "")
        given = bearer_of(headers.get(b"authorization", b"").decode("latin-1"))
        if given is not None and tokens_match(given, self.token()):
            admit(scope)  # the connection proved itself: the listener no longer counts it as unproven
        elif path not in self.open_paths:
            await _drain_small(receive, headers.get(b"content-length"))
            await _reply(send, 401, self.error_body(401, "missing or wrong token", self.token_fix),
                         {"www-authenticate": "Bearer"})
            return
        limit = self.stream_paths.get(path, self.max_body)
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await _reply(send, 400, self.error_body(400, "Content-Length is not a number", None))
                return
            if size > limit:
                await _reply(send, 413, self.error_body(
                    413, f"request body of {size} bytes is over this route's {limit}-byte limit", self.size_fix))
                return
        await self.app(scope, _counting(receive, limit), send)


def _counting(receive: Receive, limit: int) -> Receive:
    """`receive` that refuses (413) once a body without Content-Length grows past `limit`."""
    seen = 0

    async def counted() -> dict[str, Any]:
        nonlocal seen
        message = await receive()
        if message.get("type") == "http.request":
            seen += len(message.get("body") or b"")
            if seen > limit:
                raise HTTPException(status_code=413, detail=f"request body over this route's {limit}-byte limit")
        return message

    return counted


DRAIN_MAX = 64 * 1024  # a refused body this small is read and dropped; a bigger one stays unread


async def _drain_small(receive: Receive, declared: bytes | None) -> None:
    """Read and drop a refused request's body when it declares at most DRAIN_MAX bytes. Why: closing a
    socket whose received bytes were never read sends a reset, and a client that has not yet read the
    401 then loses it ("connection reset by peer", seen on a loaded machine). A small body is already in
    the kernel's buffer, so reading it costs nothing; a big or undeclared one is never read."""
    try:
        size = int(declared) if declared is not None else -1
    except ValueError:
        return
    if not 0 < size <= DRAIN_MAX:
        return
    seen = 0
    while seen <= size:
        message = await receive()
        if message.get("type") != "http.request":
            return
        seen += len(message.get("body") or b"")
        if not message.get("more_body"):
            return


def coordinator_error_body(status: int, error: str, fix: str | None) -> bytes:
    """The coordinator API's error shape, `{"error", "where", "fix"}`."""
    return json.dumps({"error": error, "where": None, "fix": fix}).encode()


async def _reply(send: Send, status: int, body: bytes, extra: dict[str, str] | None = None) -> None:
    """Answer and close the connection (the request body stays unread)."""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
