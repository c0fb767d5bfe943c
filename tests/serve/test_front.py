"""The HTTP side in a process of its own (`serve --front process`, the default; issue 32).

In-process, over a real socketpair (`serve/channel.py`): a request through `RemoteEngine` and
`EngineHost` gets the engine's own tokens; the counters `/health` reports reach the front before a
request's last event; a cancel reaches the engine's row; the engine's death fails what waits with
503; the front's going cancels the engine's rows; every line is JSON, never pickle.

As processes (`smolforge serve`): the front is a child that holds neither the token on its argv nor
in its environment; killing the front ends `serve` with one message (exit 1); killing the engine's
process ends the front on its own (soak: the in-process test of the channel's end is the CI proof);
SIGTERM ends both (in `test_serve_cli.py`'s token test).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket

import pytest

from servehelpers import front_of, gone, until
from smolforge.serve.channel import EngineHost, RemoteEngine
from smolforge.serve.engine import Engine
from smolforge.serve.events import DoneEvent, EngineStopped, ErrorEvent, TokenEvent
from smolforge.serve.sampling import SamplingParams

pytestmark = pytest.mark.timeout(300)

GREEDY = SamplingParams(max_tokens=16, temperature=0)
WAIT_S = 60  # a bound on every wait: only a hang reaches it (servehelpers.until: the same)


@pytest.fixture
def linked(served_tiny):
    """A real engine, its host on one end of a socketpair, the front's handle on the other."""
    engine = Engine(served_tiny).start()
    host_end, front_end = socket.socketpair()
    host = EngineHost(engine, host_end).start()
    remote = RemoteEngine(front_end, engine.max_positions).start()
    try:
        yield engine, host, remote
    finally:
        engine.stop()
        host_end.close()
        front_end.close()


def drain(events: queue.Queue) -> list:
    out = [events.get(timeout=WAIT_S)]
    while isinstance(out[-1], TokenEvent):
        out.append(events.get(timeout=WAIT_S))
    return out


def test_a_request_through_the_channel_gets_the_engines_tokens_and_counters_first(linked, served_tiny):
    engine, host, remote = linked
    ids = served_tiny.tokenizer("the of and to")["input_ids"]
    expected = engine.generate(ids, GREEDY, timeout=WAIT_S)
    batches_before = engine.batches
    events: queue.Queue = queue.Queue()
    seen_batches: list[int] = []

    def sink(event):
        if not isinstance(event, TokenEvent):
            seen_batches.append(remote.batches)  # what /health would say when the answer ends
        events.put(event)

    remote.submit(ids, GREEDY, sink)
    got = drain(events)
    done = got[-1]
    assert isinstance(done, DoneEvent) and done.token_ids == expected.token_ids and done.text == expected.text
    assert "".join(e.text for e in got[:-1]) == expected.text
    assert seen_batches == [batches_before + 1]  # the counters arrived before the last event
    assert remote.alive and host.submitted == 1


def test_a_cancel_reaches_the_engines_row(linked, served_tiny):
    engine, host, remote = linked
    ids = served_tiny.tokenizer("the of and to")["input_ids"]
    first: queue.Queue = queue.Queue()
    handle = remote.submit(ids, SamplingParams(max_tokens=400, temperature=0), first.put)
    assert isinstance(first.get(timeout=WAIT_S), TokenEvent)
    row = until(lambda: next(iter(host.requests.values()), None), "the engine's row")
    handle.cancel()
    until(lambda: row.finish_reason == "cancelled", "the row's cancel")
    assert len(row.token_ids) < 400 and not remote.sinks
    after: queue.Queue = queue.Queue()  # the engine goes on serving
    remote.submit(ids, GREEDY, after.put)
    assert isinstance(drain(after)[-1], DoneEvent)


def test_a_stopped_engine_fails_what_waits_with_503_and_refuses_more(linked, served_tiny):
    engine, host, remote = linked
    ids = served_tiny.tokenizer("the of and to")["input_ids"]
    events: queue.Queue = queue.Queue()
    engine._stopping.set()  # the engine is stopping: what is submitted now is refused there (503)
    remote.submit(ids, GREEDY, events.put)
    engine.stop()
    event = events.get(timeout=WAIT_S)
    assert isinstance(event, ErrorEvent) and event.status == 503
    until(lambda: not remote.alive, "the front learning the engine stopped")
    with pytest.raises(EngineStopped):
        remote.submit(ids, GREEDY, events.put)


def test_the_fronts_going_cancels_the_engines_rows(linked, served_tiny):
    engine, host, remote = linked
    ids = served_tiny.tokenizer("the of and to")["input_ids"]
    first: queue.Queue = queue.Queue()
    remote.submit(ids, SamplingParams(max_tokens=400, temperature=0), first.put)
    first.get(timeout=WAIT_S)
    row = until(lambda: next(iter(host.requests.values()), None), "the engine's row")
    remote.sock.shutdown(socket.SHUT_RDWR)  # the front's process has gone
    until(host.gone.is_set, "the host seeing the front go")
    until(lambda: row.finish_reason == "cancelled", "the row's cancel")
    assert len(row.token_ids) < 400


def test_the_engines_going_fails_what_waits_and_tells_the_front(linked, served_tiny):
    """The channel's end of file (the engine's process has gone, even SIGKILLed): what waits gets a 503,
    `alive` is False, and `on_death` tells the front to stop serving (`front.run` then exits 3)."""
    engine, host, remote = linked
    died: queue.Queue = queue.Queue()
    remote.on_death = died.put
    ids = served_tiny.tokenizer("the of and to")["input_ids"]
    events: queue.Queue = queue.Queue()
    remote.submit(ids, SamplingParams(max_tokens=400, temperature=0), events.put)
    assert isinstance(events.get(timeout=WAIT_S), TokenEvent)
    until(lambda: host.requests, "the engine's row")
    host.sock.shutdown(socket.SHUT_RDWR)  # the engine's process has gone
    assert "gone" in died.get(timeout=WAIT_S)
    last = drain(events)[-1]
    assert isinstance(last, ErrorEvent) and last.status == 503
    assert not remote.alive
    with pytest.raises(EngineStopped):
        remote.submit(ids, GREEDY, events.put)


def test_every_line_on_the_channel_is_json(served_tiny):
    """What the engine's process writes is JSON lines (nothing to unpickle on the front)."""
    engine = Engine(served_tiny).start()
    host_end, front_end = socket.socketpair()
    EngineHost(engine, host_end).start()
    try:
        ids = served_tiny.tokenizer("the of and to")["input_ids"]
        params = {"max_tokens": 4, "temperature": 0, "top_p": 1.0, "stop": [], "seed": None}
        front_end.sendall(json.dumps({"op": "submit", "rid": 7, "ids": ids, "params": params}).encode() + b"\n")
        lines, stream = [], front_end.makefile("rb")
        while not lines or "done" not in lines[-1]:
            lines.append(json.loads(stream.readline()))
        kinds = [("stats" if m.get("op") == "stats" else "t" if "t" in m else "done") for m in lines]
        assert kinds[0] == "stats" and kinds[-1] == "done" and kinds.count("t") >= 1
        assert all(m["rid"] == 7 for m in lines if m.get("op") != "stats")
    finally:
        engine.stop()
        host_end.close()
        front_end.close()


# -- as processes ---------------------------------------------------------------------------------

def test_the_front_is_a_child_without_the_token_on_its_argv_or_environment(server):
    front = front_of(server.proc.pid)
    argv = open(f"/proc/{front}/cmdline", "rb").read()
    environ = open(f"/proc/{front}/environ", "rb").read()
    assert server.token.encode() not in argv and server.token.encode() not in environ
    assert server.client().models.list().data[0].id == server.model  # and it serves


def test_killing_the_front_ends_serve_with_one_message(model_copy, tmp_path):
    from servehelpers import start_server

    srv = start_server(tmp_path, model_copy)
    try:
        os.kill(front_of(srv.proc.pid), signal.SIGKILL)
        code = srv.proc.wait(WAIT_S)
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
    log = srv.log.read_text()
    assert code == 1, log
    assert "the HTTP front process ended with exit code -9" in log and "Traceback" not in log


@pytest.mark.soak  # the second instance: the channel's end of file is proven in-process above
def test_killing_the_engines_process_ends_the_front(model_copy, tmp_path):
    from servehelpers import start_server

    srv = start_server(tmp_path, model_copy)
    front = front_of(srv.proc.pid)
    try:
        srv.proc.kill()
        srv.proc.wait(WAIT_S)
        until(lambda: gone(front), "the front's exit")
    finally:
        if not gone(front):
            os.kill(front, signal.SIGKILL)
    with pytest.raises(OSError):  # nobody listens any more
        socket.create_connection(("127.0.0.1", srv.port), timeout=5).close()
