"""The generation engine: one thread owns the model; requests queue up and are generated in batches.

Why one thread: a model's forward is not safe to call from several threads at once, and one
owner makes batching natural: whatever is waiting when the loop is free (after a short window
for requests arriving together) becomes the next batch. Callers never touch the model; they get
their tokens through the `sink` they passed to `submit`, called on the engine thread, so it must
be quick (put on a queue, `loop.call_soon_threadsafe`).

Why failures are caught at three levels: a request whose settings cannot be used or whose row
cannot be sampled fails alone (400 or 500 with the reason); a failed forward fails its batch; and
anything else that escapes (a bug) fails the requests taken off the queue and restarts the loop
(`restarts`). Every request taken gets exactly one final event. Should the thread still end on its
own, `failure` says why, `on_death` is called (the server exits non-zero) and `/health` says 503.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from smolforge.serve.batch import Batch, BatchModel, Request
from smolforge.serve.events import (  # noqa: F401  (PromptTooLong, EngineStopped: their old home)
    ContextLimits,
    DoneEvent,
    EngineStopped,
    ErrorEvent,
    Event,
    PromptTooLong,
    TokenEvent,
)
from smolforge.serve.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class Result:
    """A finished generation, for callers that wait (tests, benchmarks, non-streamed API calls)."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int


class Engine(ContextLimits):
    """Queue, batch and generate. `start()` it once; `stop()` ends the thread (queued requests fail)."""

    def __init__(self, model: BatchModel, *, max_batch: int = 8, window_s: float = 0.005, max_wait_s: float = 0.05,
                 max_positions: int | None = None, clock: Callable[[], float] = time.monotonic):
        # A batch waits window_s after its latest arrival (a burst of clients is not cut after its
        # first request: the rest would wait a whole generation), never over max_wait_s after its first.
        self.model, self.max_batch, self.window_s = model, max(1, max_batch), window_s
        self.max_wait_s = max(window_s, max_wait_s)
        self.max_positions = max_positions or int(getattr(model, "max_positions", 0) or 2048)
        self.clock = clock
        self._queue: queue.Queue[Request | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._taken: list[Request] = []  # off the queue and not yet answered: failed if the loop breaks
        self.batches = 0  # how many batches ran, and the largest: the tests check batching happened
        self.largest_batch = 0
        self.restarts = 0  # times the loop was restarted after an error that escaped a batch
        self.failure: str | None = None  # why the thread ended on its own (None while it runs, or stopped)
        self.on_death: Callable[[str], None] | None = None

    # -- callers ----------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """True while the thread runs and is not being stopped."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Callable[[Event], None]) -> Request:
        """Queue a request; its events go to `sink` (on the engine thread). Cancel with `.cancel()`."""
        self.check_length(len(prompt_ids), params.max_tokens)
        if not self.alive:
            raise EngineStopped(f"the generation engine is not running{': ' + self.failure if self.failure else ''}",
                                fix="restart the server (`smolforge serve`); its log says what stopped the engine")
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
            self._thread = threading.Thread(target=self._main, name="smolforge-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the engine thread ------------------------------------------------------------------------

    def _main(self) -> None:
        """The thread: the loop, restarted after any error that escapes it; the waiting fail at the end."""
        try:
            while not self._stopping.is_set():
                try:
                    self._loop()
                except Exception as err:  # noqa: BLE001 - a bug must cost its requests, not the server
                    self._recover(err)
        except BaseException as err:  # even recovering failed: the thread ends, and says why
            self.failure = f"{type(err).__name__}: {err}"
            log.exception("the generation engine stopped")
        finally:
            self._fail_waiting("the generation engine stopped" + (f": {self.failure}" if self.failure else
                                                                   ": the server is shutting down"))
            if self.failure and self.on_death is not None:
                self.on_death(self.failure)

    def _loop(self) -> None:
        while not self._stopping.is_set():
            first = self._queue.get()
            if first is None:
                break
            self._taken = [first]
            self._gather(self._taken)
            self.run_batch(self._taken)
            self._taken = []

    def _gather(self, requests: list[Request]) -> None:
        """Add to `requests` those arriving together: each arrival extends the wait by `window_s`,
        never past `max_wait_s` after the first (measured on `clock`)."""
        cap = self.clock() + self.max_wait_s
        deadline = min(cap, self.clock() + self.window_s)
        while len(requests) < self.max_batch:
            try:
                nxt = self._queue.get(timeout=max(0.0, deadline - self.clock()))
            except queue.Empty:
                return
            if nxt is None:
                self._stopping.set()
                return
            requests.append(nxt)
            deadline = min(cap, self.clock() + self.window_s)

    def _recover(self, err: Exception) -> None:
        """An error escaped the loop: the requests it held fail with the reason, the loop starts again."""
        self.restarts += 1
        log.exception("the generation loop failed; restarting it (restart %d)", self.restarts)
        taken, self._taken = self._taken, []
        for r in taken:
            _end(r, ErrorEvent(f"internal error in the generation engine: {type(err).__name__}: {err}", 500))

    def run_batch(self, requests: list[Request]) -> None:
        """Generate for these requests until each has finished; every one gets a DoneEvent or ErrorEvent."""
        requests = [r for r in requests if not self._dropped(r)]
        if not requests:
            return
        self.batches += 1
        self.largest_batch = max(self.largest_batch, len(requests))
        batch = Batch(self.model, requests)
        for r, err in batch.failed:  # its own settings: it fails alone, the others go on
            _end(r, ErrorEvent(f"cannot sample this request: {type(err).__name__}: {err}", 400))
        try:
            while batch.active:
                tokens = batch.step()
                rows = [i for i, (r, tok) in enumerate(zip(batch.active, tokens))
                        if not self._advance_row(r, tok, batch.row_errors.get(i))]
                batch.keep(rows)
        except Exception as err:  # a failed forward ends this batch, not the server
            log.exception("generation failed")
            for r in batch.active:
                _end(r, ErrorEvent(f"generation failed: {type(err).__name__}: {err}"))
        finally:
            try:
                batch.close()
            except Exception:  # freeing a failed stage's cache must not stop the server
                log.exception("releasing the batch's cache failed")

    def _advance_row(self, r: Request, token: int | None, error: Exception | None) -> bool:
        """`_advance`, but a row that failed (sampling, decoding) fails its own request only."""
        try:
            if error is not None:
                raise error
            assert token is not None
            return self._advance(r, token)
        except Exception as err:  # noqa: BLE001 - this request ends; the batch goes on
            log.exception("request %s failed", r.id)
            return _end(r, ErrorEvent(f"generation failed for this request: {type(err).__name__}: {err}"))

    def _advance(self, r: Request, token: int) -> bool:
        """Take one token for `r`; True when `r` is finished (and told so)."""
        assert r.stream is not None
        if r.cancelled.is_set():
            return self._finish(r, "cancelled")
        if r.params.max_tokens <= 0:  # the prompt's log-probabilities only (echo): nothing generated
            return self._finish(r, "length")
        if token in self.model.eos_ids:
            r.token_ids.append(token)
            if r.params.logprobs is not None and r.logprobs:  # the end is no text: no entry of its own
                r.logprobs.pop()
            return self._finish(r, "stop")
        r.token_ids.append(token)
        text = r.stream.push(token)
        if text:
            _emit(r, _token_event(r, text, token))
        if r.stream.stopped:
            return self._finish(r, "stop")
        if len(r.token_ids) >= r.params.max_tokens:
            return self._finish(r, "length")
        return False

    def _finish(self, r: Request, reason: str) -> bool:
        assert r.stream is not None
        tail = r.stream.finish()
        if tail or r.logprobs_sent < len(r.logprobs):  # the held-back text, or the last tokens' logprobs
            _emit(r, _token_event(r, tail, r.token_ids[-1] if r.token_ids else -1))
        asked = r.params.logprobs is not None
        return _end(r, DoneEvent(reason, r.stream.text, len(r.prompt_ids), len(r.token_ids), list(r.token_ids),
                                 logprobs=list(r.logprobs) if asked else None, prompt_logprobs=r.prompt_logprobs))

    def _dropped(self, r: Request) -> bool:
        if r.cancelled.is_set():
            _end(r, DoneEvent("cancelled", "", len(r.prompt_ids), 0, []))
            return True
        return False

    def _fail_waiting(self, message: str) -> None:
        for r in self._taken:
            _end(r, ErrorEvent(message, 503))
        self._taken = []
        while True:
            try:
                r = self._queue.get_nowait()
            except queue.Empty:
                return
            if r is not None:
                _end(r, ErrorEvent(message, 503))


def _end(r: Request, event: DoneEvent | ErrorEvent) -> bool:
    """The request's one final event (a second one is dropped: it was answered already). True."""
    if r.finish_reason is None:
        r.finish_reason = event.finish_reason if isinstance(event, DoneEvent) else "error"
        _emit(r, event)
    return True


def _token_event(r: Request, text: str, token: int) -> TokenEvent:
    """New text, with the log-probabilities not sent yet (and the prompt's with the first: echo)."""
    prompt = r.prompt_logprobs if r.logprobs_sent == 0 else None
    return TokenEvent(text, token, r.unsent_logprobs(), prompt)


def _emit(r: Request, event: Event) -> None:
    try:
        r.sink(event)
    except Exception:  # a broken sink (a client gone) must not stop the batch
        log.exception("event sink of request %s failed", r.id)
        r.cancel()
