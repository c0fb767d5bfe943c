"""From the engine thread to the event loop: a whole answer, or its tokens as server-sent events.

Why a bridge per request: the engine calls a request's sink on its own thread; the sink hands each
event to the request's `asyncio.Queue`, so no request holds a worker thread while it waits. An
`ErrorEvent` carries its status: 400 when the request's own settings failed it, 500 when the server
did, 503 when the engine stopped.

Why one `_Inbox` per event loop, and text chunks rendered from a template (issue 32): the event
loop's Python runs under the GIL the engine's forward needs, so every microsecond it spends per
token is a microsecond added to the engine's step. A `call_soon_threadsafe` per token per stream
was a self-pipe write and a loop wake-up each (eight per step for eight streams); the inbox wakes
the loop once for whatever the engine handed over since its last wake-up. A stream that finds
several events waiting sends them as one write, and a text chunk is its request's fixed JSON
around the new text (`_TextFrame`) instead of a dict serialized anew.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from smolforge.serve.events import DoneEvent, ErrorEvent, Event, TokenEvent, TokenLogprob
from smolforge.serve.logprobs import TokenText, chat_logprobs, completion_logprobs
from smolforge.serve.protocol import (
    ApiError,
    chat_chunk,
    completion_chunk,
    error_body,
    sse,
    usage_chunk,
)
from smolforge.serve.sampling import SamplingParams

if TYPE_CHECKING:  # the engine itself, or its handle in the HTTP front process (`channel.RemoteEngine`)
    from smolforge.serve.engine import Engine


class _Inbox:
    """Events from the engine thread for one event loop: queued at once, and the loop woken only when
    no wake-up is already on its way (one per engine step, not one per token per stream)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.pending: deque[tuple[asyncio.Queue[Event], Event]] = deque()
        self.lock = threading.Lock()
        self.scheduled = False
        self.wakeups = 0  # loop wake-ups asked for: the tests check they are fewer than the events

    def put(self, queue: asyncio.Queue[Event], event: Event) -> None:
        """On the engine thread: hand over one event."""
        self.pending.append((queue, event))
        with self.lock:
            if self.scheduled:
                return
            self.scheduled = True
            self.wakeups += 1
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed (the server is shutting down): nobody is left to tell
            with self.lock:
                self.scheduled = False

    def _drain(self) -> None:
        """On the loop: pass everything handed over so far to its request's queue. `scheduled` is
        cleared first, so an event put while draining either is drained here or wakes the loop again."""
        with self.lock:
            self.scheduled = False
        while self.pending:
            queue, event = self.pending.popleft()
            queue.put_nowait(event)


_inboxes: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Inbox]" = weakref.WeakKeyDictionary()


def inbox(loop: asyncio.AbstractEventLoop) -> _Inbox:
    """The loop's one inbox (made on the loop's own thread, so no race makes two)."""
    found = _inboxes.get(loop)
    if found is None:
        found = _inboxes[loop] = _Inbox(loop)
    return found


class _Bridge:
    """An engine sink that hands events to this event loop."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.inbox = inbox(asyncio.get_running_loop())

    def __call__(self, event: Event) -> None:
        self.inbox.put(self.queue, event)

    def waiting(self) -> list[Event]:
        """The events already queued, without waiting."""
        out = []
        while not self.queue.empty():
            out.append(self.queue.get_nowait())
        return out


def error_of(event: ErrorEvent) -> ApiError:
    kind = "invalid_request_error" if event.status < 500 else "server_error"
    return ApiError(event.status, event.message, type=kind)


async def collect(engine: Engine, ids: list[int], params: SamplingParams) -> DoneEvent:
    """Submit and wait for the whole answer; an error event is raised as its ApiError."""
    bridge = _Bridge()
    request = engine.submit(ids, params, bridge)
    try:
        while True:
            event = await bridge.queue.get()
            if isinstance(event, DoneEvent):
                return event
            if isinstance(event, ErrorEvent):
                raise error_of(event)
    finally:
        request.cancel()  # a no-op once done; frees the row if the client went away


class _TextFrame:
    """One request's text chunk as an SSE frame: the JSON of `make(SENTINEL)` split around the
    sentinel, so a token's frame is two byte strings and its text's JSON string, not a dict dumped."""

    SENTINEL = "\u0000smolforge-text\u0000"

    def __init__(self, make: Callable[[str], dict[str, Any]]):
        head, tail = sse(make(self.SENTINEL)).split(json.dumps(self.SENTINEL).encode(), 1)
        self.head, self.tail = head, tail

    def __call__(self, text: str) -> bytes:
        return self.head + json.dumps(text).encode() + self.tail


class ChatChunks:
    """A chat answer's chunks. `names` (a `logprobs.TokenText` after the prompt's ids) when the request
    asked for log-probabilities: each chunk then carries its tokens' (no fast text frame). `fingerprint`:
    the server's `system_fingerprint`, on every chunk (`protocol.system_fingerprint`)."""

    obj = "chat.completion.chunk"

    def __init__(self, cid: str, created: int, model: str, include_usage: bool, names: TokenText | None = None,
                 *, fingerprint: str | None = None):
        self.cid, self.created, self.model, self.include_usage = cid, created, model, include_usage
        self.names, self.fingerprint = names, fingerprint
        self.frame = _TextFrame(self.text)

    def chunk(self, delta: dict[str, Any], reason: str | None) -> dict[str, Any]:
        """One chunk of this answer with `delta`."""
        return chat_chunk(self.cid, self.created, self.model, delta, reason, self.fingerprint)

    def usage(self, done: DoneEvent) -> dict[str, Any]:
        """The usage chunk (`stream_options.include_usage`) of a finished answer."""
        return usage_chunk(self.cid, self.created, self.model, self.obj, done.prompt_tokens, done.completion_tokens,
                           done.cached_tokens, self.fingerprint)

    def first(self) -> dict[str, Any] | None:
        return self.chunk({"role": "assistant", "content": ""}, None)

    def opening(self, event: TokenEvent | DoneEvent) -> dict[str, Any] | None:
        """A chunk before the answer's first, made from its first event (echo: the prompt), or None."""
        return None

    def text(self, text: str, logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        chunk = self.chunk({"content": text}, None)
        if logprobs is not None and self.names is not None:
            chunk["choices"][0]["logprobs"] = chat_logprobs(self.names, logprobs)
        return chunk

    def last(self, reason: str) -> dict[str, Any]:
        return self.chunk({}, reason)

    def closing(self, reason: str) -> list[dict[str, Any]]:
        """The chunks that end the answer (serve/tools.py's send its held text and calls here)."""
        return [self.last(reason)]


class CompletionChunks(ChatChunks):
    """A legacy completion's chunks; with `echo`, the prompt's text (and its log-probabilities when
    asked for) is the first chunk; `text_offset` counts from the start of the whole text."""

    obj = "text_completion"

    def __init__(self, cid: str, created: int, model: str, include_usage: bool, names: TokenText | None = None,
                 echo: tuple[str, list[int]] | None = None, *, fingerprint: str | None = None):
        super().__init__(cid, created, model, include_usage, names, fingerprint=fingerprint)
        self.echo, self.offset = echo, 0

    def chunk(self, delta: dict[str, Any], reason: str | None) -> dict[str, Any]:
        """One chunk with `delta["text"]`."""
        return completion_chunk(self.cid, self.created, self.model, delta.get("text", ""), reason, self.fingerprint)

    def first(self) -> dict[str, Any] | None:
        return None

    def opening(self, event: TokenEvent | DoneEvent) -> dict[str, Any] | None:
        if self.echo is None:
            return None
        text, ids = self.echo
        chunk = self.chunk({"text": text}, None)
        if self.names is not None and event.prompt_logprobs is not None:
            lp = completion_logprobs(self.names, event.prompt_logprobs, 0, ids[0])
            chunk["choices"][0]["logprobs"] = lp
        elif self.names is not None:
            self.names.seen = list(ids)
        self.offset = len(text)
        return chunk

    def text(self, text: str, logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        chunk = self.chunk({"text": text}, None)
        if logprobs is not None and self.names is not None:
            lp = completion_logprobs(self.names, list(logprobs), self.offset)
            self.offset += sum(len(t) for t in lp["tokens"])
            chunk["choices"][0]["logprobs"] = lp
        return chunk

    def last(self, reason: str) -> dict[str, Any]:
        return self.chunk({"text": ""}, reason)


def reason(done: DoneEvent) -> str:
    return "length" if done.finish_reason == "length" else "stop"


def stream(engine: Engine, ids: list[int], params: SamplingParams, chunks: ChatChunks) -> StreamingResponse:
    """The answer as server-sent events (an error after the first byte is an `error` event)."""
    bridge = _Bridge()
    request = engine.submit(ids, params, bridge)

    async def events() -> AsyncIterator[bytes]:
        try:
            first = chunks.first()
            if first:
                yield sse(first)
            done = opened = False
            while not done:  # what waits is sent in one write: a stream that fell behind catches up
                frames = []
                for event in [await bridge.queue.get(), *bridge.waiting()]:
                    frame, done = _frame(event, chunks, opened)
                    opened = True
                    frames.append(frame)
                    if done:
                        frames.append(sse("[DONE]"))
                        break
                out = b"".join(frames)
                if out:  # a token that released no text yet (half a character, a stop string's start)
                    yield out
        finally:
            request.cancel()  # the client went away mid-stream: its row leaves the batch

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _frame(event: Event, chunks: ChatChunks, opened: bool = True) -> tuple[bytes, bool]:
    """An event's SSE bytes, and True when it is the stream's last event. Before the answer's first
    event (`opened` False) comes the chunk it opens with, if any (echo)."""
    head = b""
    if not opened and isinstance(event, (TokenEvent, DoneEvent)):
        opening = chunks.opening(event)
        head = sse(opening) if opening else b""
    if isinstance(event, TokenEvent):
        if event.logprobs is not None and chunks.names is not None:
            return head + (sse(chunks.text(event.text, event.logprobs)) if event.text or event.logprobs else b""), False
        return head + (chunks.frame(event.text) if event.text else b""), False
    if isinstance(event, DoneEvent):
        out = head + b"".join(sse(c) for c in chunks.closing(reason(event)))
        if chunks.include_usage:
            out += sse(chunks.usage(event))
        return out, True
    err = error_of(event)
    return sse(error_body(err.message, err.type)), True


# -- n > 1: one request's choices, each a row of the batch ------------------------------------------------

def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """Each of `n` choices' settings: the request's, choice k's seed `seed + k` (so the choices differ,
    choice 0 is the answer `n: 1` gives, and each repeats with the seed); no seed: each its own random one."""
    return [params if k == 0 or params.seed is None else dataclasses.replace(params, seed=params.seed + k)
            for k in range(n)]


async def collect_choices(engine: Engine, ids: list[int], params: list[SamplingParams]) -> list[DoneEvent]:
    """Every choice's whole answer, in choice order; the first error is raised (the others are cancelled)."""
    tasks = [asyncio.ensure_future(collect(engine, ids, p)) for p in params]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


class Indexed:
    """One choice's chunks when a request has several (`n`): the inner chunks', with `index` set to the
    choice's. The usage is sent once for all choices (`stream_choices`), not per choice."""

    include_usage = False

    def __init__(self, inner: ChatChunks, index: int):
        self.inner, self.index = inner, index
        self.frame = _TextFrame(self.text) if isinstance(inner.frame, _TextFrame) else self._pieces

    def _pieces(self, text: str) -> bytes:
        """A chunker that sends several chunks per text (serve/tools.py's), each marked with this index."""
        return b"".join(sse(self._mark(c)) for c in self.inner.pieces(text))  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _mark(self, chunk: dict[str, Any] | None) -> dict[str, Any] | None:
        for c in (chunk or {}).get("choices", []):
            c["index"] = self.index
        return chunk

    def first(self) -> dict[str, Any] | None:
        return self._mark(self.inner.first())

    def opening(self, event: TokenEvent | DoneEvent) -> dict[str, Any] | None:
        return self._mark(self.inner.opening(event))

    def text(self, text: str, logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        return self._mark(self.inner.text(text, logprobs))  # type: ignore[return-value]

    def closing(self, reason: str) -> list[dict[str, Any]]:
        return [self._mark(c) for c in self.inner.closing(reason)]  # type: ignore[misc]


class _Tagged:
    """An engine sink that hands (choice, event) to one queue shared by a request's choices."""

    def __init__(self, queue: asyncio.Queue[tuple[int, Event]], index: int):
        self.queue, self.index, self.inbox = queue, index, inbox(asyncio.get_running_loop())

    def __call__(self, event: Event) -> None:
        self.inbox.put(self.queue, (self.index, event))  # type: ignore[arg-type]


def stream_choices(engine: Engine, ids: list[int], params: list[SamplingParams], chunks: list[ChatChunks],
                   include_usage: bool) -> StreamingResponse:
    """Several choices of one prompt as one event stream (`n` > 1): each choice's chunks carry its
    `index`, in the order their tokens come; then, when asked, one usage chunk summing every choice's
    completion tokens (the prompt counted once, as OpenAI counts it); an error ends the whole stream."""
    queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
    requests: list[Any] = []
    try:
        for k, p in enumerate(params):
            requests.append(engine.submit(ids, p, _Tagged(queue, k)))
    except BaseException:
        for r in requests:
            r.cancel()
        raise
    views = [Indexed(c, k) for k, c in enumerate(chunks)]

    async def events() -> AsyncIterator[bytes]:
        try:
            head = b"".join(sse(f) for f in (v.first() for v in views) if f)
            if head:
                yield head
            opened, left, tokens, cached = [False] * len(views), len(views), [0, 0], 0
            while left:
                frames = []
                for k, event in [await queue.get(), *_drain(queue)]:
                    frame, done = _frame(event, views[k], opened[k])  # type: ignore[arg-type]
                    opened[k] = True
                    frames.append(frame)
                    if isinstance(event, ErrorEvent):
                        left = 0
                        break
                    if done:
                        left -= 1
                        tokens = [event.prompt_tokens, tokens[1] + event.completion_tokens]  # type: ignore[union-attr]
                        cached = event.cached_tokens if k == 0 else cached  # type: ignore[union-attr]
                if not left:
                    if include_usage and not isinstance(event, ErrorEvent):
                        frames.append(sse(usage_chunk(chunks[0].cid, chunks[0].created, chunks[0].model,
                                                      chunks[0].obj, *tokens, cached, chunks[0].fingerprint)))
                    frames.append(sse("[DONE]"))
                out = b"".join(frames)
                if out:
                    yield out
        finally:
            for r in requests:
                r.cancel()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _drain(queue: asyncio.Queue[Any]) -> list[Any]:
    out = []
    while not queue.empty():
        out.append(queue.get_nowait())
    return out
