"""From the engine thread to the event loop: a whole answer, or its tokens as server-sent events.

Why a bridge per request: the engine calls a request's sink on its own thread; the sink hands each
event to the request's `asyncio.Queue` with `call_soon_threadsafe`, so no request holds a worker
thread while it waits. An `ErrorEvent` carries its status: 400 when the request's own settings
failed it, 500 when the server did, 503 when the engine stopped.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from fastapi.responses import StreamingResponse

from smolforge.serve.batch import DoneEvent, ErrorEvent, Event, TokenEvent
from smolforge.serve.engine import Engine
from smolforge.serve.protocol import (
    ApiError,
    chat_chunk,
    completion_chunk,
    error_body,
    sse,
    usage_chunk,
)
from smolforge.serve.sampling import SamplingParams


class _Bridge:
    """An engine sink that hands events to this event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()

    def __call__(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


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


class ChatChunks:
    obj = "chat.completion.chunk"

    def __init__(self, cid: str, created: int, model: str, include_usage: bool):
        self.cid, self.created, self.model, self.include_usage = cid, created, model, include_usage

    def first(self) -> dict[str, Any] | None:
        return chat_chunk(self.cid, self.created, self.model, {"role": "assistant", "content": ""}, None)

    def text(self, text: str) -> dict[str, Any]:
        return chat_chunk(self.cid, self.created, self.model, {"content": text}, None)

    def last(self, reason: str) -> dict[str, Any]:
        return chat_chunk(self.cid, self.created, self.model, {}, reason)


class CompletionChunks(ChatChunks):
    obj = "text_completion"

    def first(self) -> dict[str, Any] | None:
        return None

    def text(self, text: str) -> dict[str, Any]:
        return completion_chunk(self.cid, self.created, self.model, text, None)

    def last(self, reason: str) -> dict[str, Any]:
        return completion_chunk(self.cid, self.created, self.model, "", reason)


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
            while True:
                event = await bridge.queue.get()
                if isinstance(event, TokenEvent):
                    if event.text:
                        yield sse(chunks.text(event.text))
                elif isinstance(event, DoneEvent):
                    yield sse(chunks.last(reason(event)))
                    if chunks.include_usage:
                        yield sse(usage_chunk(chunks.cid, chunks.created, chunks.model, chunks.obj,
                                              event.prompt_tokens, event.completion_tokens))
                    break
                else:
                    err = error_of(event)
                    yield sse(error_body(err.message, err.type))
                    break
            yield sse("[DONE]")
        finally:
            request.cancel()  # the client went away mid-stream: its row leaves the batch

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
