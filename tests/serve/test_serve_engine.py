"""The generation engine in-process: greedy tokens equal plain HF `generate`, alone, batched with
prompts of other lengths, and with a LoRA adapter; stop strings, seeds and cancellation; batching
decided by the queue (the engine held, or a fake clock), never by a sleep; and failures that stay
with their request, their batch, or restart the loop."""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

import pytest
import torch

from smolforge.serve.batch import DoneEvent, ErrorEvent, Request, TokenEvent
from smolforge.serve.engine import Engine, PromptTooLong
from smolforge.serve.model import ServedModel
from smolforge.serve.sampling import SamplingParams, next_token

GREEDY = SamplingParams(max_tokens=24, temperature=0)


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    return ServedModel.load(str(tiny_llama_dir), name="tiny", device="cpu")


def prompts(tok) -> list[list[int]]:
    texts = ["What is 2 + 3?", "Reverse abc", "the of and to in is you that it he was for on are as with his",
             "sum", "Uppercase word: WORD. count vowels first last character string code python def return"]
    return [tok(t)["input_ids"] for t in texts]


def hf_greedy(net, ids: list[int], max_new_tokens: int, pad_id: int) -> list[int]:
    with torch.no_grad():
        out = net.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id)
    return out[0, len(ids):].tolist()


def run_together(model, prompt_ids: list[list[int]], params: SamplingParams) -> list[DoneEvent]:
    """One static batch of all prompts, on this thread: batching is certain, not a matter of timing."""
    done: dict[int, DoneEvent] = {}
    requests = [Request(ids, params, (lambda i: lambda e: done.__setitem__(i, e) if isinstance(e, DoneEvent) else None)(i))
                for i, ids in enumerate(prompt_ids)]
    Engine(model).run_batch(requests)
    return [done[i] for i in range(len(prompt_ids))]


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-gpt2", "tiny-qwen2"])
def family(request, served):
    """The three families the server supports (RoPE and learned positions, tied heads)."""
    if request.param == "tiny-llama":
        return served
    from smolforge.models.tiny import preset_dir

    return ServedModel.load(str(preset_dir(request.param)), name=request.param, device="cpu")


def test_greedy_alone_and_batched_equals_hf_generate(family):
    served = family
    ps = prompts(served.tokenizer)
    assert len({len(p) for p in ps}) == len(ps)  # all lengths differ: left padding is exercised
    expected = [hf_greedy(served.model, p, GREEDY.max_tokens, served.pad_id) for p in ps]
    alone = [run_together(served, [p], GREEDY)[0] for p in ps]
    batched = run_together(served, ps, GREEDY)
    for i, p in enumerate(ps):
        assert alone[i].token_ids == expected[i], f"prompt {i} alone"
        assert batched[i].token_ids == expected[i], f"prompt {i} in a batch of {len(ps)}"
        assert batched[i].text == served.tokenizer.decode(expected[i], skip_special_tokens=True)


def test_rows_that_finish_early_leave_the_batch(served):
    """Different max_tokens: short requests leave, the rest go on with the cache cut down to them.
    The longest prompts leave first, so the left padding the others no longer need is cut too."""
    ps = sorted(prompts(served.tokenizer), key=len, reverse=True)
    done: dict[int, DoneEvent] = {}
    reqs = [Request(p, SamplingParams(max_tokens=3 + 5 * i, temperature=0),
                    (lambda i: lambda e: done.__setitem__(i, e) if isinstance(e, DoneEvent) else None)(i))
            for i, p in enumerate(ps)]
    Engine(served).run_batch(reqs)
    for i, p in enumerate(ps):
        assert done[i].token_ids == hf_greedy(served.model, p, 3 + 5 * i, served.pad_id), i
        ended = bool(set(done[i].token_ids) & served.eos_ids)  # the model said EOS first
        assert done[i].finish_reason == ("stop" if ended else "length")
        assert done[i].completion_tokens == len(done[i].token_ids)


def test_greedy_with_a_lora_adapter_equals_hf_generate(tiny_llama_dir, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    from smolforge.models.loading import load_model

    torch.manual_seed(0)
    base = load_model(str(tiny_llama_dir))
    # init_lora_weights=False: B is random, not zero, so the adapter changes the output
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                                 init_lora_weights=False))
    adapter = tmp_path / "lora_adapter"
    peft_model.save_pretrained(adapter)

    plain = ServedModel.load(str(tiny_llama_dir), device="cpu")
    reference = PeftModel.from_pretrained(load_model(str(tiny_llama_dir)), str(adapter)).eval()
    ps = prompts(plain.tokenizer)
    expected = [hf_greedy(reference, p, GREEDY.max_tokens, plain.pad_id) for p in ps]
    assert expected != [hf_greedy(plain.model, p, GREEDY.max_tokens, plain.pad_id) for p in ps]  # it matters
    for merge in (True, False):
        with_adapter = ServedModel.load(str(tiny_llama_dir), str(adapter), device="cpu", merge=merge)
        got = run_together(with_adapter, ps, GREEDY)
        assert [d.token_ids for d in got] == expected, f"merge={merge}"


class Held:
    """The engine thread kept inside a one-token request's last event until `release()`: whatever is
    submitted meanwhile waits in the queue, so the next batch is what the queue holds, not what a
    clock let in."""

    def __init__(self, engine: Engine, prompt: list[int]):
        self.entered, self.go = threading.Event(), threading.Event()
        engine.submit(prompt, SamplingParams(max_tokens=1, temperature=0), self._sink)
        assert self.entered.wait(60), "the engine never started the holding request"

    def _sink(self, event) -> None:
        if isinstance(event, DoneEvent):
            self.entered.set()
            assert self.go.wait(60), "the test never released the engine"

    def release(self) -> None:
        self.go.set()


def test_threaded_engine_batches_requests_that_arrive_together(served):
    ps = prompts(served.tokenizer)
    engine = Engine(served, max_batch=8).start()
    try:
        held = Held(engine, ps[0])
        events: list[queue.Queue] = []
        for p in ps:
            q: queue.Queue = queue.Queue()
            engine.submit(p, GREEDY, q.put)
            events.append(q)
        held.release()
        for p, q in zip(ps, events):
            streamed = ""
            while True:
                e = q.get(timeout=60)
                if isinstance(e, TokenEvent):
                    streamed += e.text
                else:
                    break
            assert isinstance(e, DoneEvent) and streamed == e.text
            assert e.token_ids == hf_greedy(served.model, p, GREEDY.max_tokens, served.pad_id)
        assert (engine.batches, engine.largest_batch) == (2, len(ps))  # the holding one, then all together
    finally:
        engine.stop()


class ScriptedQueue:
    """A request queue on a fake clock: item i arrives at its time; `get(timeout)` moves the clock to
    the arrival, or by the whole timeout when nothing arrives within it."""

    def __init__(self, clock: list[float], arrivals: list[tuple[float, str]]):
        self.clock, self.arrivals = clock, list(arrivals)

    def get(self, timeout: float):
        if self.arrivals and self.arrivals[0][0] <= self.clock[0] + timeout:
            at, item = self.arrivals.pop(0)
            self.clock[0] = max(self.clock[0], at)
            return item
        self.clock[0] += timeout
        raise queue.Empty


def _gathered(gap_s: float, **engine_kw) -> int:
    """How many of 5 requests arriving `gap_s` apart (on a fake clock) the engine takes into one batch."""
    clock = [0.0]
    engine = Engine(SimpleNamespace(max_positions=512), max_batch=8, clock=lambda: clock[0], **engine_kw)
    engine._queue = ScriptedQueue(clock, [(i * gap_s, f"r{i}") for i in range(1, 5)])
    taken = ["r0"]
    engine._gather(taken)
    return len(taken)


def test_a_burst_longer_than_the_window_is_one_batch_and_the_wait_is_bounded():
    """Clients of one burst do not arrive within one window: each arrival extends the wait (else the
    rest would wait a whole generation behind the first), never past max_wait_s after the first."""
    assert _gathered(0.03, window_s=0.05, max_wait_s=5.0) == 5  # 0.12 s of burst, each gap within the window
    assert _gathered(0.03, window_s=0.05, max_wait_s=0.05) == 2  # capped at 0.05 s: cut after the second
    assert _gathered(0.06, window_s=0.05, max_wait_s=5.0) == 1  # a gap over the window ends the batch


def test_a_request_that_cannot_be_sampled_fails_alone(served):
    """A seed no random generator takes (2**64, as the issue's request sent) fails its own request with
    a 400-kind error; the requests batched with it get their tokens, and a running engine goes on."""
    ps = prompts(served.tokenizer)[:3]
    bad = SamplingParams(max_tokens=8, temperature=0.9, seed=2**64)
    got: dict[int, object] = {}
    reqs = [Request(p, bad if i == 1 else GREEDY, (lambda i: lambda e: got.__setitem__(i, e)
                                                     if not isinstance(e, TokenEvent) else None)(i))
            for i, p in enumerate(ps)]
    Engine(served).run_batch(reqs)
    assert isinstance(got[1], ErrorEvent) and got[1].status == 400 and "cannot sample" in got[1].message, got[1]
    for i in (0, 2):
        assert got[i].token_ids == hf_greedy(served.model, ps[i], GREEDY.max_tokens, served.pad_id)

    engine = Engine(served).start()
    try:
        with pytest.raises(RuntimeError, match="cannot sample"):
            engine.generate(ps[0], bad, timeout=60)
        assert engine.generate(ps[0], GREEDY, timeout=60).token_ids == got[0].token_ids
        assert engine.alive and engine.restarts == 0
    finally:
        engine.stop()


def test_a_row_that_cannot_be_sampled_fails_alone(served):
    """NaN probabilities (a temperature of NaN gets past no schema, but the engine is also a library)
    fail that row at its first step; the other row of the batch finishes."""
    ps = prompts(served.tokenizer)[:2]
    got: dict[int, object] = {}
    nan = SamplingParams(max_tokens=8, temperature=float("nan"), seed=1)
    reqs = [Request(p, nan if i == 0 else GREEDY, (lambda i: lambda e: got.__setitem__(i, e)
                                                    if not isinstance(e, TokenEvent) else None)(i))
            for i, p in enumerate(ps)]
    Engine(served).run_batch(reqs)
    assert isinstance(got[0], ErrorEvent) and got[0].status == 500 and "generation failed for this request" in got[0].message
    assert got[1].token_ids == hf_greedy(served.model, ps[1], GREEDY.max_tokens, served.pad_id)


def test_an_error_that_escapes_a_batch_restarts_the_loop(served, monkeypatch):
    """A bug outside the per-batch catch costs the requests it held (an error each, never silence); the
    loop starts again and the next request is answered."""
    ids = prompts(served.tokenizer)[0]
    engine = Engine(served).start()
    real = engine.step
    calls = []

    def broken_once():
        calls.append(len(engine._waiting))
        if len(calls) == 1:
            raise KeyError("a bug")
        real()

    monkeypatch.setattr(engine, "step", broken_once)
    try:
        with pytest.raises(RuntimeError, match="internal error in the generation engine: KeyError"):
            engine.generate(ids, GREEDY, timeout=60)
        assert engine.restarts == 1 and engine.alive
        assert engine.generate(ids, GREEDY, timeout=60).token_ids == hf_greedy(served.model, ids, GREEDY.max_tokens,
                                                                                served.pad_id)
    finally:
        engine.stop()


def test_an_engine_thread_that_ends_says_why(served, monkeypatch):
    """Should even the recovery fail, the thread ends: the request it held fails (503), `failure` and
    `on_death` say why, `alive` is False and `submit` refuses; the server then exits (server.py)."""
    from types import SimpleNamespace as NS

    from smolforge.serve.engine import EngineStopped
    from smolforge.serve.server import stop_when_engine_dies

    ids = prompts(served.tokenizer)[0]
    engine = Engine(served)
    uvicorn_server = NS(should_exit=False)
    stop_when_engine_dies(engine, uvicorn_server)

    def boom(*_):
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "step", boom)
    monkeypatch.setattr(engine, "_recover", boom)
    engine.start()
    events: queue.Queue = queue.Queue()
    engine.submit(ids, GREEDY, events.put)
    event = events.get(timeout=60)
    assert isinstance(event, ErrorEvent) and event.status == 503 and "boom" in event.message
    engine._thread.join(60)
    assert not engine.alive and engine.failure == "RuntimeError: boom"
    assert uvicorn_server.should_exit  # the watchdog told uvicorn to stop
    with pytest.raises(EngineStopped, match="not running: RuntimeError: boom"):
        engine.submit(ids, GREEDY, events.put)


def test_stop_strings_cut_the_text_and_the_stream(served):
    p = prompts(served.tokenizer)[2]
    full = run_together(served, [p], SamplingParams(max_tokens=24, temperature=0))[0].text
    stop = full[8:11]
    assert stop and full.find(stop) == 8
    events: list = []
    Engine(served).run_batch([Request(p, SamplingParams(max_tokens=24, temperature=0, stop=["zzzz", stop]), events.append)])
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.finish_reason == "stop" and done.text == full[:8]
    assert "".join(e.text for e in events if isinstance(e, TokenEvent)) == full[:8]


def test_a_seed_gives_the_same_sample_alone_and_batched(served):
    ps = prompts(served.tokenizer)
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=1234)
    alone = run_together(served, [ps[1]], params)[0]
    batched = run_together(served, ps, params)[1]
    other = run_together(served, [ps[1]], SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=99))[0]
    assert alone.token_ids == batched.token_ids
    assert alone.token_ids != other.token_ids


def test_a_tiny_temperature_samples_the_argmax():
    """A temperature of 1e-300 is a valid request (>= 0): it samples the best token; it used to divide
    the logits into inf - inf inside softmax, NaN probabilities, and a 500."""
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    for t in (1e-300, 5e-324, 1e-6):
        p = SamplingParams(temperature=t, seed=3)
        assert next_token(logits, p, p.generator()) == int(logits.argmax()), t


def test_too_long_is_refused_before_it_is_queued(served):
    engine = Engine(served)
    with pytest.raises(PromptTooLong, match="context of 512"):
        engine.check_length(500, 20)
    engine.check_length(500, 12)


def test_a_cancelled_request_leaves_the_batch(served):
    ps = prompts(served.tokenizer)
    events: list = []
    keep: list = []
    gone = Request(ps[0], SamplingParams(max_tokens=50, temperature=0), events.append)
    stay = Request(ps[1], SamplingParams(max_tokens=10, temperature=0), keep.append)

    def cancel_after_two(e):
        events.append(e)
        if sum(isinstance(x, TokenEvent) for x in events) >= 2:
            gone.cancel()

    gone.sink = cancel_after_two
    Engine(served).run_batch([gone, stay])
    assert events[-1].finish_reason == "cancelled" and events[-1].completion_tokens < 10
    assert keep[-1].token_ids == hf_greedy(served.model, ps[1], 10, served.pad_id)


# -- per-step scheduling (continuous batching) and the prefix cache --------------------------------

SYSTEM = ("You are a helpful assistant. Answer briefly and with care, in plain words, and say when you do not "
          "know the answer. Question:")


def final(events: list):
    return next(e for e in events if not isinstance(e, TokenEvent))


def short_during_long(engine: Engine, long_ids: list[int], short_ids: list[int], long_tokens: int = 40,
                      short_tokens: int = 6) -> tuple[list[str], object, object]:
    """A long request runs; once its first token is out (the engine held there until the short one is
    queued) a short one is sent. The order the two final events came in, and both finals."""
    order: list[str] = []
    started, go = threading.Event(), threading.Event()
    finals: dict[str, queue.Queue] = {"long": queue.Queue(), "short": queue.Queue()}

    def sink(name: str):
        def put(e) -> None:
            if name == "long" and isinstance(e, TokenEvent) and not started.is_set():
                started.set()
                assert go.wait(60), "the test never let the long request go on"
            if not isinstance(e, TokenEvent):
                order.append(name)
                finals[name].put(e)
        return put

    engine.submit(long_ids, SamplingParams(max_tokens=long_tokens, temperature=0), sink("long"))
    assert started.wait(60), "the long request never started"
    engine.submit(short_ids, SamplingParams(max_tokens=short_tokens, temperature=0), sink("short"))
    go.set()
    long_done, short_done = finals["long"].get(timeout=120), finals["short"].get(timeout=120)
    return order, long_done, short_done


def test_a_short_request_sent_during_a_long_one_ends_first(served):
    """Continuous batching: the short request joins the running batch at the next step and ends while the
    long one still runs; both get the tokens they get alone (HF `generate`)."""
    ps = prompts(served.tokenizer)
    engine = Engine(served, max_batch=4).start()
    try:
        order, long_done, short_done = short_during_long(engine, ps[2], ps[1])
    finally:
        engine.stop()
    assert long_done.finish_reason == "length" and long_done.completion_tokens == 40  # it ran its whole length
    assert order == ["short", "long"]
    assert engine.batches == 1 and engine.largest_batch == 2  # joined, not a batch of its own after the long one
    assert long_done.token_ids == hf_greedy(served.model, ps[2], 40, served.pad_id)
    assert short_done.token_ids == hf_greedy(served.model, ps[1], 6, served.pad_id)


def test_a_long_prompt_is_prefilled_in_chunks_while_the_others_decode(served):
    """A prompt over the step's token budget is read a budget's worth a step; a running row gets a token
    each of those steps (it is not stalled for the whole prompt); both answers are the ones alone."""
    tok = served.tokenizer
    long_ids, short_ids = tok(SYSTEM + " What is 2 + 3?")["input_ids"], prompts(tok)[3]
    seen: list[int] = []
    short = Request(short_ids, SamplingParams(max_tokens=12, temperature=0), lambda e: None)
    events: list = []

    def long_sink(e) -> None:
        if not seen:
            seen.append(len(short.token_ids))  # the short row's tokens when the long one's first came
        events.append(e)

    engine = Engine(served, step_tokens=16)
    engine.run_batch([short, Request(long_ids, SamplingParams(max_tokens=8, temperature=0), long_sink)])
    assert len(long_ids) > 3 * 15 and seen[0] >= 3, seen  # >= 3 chunks of 15, a decode step each
    assert final(events).token_ids == hf_greedy(served.model, long_ids, 8, served.pad_id)
    assert short.token_ids == hf_greedy(served.model, short_ids, 12, served.pad_id)
    assert engine.prefill_tokens == len(long_ids) + len(short_ids)


def test_a_shared_prefix_is_computed_once(served):
    """A prompt that begins like a kept one prefills only the rest (counted), with the tokens it gets
    without the cache; a prompt shorter than `min_tokens` in common is no hit."""
    tok = served.tokenizer
    first, second = tok(SYSTEM + " What is 2 + 3?")["input_ids"], tok(SYSTEM + " Reverse abc")["input_ids"]
    from smolforge.serve.prefix import common_prefix

    shared = common_prefix(first, second)
    assert shared >= 40 and shared < len(second) - 1
    engine = Engine(served)
    got = []
    for ids in (first, second):
        before = engine.prefill_tokens
        events: list = []
        engine.run_batch([Request(ids, GREEDY, events.append)])
        got.append((engine.prefill_tokens - before, final(events).token_ids, final(events).cached_tokens))
    assert got[0][0] == len(first) and got[1][0] == len(second) - shared  # only the rest was computed
    assert (got[0][2], got[1][2]) == (0, shared)  # each request's own count (`usage...cached_tokens`)
    assert (engine.prefix.hits, engine.prefix.tokens_reused) == (1, shared)
    assert got[1][1] == hf_greedy(served.model, second, GREEDY.max_tokens, served.pad_id)
    engine.run_batch([Request(prompts(tok)[0], GREEDY, lambda e: None)])
    assert engine.prefix.hits == 1  # nothing in common: no hit


def test_the_prefix_cache_is_bounded_and_evicts_the_least_recently_used():
    from smolforge.serve.prefix import PrefixCache

    cache = PrefixCache(max_bytes=250, min_tokens=2)
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    cache.store(a, "A", 100)
    cache.store(b, "B", 100)
    assert cache.lookup([1, 2, 3, 9]).snapshot == "A"  # a used: b is now the least recently used
    cache.store(c, "C", 100)
    assert (list(cache.entries), cache.evictions, cache.bytes) == ([tuple(a), tuple(c)], 1, 200)
    assert cache.lookup([5, 6, 7, 8, 9]) is None
    cache.store([1, 2, 3, 4, 5], "A+", 100)  # a longer prompt replaces the kept prefix of it
    assert list(cache.entries) == [tuple(c), (1, 2, 3, 4, 5)] and not cache.wants(a)
    assert cache.lookup(a).length == 3  # one token of the prompt is always left to compute
    cache.store([7] * 10, "big", 300)  # over the bound alone: not kept, nothing evicted
    assert cache.evictions == 1 and cache.stats()["prefix_entries"] == 2


def test_a_row_that_joined_goes_on_alone_after_the_first_rows_leave(served):
    """The running batch began with a one-token prompt; a longer prompt joins it (after a chunked
    prefill) and outlives it: alone in the batch, it decodes on (its prompt is not read again)."""
    ps = prompts(served.tokenizer)
    first, joined = ps[3], ps[2]
    assert len(first) < 8 < len(joined)
    got: dict[str, object] = {}
    engine = Engine(served, step_tokens=8)
    engine.run_batch([Request(first, SamplingParams(max_tokens=6, temperature=0), lambda e: got.setdefault("a", e)
                              if not isinstance(e, TokenEvent) else None),
                      Request(joined, SamplingParams(max_tokens=16, temperature=0), lambda e: got.setdefault("b", e)
                              if not isinstance(e, TokenEvent) else None)])
    assert (engine.batches, engine.largest_batch) == (1, 2)
    assert engine.prefill_tokens == len(first) + len(joined)
    assert got["a"].token_ids == hf_greedy(served.model, first, 6, served.pad_id)
    assert got["b"].token_ids == hf_greedy(served.model, joined, 16, served.pad_id)


@pytest.mark.parametrize("logprobs", [None, 2])
def test_every_token_is_told_even_one_that_has_no_text(served, logprobs):
    """A token with no text (a special token, skipped) or whose text is held back still gets its TokenEvent at
    once, as llama-server streams a chunk per token: a client's first token is not late by the tokens before
    the first text (issue 44's TTFT, measured on a model whose answers began with such tokens). Their
    log-probabilities wait for the text that releases them: the events' lists add up to the answer's, in order."""
    tok = served.tokenizer
    silent = next(i for i in tok.all_special_ids if i not in served.eos_ids)  # <|pad|>: no text, not the end
    assert tok.decode([silent], skip_special_tokens=True) == ""
    p = prompts(tok)[0]
    events: list = []
    params = SamplingParams(max_tokens=5, temperature=0, logit_bias={silent: 100.0}, logprobs=logprobs)
    Engine(served).run_batch([Request(p, params, events.append)])
    done, told = events[-1], [e for e in events if isinstance(e, TokenEvent)]
    assert isinstance(done, DoneEvent) and done.token_ids == [silent] * 5 and done.text == ""
    assert [e.token_id for e in told[:5]] == [silent] * 5  # one per token, as it was sampled
    assert all(e.text == "" for e in told)
    if logprobs is None:
        assert len(told) == 5 and all(e.logprobs is None for e in told)
    else:  # held until the end: the last event releases all five
        assert [len(e.logprobs) for e in told] == [0, 0, 0, 0, 0, 5]
        assert told[-1].logprobs == done.logprobs and [e.id for e in done.logprobs] == [silent] * 5
