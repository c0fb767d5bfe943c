"""The generation engine in-process: greedy tokens equal plain HF `generate`, alone, batched with
prompts of other lengths, and with a LoRA adapter; stop strings, seeds and cancellation."""

from __future__ import annotations

import queue

import pytest
import torch

from smolforge.pipeline.serve.batch import DoneEvent, Request, TokenEvent
from smolforge.pipeline.serve.engine import Engine, PromptTooLong
from smolforge.pipeline.serve.model import ServedModel
from smolforge.pipeline.serve.sampling import SamplingParams

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


def test_threaded_engine_batches_requests_that_arrive_together(served):
    ps = prompts(served.tokenizer)
    engine = Engine(served, max_batch=8, window_s=0.5).start()
    try:
        events: list[queue.Queue] = []
        for p in ps:
            q: queue.Queue = queue.Queue()
            engine.submit(p, GREEDY, q.put)
            events.append(q)
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
        assert engine.largest_batch == len(ps) and engine.batches == 1
    finally:
        engine.stop()


def _burst_batches(served, ps, gap_s: float, **engine_kw) -> int:
    """How many batches an engine makes of requests submitted `gap_s` apart."""
    import time

    engine = Engine(served, max_batch=8, **engine_kw).start()
    try:
        qs = []
        for p in ps:
            qs.append(queue.Queue())
            engine.submit(p, GREEDY, qs[-1].put)
            time.sleep(gap_s)
        for q in qs:
            while isinstance(q.get(timeout=60), TokenEvent):
                pass
        assert engine.largest_batch <= len(ps)
        return engine.batches
    finally:
        engine.stop()


def test_a_burst_longer_than_the_window_is_one_batch_and_the_wait_is_bounded(served):
    """Clients of one burst do not arrive within one window: each arrival extends the wait (else the
    rest would wait a whole generation behind the first), never past max_wait_s after the first."""
    ps = prompts(served.tokenizer)  # 0.03 s apart: the burst lasts longer than one window
    assert _burst_batches(served, ps, 0.03, window_s=0.05, max_wait_s=5.0) == 1
    assert _burst_batches(served, ps, 0.03, window_s=0.05, max_wait_s=0.05) > 1  # capped at one window: cut


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
