"""Hostile and careless clients: every body of issue 28 sent to one real `smolforge serve`, one after
another, each refused with its 4xx and each followed by a normal request answered 200; and slow
clients (headers never finished, connections held open, a body that never arrives) bounded by the
listener's settings: serve uses the coordinator's (`smolforge.http_limits`), with shorter bounds here."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from helpers import MB, post_raw
from servehelpers import hostile_bodies

pytestmark = pytest.mark.timeout(300)

NORMAL = {"model": "tiny", "messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 4,
          "temperature": 0.9, "seed": 7}


def test_every_hostile_body_gets_its_4xx_and_the_next_normal_request_200(server):
    auth = {"Authorization": f"Bearer {server.token}", "Content-Type": "application/json"}
    failures = []
    with httpx.Client(base_url=server.base, timeout=120) as c:
        for h in hostile_bodies():
            r = c.post(h.path, content=h.body, headers=auth if h.auth else {"Content-Type": "application/json"})
            err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
            if (r.status_code, err.get("code")) != (h.status, h.code):
                failures.append(f"{h.name}: {r.status_code} {r.text[:300]}")
            ok = c.post("/v1/chat/completions", json=NORMAL, headers=auth)
            if ok.status_code != 200:
                failures.append(f"after {h.name}: a normal request got {ok.status_code} {ok.text[:300]}")
        # bodies over the 4 MiB bound: refused unread (413), declared or streamed
        for chunked in (False, True):
            status, _ = post_raw(server.port, "/v1/chat/completions", 50 * MB, token=server.token, chunked=chunked)
            if status != 413:
                failures.append(f"a 50 MB body (chunked={chunked}): {status}")
            if c.post("/v1/chat/completions", json=NORMAL, headers=auth).status_code != 200:
                failures.append(f"after a 50 MB body (chunked={chunked}): no 200")
        health = c.get("/health").json()
    assert not failures, "\n".join(failures)
    assert health["ok"] and health["engine"] == "running" and health["restarts"] == 0
    assert server.proc.poll() is None


# -- slow clients, against a listener with the serve settings and short timeouts ------------------------

class Listener:
    """uvicorn with serve's settings (`server.serve_config`: the `http_limits` bounds) on a free loopback
    port, in a thread; a small app unless one is given."""

    def __init__(self, app=None):
        import uvicorn
        from fastapi import FastAPI

        from smolforge.serve.server import serve_config

        if app is None:
            app = FastAPI()
            app.get("/health")(lambda: {"ok": True})
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(serve_config(app, self.sock))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the listener did not start"
            time.sleep(0.02)

    def connections(self) -> int:
        return len(self.server.server_state.connections)

    def wait_connections(self, n: int) -> None:
        deadline = time.monotonic() + 60
        while self.connections() != n:
            assert time.monotonic() < deadline, f"{self.connections()} connections, waiting for {n}"
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def read_response(s: socket.socket) -> bytes:
    """One whole response (headers, then Content-Length bytes of body), however the packets split it.
    (It once returned only the first packets' bytes: a body sent after its headers was missing.)"""
    s.settimeout(60)
    data = b""
    while b"\r\n\r\n" not in data:
        data += recv_some(s)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += recv_some(s)
    return head + b"\r\n\r\n" + body


def recv_some(s: socket.socket) -> bytes:
    """The next bytes, or an AssertionError when the server closed before the response was whole."""
    chunk = s.recv(4096)
    assert chunk, "the server closed the connection before its response was whole"
    return chunk


def test_read_response_keeps_a_body_that_comes_in_a_later_chunk():
    """The test's own reader (the 408 test below failed once on it): a response whose body comes after
    its first 4,096 bytes is returned whole."""
    a, b = socket.socketpair()
    with a, b:
        body = b"x" * 500
        a.sendall(b"HTTP/1.1 200 OK\r\nx-pad: " + b"p" * 4000 + b"\r\ncontent-length: 500\r\n\r\n" + body)
        assert read_response(b).endswith(b"\r\n\r\n" + body)


def closed_by_server(s: socket.socket) -> bool:
    """True when the server closes this connection without answering (a hang guard, not a timer)."""
    s.settimeout(60)
    try:
        return s.recv(1024) == b""
    except ConnectionResetError:
        return True


def test_a_connection_that_never_finishes_its_headers_is_closed(monkeypatch):
    from smolforge import http_limits

    monkeypatch.setattr(http_limits, "HEADER_TIMEOUT_S", 0.5)
    srv = Listener()
    try:
        half = socket.create_connection(("127.0.0.1", srv.port))
        half.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the blank line never comes
        silent = socket.create_connection(("127.0.0.1", srv.port))  # not one byte
        kept = socket.create_connection(("127.0.0.1", srv.port))  # one request, then half of another
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(kept).startswith(b"HTTP/1.1 200")
        kept.sendall(b"GET /health HTTP/1.1\r\n")
        assert closed_by_server(half) and closed_by_server(silent) and closed_by_server(kept)
        srv.wait_connections(0)
        assert httpx.get(f"http://127.0.0.1:{srv.port}/health", timeout=60).status_code == 200
    finally:
        srv.close()


def test_unproven_connections_give_way_and_proven_ones_bound_the_listener(served_tiny, monkeypatch):
    """serve's front (the real app and gate, serve's listener settings) at 2 connections: two that never
    sent the token give way to one that does (the oldest is closed); once both slots hold clients that
    sent the token, a third connection is closed as it is accepted, until one of them closes."""
    from smolforge import http_limits
    from smolforge.serve import api
    from smolforge.serve.engine import Engine

    monkeypatch.setattr(http_limits, "MAX_CONNECTIONS", 2)
    app = api.create_app(served_tiny, Engine(served_tiny), token="t0k", model_name="tiny")
    models = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t0k\r\n\r\n"
    srv = Listener(app)
    idle = []
    try:
        idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(2)]
        srv.wait_connections(2)
        proven = socket.create_connection(("127.0.0.1", srv.port))
        proven.sendall(models)
        assert read_response(proven).startswith(b"HTTP/1.1 200")  # served: the oldest idle one gave way
        assert closed_by_server(idle[0])
        idle[1].close()
        srv.wait_connections(1)
        second = socket.create_connection(("127.0.0.1", srv.port))
        second.sendall(models)
        assert read_response(second).startswith(b"HTTP/1.1 200")
        third = socket.create_connection(("127.0.0.1", srv.port))
        third.sendall(models)
        assert closed_by_server(third)  # both slots proved themselves: closed as it was accepted, unanswered
        assert http_limits.slots_of(srv.server.server_state).refused == 1
        second.close()
        proven.close()
        srv.wait_connections(0)
        assert httpx.get(f"http://127.0.0.1:{srv.port}/health", timeout=60).status_code in (200, 503)
    finally:
        for s in idle:
            s.close()
        srv.close()


def test_a_body_that_never_arrives_is_408(served_tiny, monkeypatch):
    """Headers in time, then half the declared body and nothing more: the handler stops waiting (408)."""
    from smolforge.serve import api
    from smolforge.serve.engine import Engine

    monkeypatch.setattr(api, "BODY_TIMEOUT_S", 0.5)
    app = api.create_app(served_tiny, Engine(served_tiny), token="t0k", model_name="tiny")
    srv = Listener(app)
    try:
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t0k\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\": ")
        answer = read_response(s)
        assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer, answer[:300]
        s.close()
    finally:
        srv.close()
