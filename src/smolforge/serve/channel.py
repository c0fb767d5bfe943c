"""The engine and the HTTP side in two processes (`serve --front process`): one Unix socket between
them, a JSON object per line each way.

Why two processes (issue 32): in one process the engine's thread and uvicorn's event loop take turns
at one GIL, and on a 2-core laptop every microsecond the loop spends on a token's HTTP and SSE work
(py-spy: a quarter of both threads' busy samples were spent waiting for the GIL) was added to the
engine's step: one stream ran at 0.69x HF `generate`. With the HTTP side in its own process
(`serve/front.py`) the engine's process does only what `generate` does, plus one line written per
token; parsing, templates, tokenizing, SSE frames and slow clients run on the other core.

Why JSON lines over a socketpair and not pickle or multiprocessing queues: nothing that crosses a
process boundary is unpickled (the rule of every channel here), a line is cheap to write from the
engine's thread (one `sendall`, no lock held across a step), and an end of file is how either side
learns the other has gone: the front stops serving (its `/health` already says 503), the engine's
process stops its engine and exits.

Lines, front to engine: `{"op": "submit", "rid", "ids", "params"}` and `{"op": "cancel", "rid"}`.
Engine to front: `{"rid", "t", "id"}` a token's text, `{"rid", "done": {...}}` and
`{"rid", "err", "status"}` a request's one final event, `{"op": "stats", ...}` the engine's
counters (what `/health` reports), sent before a final event whenever they changed, and every
`STATS_EVERY_S` while they change without one (a restart, a failure).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import socket
import threading
from typing import Any, Callable

from smolforge.errors import SmolforgeError
from smolforge.serve.events import ContextLimits, DoneEvent, EngineStopped, ErrorEvent, Event, TokenEvent, TokenLogprob
from smolforge.serve.sampling import SamplingParams

log = logging.getLogger(__name__)

STATS_EVERY_S = 0.5  # how often the engine's side looks for a restart or failure no request reported
ENGINE_GONE_EXIT = 3  # the front's exit when the channel closed: the engine's process has gone (its own exit says why)
MAX_LINE_BYTES = 64 * 2**20  # a submit carries the prompt's ids: the API's 4 MiB body is far below this


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":"), allow_nan=False).encode() + b"\n"


def event_message(rid: int, event: Event) -> dict[str, Any]:
    """One event as its line's object."""
    if isinstance(event, TokenEvent):
        message = {"rid": rid, "t": event.text, "id": event.token_id}
        return {**message, **_logprobs_wire(event)} if event.logprobs is not None else message
    if isinstance(event, DoneEvent):
        done = {k: v for k, v in vars(event).items() if k not in ("logprobs", "prompt_logprobs")}
        return {"rid": rid, "done": done, **_logprobs_wire(event)}
    return {"rid": rid, "err": event.message, "status": event.status}


def _logprobs_wire(event: TokenEvent | DoneEvent) -> dict[str, Any]:
    """An event's log-probabilities as JSON values (`TokenLogprob.wire`), under "lp" and "plp"."""
    out: dict[str, Any] = {}
    if event.logprobs is not None:
        out["lp"] = [e.wire() for e in event.logprobs]
    if event.prompt_logprobs is not None:
        out["plp"] = [None if e is None else e.wire() for e in event.prompt_logprobs]
    return out


def _logprobs_of(message: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `_logprobs_wire`: keyword arguments of the event."""
    out: dict[str, Any] = {}
    if "lp" in message:
        out["logprobs"] = [TokenLogprob.from_wire(e) for e in message["lp"]]
    if "plp" in message:
        out["prompt_logprobs"] = [None if e is None else TokenLogprob.from_wire(e) for e in message["plp"]]
    return out


def message_event(message: dict[str, Any]) -> Event:
    """The event a line carries (the inverse of `event_message`)."""
    if "t" in message:
        return TokenEvent(message["t"], message["id"], **_logprobs_of(message))
    if "done" in message:
        return DoneEvent(**message["done"], **_logprobs_of(message))
    return ErrorEvent(message["err"], message["status"])


def read_lines(sock: socket.socket, on_line: Callable[[dict[str, Any]], None]) -> None:
    """Call `on_line` with every line's object until the other side closes (or the socket breaks)."""
    stream = sock.makefile("rb")
    try:
        while True:
            raw = stream.readline(MAX_LINE_BYTES)
            if not raw:
                return
            if not raw.endswith(b"\n"):
                raise ValueError(f"a line of over {MAX_LINE_BYTES} bytes on the engine channel")
            on_line(json.loads(raw))
    except OSError:
        return
    finally:
        stream.close()


class _Writer:
    """Whole lines, from any thread, never interleaved; a side that has gone makes writes no-ops."""

    def __init__(self, sock: socket.socket):
        self.sock, self.lock, self.closed = sock, threading.Lock(), False

    def send(self, message: dict[str, Any]) -> bool:
        data = encode(message)
        with self.lock:
            if self.closed:
                return False
            try:
                self.sock.sendall(data)
                return True
            except OSError:
                self.closed = True
                return False


def stats_of(engine: Any) -> dict[str, Any]:
    """The counters the front's `/health` and `/metrics` report (`Engine.counters`), as one line."""
    return {"op": "stats", "alive": engine.alive, "restarts": engine.restarts, "failure": engine.failure,
            **engine.counters()}


class EngineHost:
    """The engine's process end: submits and cancels from the front, events and counters back."""

    def __init__(self, engine: Any, sock: socket.socket):
        self.engine, self.sock, self.out = engine, sock, _Writer(sock)
        self.requests: dict[int, Any] = {}  # rid -> the engine's Request, until its final event
        self.lock = threading.Lock()
        self.sent_stats: dict[str, Any] | None = None
        self.gone = threading.Event()  # the front closed its end (or the channel broke)
        self.submitted = 0  # requests taken from the front: the tests read it

    def start(self) -> "EngineHost":
        self._stats()
        threading.Thread(target=self._serve, name="smolforge-engine-host", daemon=True).start()
        return self

    def _serve(self) -> None:
        """Read the front's lines; between them, every STATS_EVERY_S, report counters that changed."""
        reader = threading.Thread(target=read_lines, args=(self.sock, self._on_line), daemon=True,
                                  name="smolforge-engine-host-reader")
        reader.start()
        while reader.is_alive():
            reader.join(STATS_EVERY_S)
            self._stats()
        self.gone.set()
        with self.lock:
            left, self.requests = list(self.requests.values()), {}
        for request in left:  # nobody reads their tokens any more: their rows leave the batch
            request.cancel()

    def _on_line(self, message: dict[str, Any]) -> None:
        rid = int(message["rid"])
        if message.get("op") == "cancel":
            with self.lock:
                request = self.requests.get(rid)
            if request is not None:
                request.cancel()
            return
        self.submitted += 1
        try:
            params = SamplingParams(**message["params"])
            request = self.engine.submit(message["ids"], params, lambda event: self._event(rid, event))
        except SmolforgeError as err:  # checked on the front with the same rule: an engine that stopped
            status = 503 if isinstance(err, EngineStopped) else 400
            self._stats()
            self.out.send(event_message(rid, ErrorEvent(err.render().replace("\n  fix:", " Fix:"), status)))
            return
        with self.lock:
            if request.finish_reason is None:  # not already answered (on the engine's thread, meanwhile)
                self.requests[rid] = request

    def _event(self, rid: int, event: Event) -> None:
        """On the engine's thread: one line per event; counters first, before a request's last one."""
        if not isinstance(event, TokenEvent):
            with self.lock:
                self.requests.pop(rid, None)
            self._stats()
        self.out.send(event_message(rid, event))

    def _stats(self) -> None:
        now = stats_of(self.engine)
        if now != self.sent_stats:
            self.sent_stats = now
            self.out.send(now)


class _RemoteRequest:
    """What `submit` returns on the front: `cancel()`, as an engine's `Request`."""

    def __init__(self, engine: "RemoteEngine", rid: int):
        self.engine, self.rid = engine, rid

    def cancel(self) -> None:
        self.engine._cancel(self.rid)


class RemoteEngine(ContextLimits):
    """The front's handle on the engine in the other process: what `api.py` and `streams.py` use of an
    `Engine` (`submit`, the context rule, `alive` and the counters `/health` reports)."""

    def __init__(self, sock: socket.socket, max_positions: int, max_batch: int | None = None):
        self.sock, self.out, self.max_positions = sock, _Writer(sock), max_positions
        self.max_batch = max_batch  # the engine's rows at once: the bound on a request's `n` (api.py)
        self.sinks: dict[int, Callable[[Event], None]] = {}
        self.lock = threading.Lock()
        self.ids = itertools.count(1)
        self.connected = True
        self.stats: dict[str, Any] = {"alive": True, "restarts": 0, "batches": 0, "largest_batch": 0, "failure": None}
        self.on_death: Callable[[str], None] | None = None

    def start(self) -> "RemoteEngine":
        threading.Thread(target=self._read, name="smolforge-engine-channel", daemon=True).start()
        return self

    @property
    def alive(self) -> bool:
        return self.connected and bool(self.stats["alive"])

    @property
    def restarts(self) -> int:
        return int(self.stats["restarts"])

    @property
    def batches(self) -> int:
        return int(self.stats["batches"])

    @property
    def largest_batch(self) -> int:
        return int(self.stats["largest_batch"])

    @property
    def failure(self) -> str | None:
        return self.stats["failure"]

    def counters(self) -> dict[str, Any]:
        """The engine's last reported `Engine.counters` (batches, steps, prefill, prefix cache)."""
        return {k: v for k, v in self.stats.items() if k not in ("alive", "restarts", "failure")}

    def stage_infos(self) -> list[dict[str, Any] | None]:
        """No stages behind a front process (`serve --stages` runs its app in the API actor, over `Engine`)."""
        return []

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Callable[[Event], None]) -> _RemoteRequest:
        self.check_length(len(prompt_ids), params.max_tokens)
        if not self.alive:
            raise EngineStopped(f"the generation engine is not running{': ' + self.failure if self.failure else ''}",
                                fix="restart the server (`smolforge serve`); its log says what stopped the engine")
        rid = next(self.ids)
        with self.lock:
            self.sinks[rid] = sink
        if not self.out.send({"op": "submit", "rid": rid, "ids": list(prompt_ids),
                              "params": dataclasses.asdict(params)}):
            with self.lock:
                self.sinks.pop(rid, None)
            raise EngineStopped("the generation engine's process has gone", fix="restart the server (`smolforge serve`)")
        return _RemoteRequest(self, rid)

    def _cancel(self, rid: int) -> None:
        with self.lock:
            live = self.sinks.pop(rid, None) is not None
        if live:  # a request already answered needs no word
            self.out.send({"op": "cancel", "rid": rid})

    def _read(self) -> None:
        try:
            read_lines(self.sock, self._on_line)
        except Exception as err:  # noqa: BLE001 - a line we cannot read: the channel is no use any more
            log.exception("the engine channel broke")
            self.stats["failure"] = f"the engine channel broke: {type(err).__name__}: {err}"
        self.connected = False
        reason = self.stats["failure"] or "the engine's process has gone"
        self.stats["failure"] = reason
        with self.lock:
            left, self.sinks = list(self.sinks.values()), {}
        for sink in left:
            sink(ErrorEvent(f"the generation engine stopped: {reason}", 503))
        if self.on_death is not None:
            self.on_death(reason)

    def _on_line(self, message: dict[str, Any]) -> None:
        if message.get("op") == "stats":
            self.stats = {k: v for k, v in message.items() if k != "op"}
            return
        rid = message["rid"]
        event = message_event(message)
        with self.lock:
            sink = self.sinks.get(rid) if isinstance(event, TokenEvent) else self.sinks.pop(rid, None)
        if sink is not None:
            sink(event)
