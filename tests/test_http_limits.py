"""What one client may hold of a smolforge listener (`smolforge/http_limits.py`), on a real uvicorn
server on loopback behind the real gate (`smolforge/gate.py`): a request head that never ends, a body
that stalls and a connection past the cap are closed by the server, while ordinary requests beside
them are answered; connections that never sent the token hold at most their share of the slots, so
hundreds of slow ones never lock out a client with the token; JSON nesting is counted on the raw
bytes, strings skipped, in linear time."""

from __future__ import annotations

import contextlib
import socket
import threading
from http.client import HTTPException

import pytest

from smolforge import http_limits
from smolforge.http_limits import json_depth

TOKEN = "t0k-of-the-listener"
GET = b"GET /ok HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n\r\n"
HEALTH = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"  # an open path: answered, but proves nothing


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
    """A small app behind the real gate: /ok needs the token, /health is open."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from smolforge.gate import Gate

    async def ok(request):
        await request.body()
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/ok", ok, methods=["GET", "POST"]), Route("/health", ok)])
    return Gate(app, token=lambda: TOKEN, open_paths=("/health",), max_body=1 << 20)


@contextlib.contextmanager
def _listening(app):
    """`app` on a free loopback port under `server_config` (the coordinator's listener), in a thread."""
    import uvicorn

    from smolforge.cluster.nodes.statedir import free_port

    port = free_port()
    srv = uvicorn.Server(http_limits.server_config(app, "127.0.0.1", port, log_level="warning", lifespan="off"))
    srv.install_signal_handlers = lambda: None
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        while not srv.started:
            thread.join(0.05)
            assert thread.is_alive(), "the server did not start"
        yield port, srv
    finally:
        srv.should_exit = True
        thread.join(30)


@pytest.fixture
def server(monkeypatch):
    """A bounded listener with short limits (0.5 s to send a head or a body's next bytes, 3 connections,
    of which 2 unproven)."""
    monkeypatch.setattr(http_limits, "HEADER_TIMEOUT_S", 0.5)
    monkeypatch.setattr(http_limits, "BODY_IDLE_S", 0.5)
    monkeypatch.setattr(http_limits, "MAX_CONNECTIONS", 3)
    monkeypatch.setattr(http_limits, "MAX_UNPROVEN", 2)
    with _listening(_app()) as (port, _):
        yield port


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
    """Send a request and read its whole response (head and body: the connection is used again);
    False when the server closed the connection instead."""
    from http.client import HTTPResponse

    try:
        sock.sendall(request)
        response = HTTPResponse(sock)
        response.begin()
        return response.status == 200 and response.read() == b"ok"
    except (OSError, HTTPException):
        return False


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


def test_connections_past_the_cap_are_closed_when_every_slot_proved_itself(server, monkeypatch):
    monkeypatch.setattr(http_limits, "HEADER_TIMEOUT_S", 600)  # the first three wait idle, not timed out
    held = []
    for _ in range(3):  # each sends the token before the next connects: none can be evicted
        held.append(_connect(server))
        assert _answered(held[-1])
    extra = _connect(server)  # the kernel accepts it; the server closes it at once
    assert _closed(extra), "the server kept a connection past MAX_CONNECTIONS"
    assert [_answered(sock) for sock in held] == [True] * 3
    for sock in held:
        sock.close()


def test_a_new_connection_takes_the_slot_of_the_oldest_unproven_one(server, monkeypatch):
    """Three unproven connections fill the listener (one silent, one that asked an open path without the
    token, one halfway through its head): a fourth, with the token, is served, and the oldest is closed
    to give it its slot; the others keep theirs. (Before, the fourth was closed as it was accepted.)"""
    monkeypatch.setattr(http_limits, "HEADER_TIMEOUT_S", 600)
    monkeypatch.setattr(http_limits, "MAX_UNPROVEN", 3)  # the whole listener: its cap alone decides here
    oldest, middle, younger = _connect(server), _connect(server), _connect(server)
    assert _answered(middle, HEALTH)  # answered, still unproven: it never sent the token
    younger.sendall(b"GET /ok HT")
    with _connect(server) as new:
        assert _answered(new), "a client with the token was not served beside three unproven connections"
    assert _closed(oldest), "the oldest unproven connection kept its slot"
    younger.sendall(b"TP/1.1\r\nHost: t\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n\r\n")
    assert _answered(younger, b"")  # the younger one kept its slot and finished its request
    middle.close()
    younger.close()


# -- many slow clients without the token ------------------------------------------------------------------

SLOW = 300  # connections that send a header byte now and then, never the token (the review's number)
ROUNDS = 24  # requests with the token, each on a new connection, while they are held
DRIBBLE = 25  # slow connections that send one more byte (or reconnect, when closed) before each request


def _fd_room(needed: int) -> int:
    """Raise this process's soft limit on open files towards `needed` (the hard limit caps it); how many
    slow connections fit: each takes two descriptors here (the client's and the server's end)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        soft = want
    return SLOW if soft == resource.RLIM_INFINITY else min(SLOW, (soft - 200) // 2)


def _slow(port: int) -> socket.socket:
    sock = _connect(port)
    with contextlib.suppress(OSError):  # closed at once: the next dribble sees it
        sock.sendall(b"GET /ok HTTP/1.1\r\nHost: t\r\n")  # then one byte now and then, never the blank line
    return sock


def _dribble(port: int, sock: socket.socket) -> tuple[socket.socket, bool]:
    """One more header byte on `sock`, or a new slow connection when the server closed it; and whether
    it had been closed. (Readable means closed here: the server never answers a head that never ends.)"""
    import select

    try:
        if not select.select([sock], [], [], 0)[0]:
            sock.sendall(b"x")
            return sock, False
    except OSError:
        pass
    sock.close()
    return _slow(port), True


def test_slow_clients_without_the_token_never_lock_out_one_with_it(monkeypatch):
    """The review's attack on the real limits (256 connections, 64 unproven): 300 connections that send
    a header byte now and then (and reconnect when closed) are held while a client with the token sends
    24 requests, each on a new connection: all 24 are answered. Before, the 300 took all 256 slots and
    each new connection was closed as it was accepted. The header timeout is set out of reach here: the
    share of unproven slots alone must keep the client served."""
    slow_n = _fd_room(2 * SLOW + 400)
    monkeypatch.setattr(http_limits, "HEADER_TIMEOUT_S", 600)
    monkeypatch.setattr(http_limits, "MAX_CONNECTIONS", 256)
    monkeypatch.setattr(http_limits, "MAX_UNPROVEN", 64)
    slow: list[socket.socket] = []
    with _listening(_app()) as (port, srv):
        try:
            slow = [_slow(port) for _ in range(slow_n)]
            answers, reconnected = [], 0
            for i in range(ROUNDS):
                for j in range(DRIBBLE):
                    k = (i * DRIBBLE + j) % slow_n
                    slow[k], closed = _dribble(port, slow[k])
                    reconnected += closed
                with _connect(port) as sock:
                    answers.append(_answered(sock))
            slots = http_limits.slots_of(srv.server_state)
            assert answers == [True] * ROUNDS, f"{answers.count(True)} of {ROUNDS} requests with the token answered"
            assert slots.refused == 0 and slots.admitted >= ROUNDS, vars(slots)
            assert slots.evicted >= slow_n - 64 and reconnected > 0, (vars(slots), reconnected)
            assert len(slots.unproven) <= 64
        finally:
            for sock in slow:
                sock.close()


def test_a_stop_does_not_wait_for_an_idle_tls_client_to_say_goodbye(tmp_path):
    """SIGINT/SIGTERM on a TLS listener (the coordinator with --tls) while a client holds a kept-alive
    connection idle: uvicorn closes it, and TLS's close waits for the client's close_notify, which an idle
    client never sends, up to asyncio's `ssl_shutdown_timeout` (30 s): the coordinator took 33.5 s to stop.
    Every listener's stop now waits SHUTDOWN_GRACE_S for requests in flight, then goes on: uvicorn says so
    ("timeout graceful shutdown exceeded"), and the server ends while the client still holds the socket."""
    import logging
    import ssl

    import uvicorn

    from smolforge.cluster.nodes.statedir import free_port
    from smolforge.cluster.nodes.tls import ensure_cert

    cert, key = ensure_cert(tmp_path, ["127.0.0.1"])
    port = free_port()
    config = http_limits.server_config(_app(), "127.0.0.1", port, log_level="warning", lifespan="off",
                                       ssl_certfile=str(cert), ssl_keyfile=str(key))
    assert config.timeout_graceful_shutdown == http_limits.SHUTDOWN_GRACE_S
    srv = uvicorn.Server(config)
    srv.install_signal_handlers = lambda: None
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        while not srv.started:
            thread.join(0.05)
            assert thread.is_alive(), "the server did not start"
        logging.getLogger("uvicorn.error").addHandler(handler)  # after uvicorn configured its loggers
        client = context.wrap_socket(_connect(port), server_hostname="127.0.0.1")
        assert _answered(client)  # a request answered; the connection is kept alive, idle
        srv.should_exit = True
        thread.join(60)  # a hang guard: what is asserted is uvicorn's own decision below
        assert not thread.is_alive(), "the server is still waiting for the idle TLS client"
        assert any("timeout graceful shutdown exceeded" in line for line in said), said
        client.close()
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
        srv.should_exit = True
        thread.join(60)
