"""The generation engine: one thread owns the model; requests queue up and are generated in batches.

Why one thread: a model's forward is not safe to call from several threads at once, and one
owner makes batching natural. Callers never touch the model; they get their tokens through the
`sink` they passed to `submit`, called on the engine thread, so it must be quick (put on a queue,
`loop.call_soon_threadsafe`).

Why scheduling per step (continuous batching, `step`): a request that arrives while a batch runs
is taken at the next step, not after the batch's longest answer. Each step prefills what waits,
within a token budget (`step_tokens`, less the rows decoding; a prompt longer than that is read in
chunks over several steps so it never stalls the others' decode for its whole length), and the
prefilled rows join the running batch (`Batch.join`), which then decodes one token per row; a
finished row leaves at once; `max_batch` bounds the rows. Requests waiting together when the
engine is idle (after a short window for a burst) are prefilled as one padded batch. A prompt that
begins like a recent one starts from that one's KV (the prefix cache, prefix.py); one that would
start from the KV of a request in the group being formed (a request's `n` choices, a shared system
prompt) waits for the next group (`_kept_soon`), so the prompt is computed once, not once per row.
A model that cannot join rows (a sliding-window cache, in one process or on stages) is batched
statically: a batch takes what waits and runs until its last row ends.

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
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from smolforge.errors import SmolforgeError
from smolforge.serve.batch import Batch, BatchModel, Request, wants_echo
from smolforge.serve.events import (  # noqa: F401  (PromptTooLong, EngineStopped: their old home)
    ContextLimits,
    DoneEvent,
    EngineStopped,
    ErrorEvent,
    Event,
    PromptTooLong,
    TokenEvent,
)
from smolforge.serve.prefix import PrefixCache, common_prefix
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
                 max_positions: int | None = None, clock: Callable[[], float] = time.monotonic,
                 step_tokens: int = 256, prefix_cache_bytes: int = 256 << 20, prefix_min_tokens: int = 16,
                 continuous: bool = True):
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
        # per-step scheduling (`step`): what waits, the one-row batch still reading its prompt, the running batch
        self.step_tokens = max(1, step_tokens)
        # rows join a running batch (else: static batches; `continuous=False` asks for them: the benchmark's baseline)
        self.joins = continuous and bool(getattr(model, "joins", False))
        keeps = self.joins and hasattr(model, "snapshot")  # a sliding window's cache is not the whole prompt's KV
        # what the cache lets go, the model frees (a chain of stages holds its snapshots on the stages)
        self.prefix = PrefixCache(prefix_cache_bytes if keeps else 0, prefix_min_tokens, getattr(model, "forget", None))
        self._waiting: deque[Request] = deque()
        self._prefilling: Batch | None = None
        self._running: Batch | None = None
        self.prefill_tokens = 0  # prompt tokens computed (padding included); a prefix cache hit's are not
        self.steps = 0

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
            if not self.busy:  # idle: wait for a request, then a short window for those arriving with it
                first = self._queue.get()
                if first is None:
                    break
                arrived = [first]
                self._gather(arrived)
                self._take(arrived)
            self._pull()
            self.step()

    @property
    def busy(self) -> bool:
        """True while requests wait, prefill or decode on the engine thread."""
        return bool(self._waiting or self._prefilling is not None or (self._running and self._running.active))

    def _take(self, requests: list[Request]) -> None:
        self._waiting.extend(requests)
        self._taken.extend(requests)

    def _pull(self) -> None:
        """Whatever arrived since the last step waits for its prefill (taken without blocking)."""
        arrived = []
        while True:
            try:
                r = self._queue.get_nowait()
            except queue.Empty:
                break
            if r is None:
                self._stopping.set()
                break
            arrived.append(r)
        self._take(arrived)

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
        self._reset()
        for r in taken:
            _end(r, ErrorEvent(f"internal error in the generation engine: {type(err).__name__}: {err}", 500))

    def _reset(self) -> None:
        """Forget what was waiting, prefilling and running (their requests are answered by the caller)."""
        for batch in (self._prefilling, self._running):
            if batch is not None:
                _close(batch)
        self._waiting.clear()
        self._prefilling = self._running = None

    def run_batch(self, requests: list[Request]) -> None:
        """Generate for these requests (on the calling thread) until each has finished; every one gets a
        DoneEvent or ErrorEvent. Those that fit `step_tokens` (and `max_batch`) are prefilled together."""
        self._take(list(requests))
        while self.busy:
            self.step()

    def step(self) -> None:
        """One scheduling step: prefill what waits within the step's token budget (rows then join the
        running batch, a long prompt takes the budget's worth of its tokens), then one decode step."""
        self.steps += 1
        self._taken = [r for r in self._taken if r.finish_reason is None]
        decoding = len(self._running.active) if self._running is not None else 0
        budget = max(self.step_tokens - decoding, self.step_tokens // 4)
        while budget > 0:
            group = self._prefilling or self._next_group(budget)
            if group is None:
                break
            self._prefilling = None
            tokens = self._guarded(group, budget if self.joins else None)
            budget -= group.cost
            self.prefill_tokens += group.cost
            if tokens is None and group.active and group.prefilling:
                self._prefilling = group  # its next chunk at the next step
                break
            if tokens is not None:
                self._settle(group, tokens)
        if self._running is not None and self._running.active:
            tokens = self._guarded(self._running, None)
            if tokens is not None:
                self._advance_rows(self._running, tokens)

    def _guarded(self, batch: Batch, budget: int | None) -> list[int | None] | None:
        """`batch.step(budget)`; a failed forward fails that batch's requests (not the server): None."""
        try:
            return batch.step(budget)
        except Exception as err:  # noqa: BLE001 - a failed forward ends this batch, not the server
            log.exception("generation failed")
            for r in batch.active:
                _end(r, ErrorEvent(f"generation failed: {type(err).__name__}: {err}"))
            batch.active = []
            _close(batch)
            return None

    def _advance_rows(self, batch: Batch, tokens: list[int | None]) -> None:
        """Each row's new token to its request; the finished rows leave the batch."""
        rows = [i for i, (r, tok) in enumerate(zip(batch.active, tokens))
                if not self._advance_row(r, tok, batch.row_errors.get(i))]
        batch.keep(rows)

    def _next_group(self, budget: int) -> Batch | None:
        """The next requests to prefill, as a batch of their own: one whose prompt shares a kept prefix
        (resumed from it) or is longer than `budget` (chunked) goes alone; else those waiting in order
        while their padded prompts fit `budget`. Static (a model that cannot join): all that wait, once
        the running batch is over. None when nothing waits or no row is free."""
        running = len(self._running.active) if self._running is not None else 0
        if not self.joins and running:
            return None
        while self._waiting and self._dropped(self._waiting[0]):
            self._waiting.popleft()
        free = self.max_batch - running
        if not self._waiting or free <= 0:
            return None
        first = self._waiting.popleft()
        hit = self.prefix.lookup(first.prompt_ids) if self.prefix.enabled and not wants_echo(first) else None
        group, width = [first], len(first.prompt_ids)
        fits = not self.joins or width <= budget  # a prompt over the budget is chunked: alone
        while hit is None and fits and self._waiting and len(group) < free:
            nxt = self._waiting[0]
            wider = max(width, len(nxt.prompt_ids))
            if self.joins and (wider * (len(group) + 1) > budget or self.prefix.peek(nxt.prompt_ids)
                               or self._kept_soon(group, nxt)):
                break
            group.append(self._waiting.popleft())
            width = wider
        if not running:
            self.batches += 1
        self.largest_batch = max(self.largest_batch, running + len(group))
        batch = Batch(self.model, group)
        for r, err in batch.failed:  # its own settings: it fails alone, the others go on
            _end(r, ErrorEvent(f"cannot sample this request: {type(err).__name__}: {err}", 400))
        if hit is not None and batch.active:
            try:
                batch.resume(self.model.restore(hit.snapshot, hit.length), hit.length)
                first.cached_tokens = hit.length
            except SmolforgeError as err:  # its holder went away (a stage re-placed): computed whole, forgotten
                log.warning("a kept prefix could not be restored, the prompt is computed whole: %s", err.what)
                self.prefix.failed(hit)
            except Exception:  # noqa: BLE001 - the prompt is then computed whole, and the prefix forgotten
                log.exception("restoring a kept prefix failed")
                self.prefix.failed(hit)
        return batch if batch.active else self._next_group(budget)

    def _kept_soon(self, group: list[Request], nxt: Request) -> bool:
        """True when `nxt` would start from the KV a request of `group` is about to leave in the prefix
        cache (a request's `n` choices, a shared system prompt): `nxt` then waits for the next group,
        which resumes from it, so a prompt the rows share is computed once, not once per row."""
        return self.prefix.enabled and not wants_echo(nxt) and any(
            self.prefix.wants(r.prompt_ids) and common_prefix(nxt.prompt_ids, r.prompt_ids) >= self.prefix.min_tokens
            for r in group)

    def _settle(self, group: Batch, tokens: list[int | None]) -> None:
        """A prefilled group: its prompts' KV kept (prefix cache), its first tokens told, its finished
        rows gone, the rest joined to the running batch (or it is the running batch)."""
        for i, r in enumerate(group.active):
            if self.prefix.wants(r.prompt_ids):
                try:
                    self.prefix.store(r.prompt_ids, *self.model.snapshot(group.cache, i, len(r.prompt_ids)))
                except Exception:  # noqa: BLE001 - a prompt not kept is only a later miss
                    log.exception("keeping a prompt's KV for the prefix cache failed")
        self._advance_rows(group, tokens)
        if not group.active:
            return
        if self._running is None or not self._running.active:
            if self._running is not None:
                _close(self._running)
            self._running = group
        else:
            self._running.join(group)

    def stage_infos(self) -> list[dict[str, Any] | None]:
        """The model's stages' counters for `/metrics` (`BatchModel.stage_infos`; [] without stages). Blocks
        while remote stages answer (each within its scrape bound): call it off an event loop."""
        return self.model.stage_infos()

    def counters(self) -> dict[str, Any]:
        """What /health and /metrics report of the scheduler: batches, steps, prefill and prefix cache."""
        return {"batches": self.batches, "largest_batch": self.largest_batch, "steps": self.steps,
                "prefill_tokens": self.prefill_tokens, **self.prefix.stats()}

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
        _emit(r, _token_event(r, text, token, release=bool(text)))  # every token is told, its text or none
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
                                 logprobs=list(r.logprobs) if asked else None, prompt_logprobs=r.prompt_logprobs,
                                 cached_tokens=r.cached_tokens))

    def _dropped(self, r: Request) -> bool:
        if r.cancelled.is_set():
            _end(r, DoneEvent("cancelled", "", len(r.prompt_ids), 0, []))
            return True
        return False

    def _fail_waiting(self, message: str) -> None:
        for r in self._taken:
            _end(r, ErrorEvent(message, 503))
        self._taken = []
        self._reset()
        while True:
            try:
                r = self._queue.get_nowait()
            except queue.Empty:
                return
            if r is not None:
                _end(r, ErrorEvent(message, 503))


def _close(batch: Batch) -> None:
    try:
        batch.close()
    except Exception:  # freeing a failed stage's cache must not stop the server
        log.exception("releasing the batch's cache failed")


def _end(r: Request, event: DoneEvent | ErrorEvent) -> bool:
    """The request's one final event (a second one is dropped: it was answered already). True."""
    if r.finish_reason is None:
        r.finish_reason = event.finish_reason if isinstance(event, DoneEvent) else "error"
        _emit(r, event)
    return True


def _token_event(r: Request, text: str, token: int, release: bool = True) -> TokenEvent:
    """A generated token's event: its new text (maybe none), the prompt's log-probabilities with the
    request's first event (echo), and, when `release`, the log-probabilities not sent yet. A token whose
    text is held back (half a character, a stop string's start) or is none (a special token) is told
    too, as llama-server streams a chunk for every token (`process_token`), so a client's first token
    is not late by the tokens before the first text; its log-probabilities go with the text that
    releases it (an empty list until then)."""
    prompt = None if r.token_events else r.prompt_logprobs
    r.token_events += 1
    logprobs = r.unsent_logprobs() if release else (None if r.params.logprobs is None else [])
    return TokenEvent(text, token, logprobs, prompt)


def _emit(r: Request, event: Event) -> None:
    try:
        r.sink(event)
    except Exception:  # a broken sink (a client gone) must not stop the batch
        log.exception("event sink of request %s failed", r.id)
        r.cancel()
