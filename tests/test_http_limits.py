"""What one client may hold of a smolforge listener (`smolforge/http_limits.py`), on a real uvicorn
server on loopback: a request head that never ends, a body that stalls and a connection past the cap
are closed by the server, while ordinary requests beside them are answered; JSON nesting is counted
on the raw bytes, strings skipped, in linear time."""

from __future__ import annotations

import socket
import threading

import pytest

from smolforge import http_limits
from smolforge.http_limits import json_depth

GET = b"GET /ok HTTP/1.1\r\nHost: t\r\n\r\n"


def test_json_depth_counts_brackets_outside_strings():
    assert json_depth(b'{"a": [1, {"b": []}]}') == 4
    assert json_depth(b'{"prompt": "[[[[{{{{ \\" ]]]]"}') == 1  # brackets in a string, an escaped quote
    assert json_depth(b"[" * 100_000 + b"]" * 100_000) == http_limits.MAX_JSON_DEPTH + 1  # counted up to the bound
    assert json_depth(b"[[[[" + b"1") == 0  # never closed: not JSON, left to the parser to refuse
    assert json_depth(b"") == 0


def test_json_depth_is_linear_on_unterminated_strings():
    """An escaped quote after an open one, 2 MB of it: a regex that could fail and rescan would take
    hours; this finishes (the test's time limit is the guard)."""
    assert json_depth(b'["' + b'\\"' * 1_000_000) == 0


def _app():
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    async def ok(request):
        await request.body()
        return PlainTextResponse("ok")

    return Starlette(routes=[Route("/ok", ok, methods=["GET", "POST"])])


@pytest.fixture
def server(monkeypatch):
    """A bounded listener with short limits (0.5 s to send a head or a body's next bytes, 3 connections)."""
    import uvicorn

    from smolforge.cluster.nodes.statedir import free_port

    monkeypatch.setattr(http_limits, "HEADER_TIMEOUT_S", 0.5)
    monkeypatch.setattr(http_limits, "BODY_IDLE_S", 0.5)
    monkeypatch.setattr(http_limits, "MAX_CONNECTIONS", 3)
    port = free_port()
    srv = uvicorn.Server(http_limits.server_config(_app(), "127.0.0.1", port, log_level="warning", lifespan="off"))
    srv.install_signal_handlers = lambda: None
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        thread.join(0.05)
        assert thread.is_alive(), "the server did not start"
    yield port
    srv.should_exit = True
    thread.join(30)


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30)  # 30 s: a hang guard, never a measure


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed the connection (what it sends before closing is read and dropped)."""
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def _answered(sock: socket.socket, request: bytes = GET) -> bool:
    """Send a request and read its whole response (head and body: the connection is used again)."""
    from http.client import HTTPResponse

    sock.sendall(request)
    response = HTTPResponse(sock)
    response.begin()
    return response.status == 200 and response.read() == b"ok"


def test_a_request_head_that_never_ends_is_closed(server):
    slow = _connect(server)
    slow.sendall(b"GET /ok HTTP/1.1\r\nHost: t\r\n")  # and never the blank line
    with _connect(server) as other:
        assert _answered(other)  # served beside it
    assert _closed(slow), "the server kept a connection whose request head never ended"


def test_the_next_request_on_a_kept_alive_connection_has_the_same_limit(server):
    kept = _connect(server)
    assert _answered(kept)
    kept.sendall(b"GET /ok HT")
    assert _closed(kept), "the server kept a kept-alive connection whose next head never ended"


def test_a_body_that_stalls_is_closed(server):
    stalled = _connect(server)
    stalled.sendall(b"POST /ok HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n" + b"x" * 10)
    assert _closed(stalled), "the server kept a connection whose body stalled"


def test_connections_past_the_cap_are_closed_and_the_others_served(server, monkeypatch):
    monkeypatch.setattr(http_limits, "HEADER_TIMEOUT_S", 600)  # the first three wait idle, not timed out
    held = [_connect(server) for _ in range(3)]
    assert _answered(held[0])  # the server has all three (a request on one of them is answered)
    extra = _connect(server)  # the kernel accepts it; the server closes it at once
    assert _closed(extra), "the server kept a connection past MAX_CONNECTIONS"
    assert [_answered(sock) for sock in held] == [True] * 3
    for sock in held:
        sock.close()
