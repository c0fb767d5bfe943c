"""The bridge from the engine thread to the event loop (issue 32): one loop wake-up for the events
handed over together, waiting events sent in one write, and text frames byte-equal to the chunk
they stand for. No model: the engine is a stand-in that keeps the sink."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from smolforge.serve.batch import DoneEvent, TokenEvent
from smolforge.serve.protocol import sse
from smolforge.serve.sampling import SamplingParams
from smolforge.serve.streams import ChatChunks, CompletionChunks, _Inbox, stream

pytestmark = pytest.mark.timeout(60)


def test_events_handed_over_together_wake_the_loop_once():
    loop = asyncio.new_event_loop()
    try:
        inbox = _Inbox(loop)
        queues = [asyncio.Queue() for _ in range(8)]

        def engine_step(step: int) -> None:  # eight streams' tokens of one step, from another thread
            for i, q in enumerate(queues):
                inbox.put(q, TokenEvent(f"{i}:{step}", step))

        for step in range(3):
            t = threading.Thread(target=engine_step, args=(step,))
            t.start()
            t.join(10)
        loop.run_until_complete(asyncio.sleep(0))
        assert inbox.wakeups == 1  # 24 events, the loop not yet free: one wake-up
        for i, q in enumerate(queues):
            assert [q.get_nowait().text for _ in range(3)] == [f"{i}:{s}" for s in range(3)]
            assert q.empty()
        engine_step(3)  # after a drain, the next event wakes the loop again
        loop.run_until_complete(asyncio.sleep(0))
        assert inbox.wakeups == 2 and all(q.get_nowait().text == f"{i}:3" for i, q in enumerate(queues))
    finally:
        loop.close()


@pytest.mark.parametrize("kind", [ChatChunks, CompletionChunks])
def test_a_text_frame_is_its_chunk_serialized(kind):
    chunks = kind('cmpl-"1"', 1700000000, "a/model\\name", False)
    for text in ["hi", " é字😀", 'quote " backslash \\ newline \n tab \t', "\u0000", "\ud7ff\ue000",
                 "\u0000smolforge-text\u0000"]:
        assert chunks.frame(text) == sse(chunks.text(text))


class _Engine:
    """Keeps the sink `stream` submits with, so the test plays the engine thread."""

    class _Request:
        cancelled = False

        def cancel(self) -> None:
            self.cancelled = True

    def submit(self, ids, params, sink):
        self.sink, self.request = sink, self._Request()
        return self.request


def test_a_stream_that_fell_behind_sends_what_waits_in_one_write():
    async def run() -> list[bytes]:
        engine = _Engine()
        chunks = CompletionChunks("cmpl-1", 1, "m", include_usage=True)
        body = stream(engine, [1, 2], SamplingParams(max_tokens=3, temperature=0), chunks).body_iterator
        for i, text in enumerate(["a", "", "b"]):  # "" : a token that released no text yet
            engine.sink(TokenEvent(text, i))
        engine.sink(DoneEvent("length", "ab", 2, 3, [0, 1, 2]))
        await asyncio.sleep(0.05)  # the inbox's wake-up runs: all four events are waiting
        writes = [w async for w in body]
        assert engine.request.cancelled  # the row is released once the stream ends
        return writes

    writes = asyncio.run(asyncio.wait_for(run(), 30))
    assert len(writes) == 1
    events = [e for e in writes[0].split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    parsed = [json.loads(e[6:]) for e in events[:-1]]
    assert [p["choices"][0]["text"] for p in parsed if p["choices"]] == ["a", "b", ""]
    assert parsed[-2]["choices"][0]["finish_reason"] == "length"
    assert parsed[-1]["usage"]["completion_tokens"] == 3
