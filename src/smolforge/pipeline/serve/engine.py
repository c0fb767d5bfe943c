"""The generation engine: one thread owns the model; requests queue up and are generated in batches.

Why one thread: a model's forward is not safe to call from several threads at once, and one
owner makes batching natural: whatever is waiting when the loop is free (after a short window
for requests arriving together) becomes the next batch. Callers never touch the model; they get
their tokens through the `sink` they passed to `submit`, called on the engine thread, so it must
be quick (put on a queue, `loop.call_soon_threadsafe`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from smolforge.errors import SmolforgeError
from smolforge.pipeline.serve.batch import Batch, BatchModel, DoneEvent, ErrorEvent, Event, Request, TokenEvent
from smolforge.pipeline.serve.sampling import SamplingParams

log = logging.getLogger(__name__)


class PromptTooLong(SmolforgeError):
    """The prompt and the tokens asked for do not fit the model's context."""


@dataclass
class Result:
    """A finished generation, for callers that wait (tests, benchmarks, non-streamed API calls)."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int


class Engine:
    """Queue, batch and generate. `start()` it once; `stop()` ends the thread (queued requests fail)."""

    def __init__(self, model: BatchModel, *, max_batch: int = 8, window_s: float = 0.005, max_wait_s: float = 0.05,
                 max_positions: int | None = None):
        # A batch waits window_s after its latest arrival (a burst of clients is not cut after its
        # first request: the rest would wait a whole generation), never over max_wait_s after its first.
        self.model, self.max_batch, self.window_s = model, max(1, max_batch), window_s
        self.max_wait_s = max(window_s, max_wait_s)
        self.max_positions = max_positions or int(getattr(model, "max_positions", 0) or 2048)
        self._queue: queue.Queue[Request | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.batches = 0  # how many batches ran, and the largest: the tests check batching happened
        self.largest_batch = 0

    # -- callers ----------------------------------------------------------------------------------

    def check_length(self, prompt_tokens: int, max_tokens: int) -> None:
        """Refuse (PromptTooLong) a request whose prompt plus `max_tokens` exceeds the context."""
        if prompt_tokens < 1:
            raise PromptTooLong("the prompt is empty", fix="send at least one token of prompt")
        if prompt_tokens + max_tokens > self.max_positions:
            raise PromptTooLong(
                f"the prompt has {prompt_tokens} tokens and max_tokens is {max_tokens}: together over the model's "
                f"context of {self.max_positions} tokens",
                fix=f"shorten the prompt or lower max_tokens to at most {max(0, self.max_positions - prompt_tokens)}")

    def room(self, prompt_tokens: int) -> int:
        """The most tokens a prompt of this length leaves room for."""
        return max(0, self.max_positions - prompt_tokens)

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Callable[[Event], None]) -> Request:
        """Queue a request; its events go to `sink` (on the engine thread). Cancel with `.cancel()`."""
        self.check_length(len(prompt_ids), params.max_tokens)
        if self._thread is None or not self._thread.is_alive():
            raise SmolforgeError("the generation engine is not running", fix="start it (Engine.start()) first")
        request = Request(list(prompt_ids), params, sink)
        self._queue.put(request)
        return request

    def generate(self, prompt_ids: list[int], params: SamplingParams, timeout: float | None = None) -> Result:
        """Submit and wait for the whole answer."""
        done: queue.Queue[Event] = queue.Queue()
        self.submit(prompt_ids, params, lambda e: done.put(e) if not isinstance(e, TokenEvent) else None)
        event = done.get(timeout=timeout)
        if isinstance(event, ErrorEvent):
            raise RuntimeError(event.message)
        assert isinstance(event, DoneEvent)
        return Result(event.text, event.token_ids, event.finish_reason, event.prompt_tokens)

    def start(self) -> "Engine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="smolforge-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the engine thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping.is_set():
            first = self._queue.get()
            if first is None:
                break
            requests = [first]
            cap = time.monotonic() + self.max_wait_s
            deadline = min(cap, time.monotonic() + self.window_s)
            while len(requests) < self.max_batch:  # those arriving together go together
                try:
                    nxt = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if nxt is None:
                    self._stopping.set()
                    break
                requests.append(nxt)
                deadline = min(cap, time.monotonic() + self.window_s)
            self.run_batch(requests)
        self._fail_waiting("the server is shutting down")

    def run_batch(self, requests: list[Request]) -> None:
        """Generate for these requests until each has finished; every one gets a DoneEvent or ErrorEvent."""
        requests = [r for r in requests if not self._dropped(r)]
        if not requests:
            return
        self.batches += 1
        self.largest_batch = max(self.largest_batch, len(requests))
        batch = Batch(self.model, requests)
        try:
            while batch.active:
                tokens = batch.step()
                rows = []
                for i, (r, tok) in enumerate(zip(batch.active, tokens)):
                    if not self._advance(r, tok):
                        rows.append(i)
                batch.keep(rows)
        except Exception as err:  # a failed forward ends this batch, not the server
            log.exception("generation failed")
            for r in batch.active:
                _emit(r, ErrorEvent(f"generation failed: {type(err).__name__}: {err}"))
        finally:
            try:
                batch.close()
            except Exception:  # freeing a failed stage's cache must not stop the server
                log.exception("releasing the batch's cache failed")

    def _advance(self, r: Request, token: int) -> bool:
        """Take one token for `r`; True when `r` is finished (and told so)."""
        assert r.stream is not None
        if r.cancelled.is_set():
            return self._finish(r, "cancelled")
        if token in self.model.eos_ids:
            r.token_ids.append(token)
            return self._finish(r, "stop")
        r.token_ids.append(token)
        text = r.stream.push(token)
        if text:
            _emit(r, TokenEvent(text, token))
        if r.stream.stopped:
            return self._finish(r, "stop")
        if len(r.token_ids) >= r.params.max_tokens:
            return self._finish(r, "length")
        return False

    def _finish(self, r: Request, reason: str) -> bool:
        assert r.stream is not None
        tail = r.stream.finish()
        if tail:
            _emit(r, TokenEvent(tail, r.token_ids[-1] if r.token_ids else -1))
        r.finish_reason = reason
        _emit(r, DoneEvent(reason, r.stream.text, len(r.prompt_ids), len(r.token_ids), list(r.token_ids)))
        return True

    def _dropped(self, r: Request) -> bool:
        if r.cancelled.is_set():
            _emit(r, DoneEvent("cancelled", "", len(r.prompt_ids), 0, []))
            return True
        return False

    def _fail_waiting(self, message: str) -> None:
        while True:
            try:
                r = self._queue.get_nowait()
            except queue.Empty:
                return
            if r is not None:
                _emit(r, ErrorEvent(message))


def _emit(r: Request, event: Event) -> None:
    try:
        r.sink(event)
    except Exception:  # a broken sink (a client gone) must not stop the batch
        log.exception("event sink of request %s failed", r.id)
        r.cancel()
