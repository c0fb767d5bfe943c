"""`serve --engine llamacpp`: the same OpenAI API from the node's cached GGUF export in llama.cpp.

Two in-process servers on loopback ports (the `served_tiny` model copy; the torch engine, and the
llamacpp engine on its f16 export), both driven by the official `openai` client:
- streamed and non-streamed greedy answers, completions and chat, are the torch engine's tokens (but
  for a near-tie: `servehelpers.greedy_alike`), and
  the chat prompt is the chat template's tokens (usage.prompt_tokens);
- a stop string cuts each engine's answer where it first appears, finish_reason "stop";
- a seeded sampled answer repeats itself (the request's own generator, as on torch);
- requests arriving together are one llama.cpp batch (one sequence per row) and each gets its own text;
- the `auto` rule: llamacpp for a base model on a CPU, torch for an adapter, a --dtype or CUDA; `--help`
  says so;
- a bad `--engine` or `--quant`, and `--engine llamacpp` with `--stages` or `--dtype`, are one message
  and exit 2.
"""

from __future__ import annotations

import threading
import time

import pytest

from helpers import require_module
from servehelpers import greedy_alike
from test_serve_engine import SYSTEM, Held, final, short_during_long

pytestmark = pytest.mark.timeout(300)

QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
TOKEN = "llamacpp-engine-test-token"


def require_llama_cpp() -> None:
    __tracebackhide__ = True
    require_module("llama_cpp", "llama-cpp-python (smolforge[export])",
                   "make install (pip install -e '.[export]' with the Makefile's CMAKE_ARGS; builds llama.cpp)")


class Live:
    """An engine thread and its app behind uvicorn on a free loopback port (test_hostile's Listener)."""

    def __init__(self, model):
        from test_hostile import Listener

        from smolforge.serve.api import create_app
        from smolforge.serve.engine import Engine

        self.engine = Engine(model, max_batch=4).start()
        self.listener = Listener(create_app(model, self.engine, token=TOKEN, model_name="tiny"))

    def client(self):
        import openai

        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.listener.port}/v1", api_key=TOKEN, max_retries=0,
                             timeout=120)

    def close(self) -> None:
        self.listener.close()
        self.engine.stop()


@pytest.fixture(scope="module")
def servers(served_tiny, lcpp_model):
    live = {"torch": Live(served_tiny), "llamacpp": Live(lcpp_model)}
    try:
        yield live
    finally:
        for s in live.values():
            s.close()


def both(servers, fn):
    """`fn(client)` against each engine's server: {engine: result}."""
    return {name: fn(s.client()) for name, s in servers.items()}


def streamed_chat(client, **kw) -> tuple[str, str]:
    chunks = list(client.chat.completions.create(model="tiny", stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)


def streamed_completion(client, **kw) -> str:
    return "".join(c.choices[0].text for c in client.completions.create(model="tiny", stream=True, **kw)
                   if c.choices)


def test_greedy_text_streamed_and_not_is_the_torch_engines(servers, served_tiny):
    """Each engine's streamed answer is its answer; the two engines' answers are the same tokens but for a
    near-tie (`greedy_alike`: the f16 export and fp32 may pick either of two nearly equal tokens)."""
    from smolforge.data.encode import render

    def ask(client):
        chat = client.chat.completions.create(model="tiny", messages=QUESTION, temperature=0, max_tokens=24,
                                              logprobs=True, top_logprobs=2)
        done = client.completions.create(model="tiny", prompt="Once upon a time", temperature=0, max_tokens=24,
                                         logprobs=2)
        return {"chat": chat.choices[0].message.content, "chat_stream": streamed_chat(client, messages=QUESTION,
                                                                                      temperature=0, max_tokens=24)[0],
                "chat_usage": (chat.usage.prompt_tokens, chat.usage.completion_tokens),
                "completion": done.choices[0].text,
                "completion_stream": streamed_completion(client, prompt="Once upon a time", temperature=0,
                                                         max_tokens=24),
                "entries": (chat.model_dump()["choices"][0]["logprobs"]["content"],
                            done.model_dump()["choices"][0]["logprobs"]["content"])}

    got = both(servers, ask)
    lc, pt = got["llamacpp"], got["torch"]
    parted = [greedy_alike(a, b) for a, b in zip(pt.pop("entries"), lc.pop("entries"))]
    for key, where in zip(("chat", "completion"), parted):
        if where is None:
            assert lc[key] == pt[key], (key, lc, pt)
        assert lc[key] and lc[key] == lc[f"{key}_stream"] and pt[key] == pt[f"{key}_stream"], (key, lc, pt)
    assert lc["chat_usage"][0] == pt["chat_usage"][0]
    templated = served_tiny.tokenizer(render(served_tiny.tokenizer, QUESTION, add_generation_prompt=True),
                                      add_special_tokens=False)["input_ids"]
    assert lc["chat_usage"][0] == len(templated)  # the chat template's tokens went in


def test_a_stop_string_cuts_both_engines_alike(servers):
    """A stop string from the middle of an engine's own greedy answer cuts it there, streamed and not,
    finish_reason "stop" (each engine's own answer: a near-tie may part the two engines' texts)."""
    def ask(client):
        whole = client.completions.create(model="tiny", prompt="Once upon a time", temperature=0,
                                          max_tokens=24).choices[0].text
        stop = whole[len(whole) // 2:len(whole) // 2 + 3]
        assert stop.strip(), whole
        done = client.completions.create(model="tiny", prompt="Once upon a time", temperature=0, max_tokens=24,
                                         stop=[stop])
        return (whole, stop, done.choices[0].text, done.choices[0].finish_reason,
                streamed_completion(client, prompt="Once upon a time", temperature=0, max_tokens=24, stop=[stop]))

    for engine, (whole, stop, text, reason, streamed) in both(servers, ask).items():
        assert reason == "stop" and stop not in text and text == whole[:whole.index(stop)], (engine, whole, text)
        assert streamed == text, engine


def test_a_seeded_sample_repeats_and_is_not_the_greedy_text(servers):
    client = servers["llamacpp"].client()

    def sample(seed: int) -> str:
        return streamed_chat(client, messages=QUESTION, temperature=1.0, max_tokens=16, seed=seed)[0]

    greedy = client.chat.completions.create(model="tiny", messages=QUESTION, temperature=0,
                                            max_tokens=16).choices[0].message.content
    assert sample(7) == sample(7)
    assert {sample(7), sample(8), sample(9)} != {greedy}


def test_requests_arriving_together_are_one_llama_batch(servers):
    prompts = ["Hello there", "What is 2 + 3?", "The capital of a small country is", "def fibonacci(n):"]
    live = servers["llamacpp"]
    alone = [live.client().completions.create(model="tiny", prompt=p, temperature=0, max_tokens=12).choices[0].text
             for p in prompts]
    together: list[str | None] = [None] * len(prompts)

    def one(i: int) -> None:
        together[i] = streamed_completion(live.client(), prompt=prompts[i], temperature=0, max_tokens=12)

    # the engine held inside a one-token request until all four wait in its queue: the next batch is what
    # the queue holds, not what a clock let in (threads' clients arrived apart on a busy machine)
    held = Held(live.engine, [1, 2, 3])
    batches = live.engine.batches
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    deadline = time.time() + 60
    while live.engine._queue.qsize() < len(prompts) and time.time() < deadline:
        time.sleep(0.01)
    held.release()
    for t in threads:
        t.join(120)
    assert together == alone
    assert (live.engine.batches - batches, live.engine.largest_batch) == (1, len(prompts))
    assert sorted(live.engine.model._free) == list(range(4))  # every row's sequence went back to the pool


def test_prompts_longer_than_a_llama_batch_are_decoded_in_pieces(lcpp_model, served_tiny, monkeypatch):
    """Prefill in `n_batch` pieces (llama.cpp's bound on one decode), rows sharing a piece: each row's
    tokens are the ones it gets in one piece, alone or batched."""
    from smolforge.serve.batch import Request
    from smolforge.serve.engine import Engine
    from smolforge.serve.sampling import SamplingParams

    prompts = [served_tiny.tokenizer(p)["input_ids"] for p in ("Hello there, how are you today?", "def fibonacci(n):")]

    def run(*rows: list[int]) -> list[list[int]]:
        done: list = []
        Engine(lcpp_model).run_batch([Request(ids, SamplingParams(max_tokens=8, temperature=0), done.append)
                                      for ids in rows])
        return sorted(e.token_ids for e in done if hasattr(e, "finish_reason"))

    whole = run(*prompts)
    assert sorted(run(p)[0] for p in prompts) == whole
    monkeypatch.setattr(lcpp_model, "n_batch", 3)
    assert all(len(ids) > 3 for ids in prompts)
    assert run(*prompts) == whole


def test_logits_are_read_in_place_not_copied(lcpp_model, served_tiny, monkeypatch):
    """Every forward of a generation (prefill and each decode step) hands back rows of llama.cpp's own
    output buffer, not a copy per token, and the view over it is not made again per step (`made`)."""
    import ctypes

    from smolforge.serve.batch import Request
    from smolforge.serve.engine import Engine
    from smolforge.serve.sampling import SamplingParams

    forward, seen = lcpp_model.forward, []

    def spy(*args):
        out = forward(*args)
        seen.append((out.data_ptr(), tuple(out.shape)))
        return out

    monkeypatch.setattr(lcpp_model, "forward", spy)
    made = lcpp_model.logits.made
    prompts = [served_tiny.tokenizer(p)["input_ids"] for p in ("Hello there", "def fibonacci(n):")]
    Engine(lcpp_model).run_batch([Request(ids, SamplingParams(max_tokens=6, temperature=0, stop=[]), lambda e: None)
                                  for ids in prompts])
    buffer = ctypes.cast(lcpp_model.lc.llama_get_logits(lcpp_model._ctx), ctypes.c_void_p).value
    assert len(seen) >= 6 and {ptr for ptr, _ in seen} == {buffer}, (seen, buffer)
    assert seen[0][1] == (2, lcpp_model.n_vocab)
    assert lcpp_model.logits.made - made <= 1


def test_the_auto_rule(model_copy, tmp_path):
    from smolforge.serve.engines import AUTO_RULE, EngineSpec, auto_engine

    require_llama_cpp()
    base = EngineSpec(model=str(model_copy), name="tiny", device="cpu")
    assert auto_engine(base) == "llamacpp"
    assert auto_engine(EngineSpec(model=str(model_copy), name="tiny", device="cpu", adapter=str(tmp_path))) == "torch"
    assert auto_engine(EngineSpec(model=str(model_copy), name="tiny", device="cuda")) == "torch"
    assert auto_engine(EngineSpec(model=str(model_copy), name="tiny", device="cpu", dtype="bf16")) == "torch"
    assert " ".join(AUTO_RULE.split()) in " ".join(_invoke(["serve", "--help"]).stdout.replace("│", " ").split())


def _invoke(argv: list[str]):
    from typer.testing import CliRunner

    from smolforge.cli.main import app

    return CliRunner().invoke(app, argv, env={"SMOLFORGE_COORDINATOR": "", "SMOLFORGE_TOKEN": None, "COLUMNS": "400"})


@pytest.mark.parametrize("args, message", [
    (["--engine", "vllm"], "unknown engine 'vllm'"),
    (["--engine", "llama"], "unknown engine 'llama' (did you mean 'llamacpp'?)"),
    (["--quant", "q3"], "unknown --quant 'q3'"),
    (["--engine", "llamacpp", "--stages", "2"], "--stages serves with the torch engine"),
    (["--engine", "llamacpp", "--dtype", "bf16"], "--dtype bf16 is the torch engine's"),
])
def test_a_bad_engine_is_one_message_and_exit_2(model_copy, args, message):
    res = _invoke(["serve", "--model", str(model_copy), "--port", "0", *args])
    err = res.stderr
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), (res.exception, res.output[-2000:])
    assert err.startswith("error:") and err.count("error:") == 1 and "Traceback" not in res.output, err
    assert message in err and "\n  fix:" in err, err


def _alone(model, ids: list[int], max_tokens: int, **engine_kw) -> tuple[list[int], int]:
    """A request's greedy tokens generated alone (no prefix cache unless asked), and the tokens prefilled."""
    from smolforge.serve.batch import Request
    from smolforge.serve.engine import Engine
    from smolforge.serve.sampling import SamplingParams

    engine, events = Engine(model, **({"prefix_cache_bytes": 0} | engine_kw)), []
    engine.run_batch([Request(ids, SamplingParams(max_tokens=max_tokens, temperature=0), events.append)])
    return final(events).token_ids, engine.prefill_tokens


def test_a_short_request_sent_during_a_long_one_ends_first_on_llama_cpp(lcpp_model, served_tiny):
    """Continuous batching on llama.cpp: the short request's sequence joins the running decode at the
    next step and ends while the long one still runs; both get the tokens they get alone."""
    from smolforge.serve.engine import Engine

    tok = served_tiny.tokenizer
    long_ids = tok("the of and to in is you that it he was for on are as with his")["input_ids"]
    short_ids = tok("Reverse abc")["input_ids"]
    engine = Engine(lcpp_model, max_batch=4).start()
    try:
        order, long_done, short_done = short_during_long(engine, long_ids, short_ids)
    finally:
        engine.stop()
    assert long_done.finish_reason == "length" and long_done.completion_tokens == 40
    assert order == ["short", "long"]
    assert (engine.batches, engine.largest_batch) == (1, 2)
    assert long_done.token_ids == _alone(lcpp_model, long_ids, 40)[0]
    assert short_done.token_ids == _alone(lcpp_model, short_ids, 6)[0]
    assert sorted(lcpp_model._free) == list(range(lcpp_model.n_seq))  # every sequence went back to the pool


def test_a_shared_prefix_is_computed_once_on_llama_cpp(lcpp_model, served_tiny):
    """The llama.cpp sequence state of a prompt is kept; a prompt beginning alike restores it into a free
    sequence, cut to the shared prefix, and prefills only the rest: the tokens it gets without the cache."""
    from smolforge.serve.batch import Request
    from smolforge.serve.engine import Engine
    from smolforge.serve.prefix import common_prefix
    from smolforge.serve.sampling import SamplingParams

    tok = served_tiny.tokenizer
    first, second = tok(SYSTEM + " What is 2 + 3?")["input_ids"], tok(SYSTEM + " Reverse abc")["input_ids"]
    shared = common_prefix(first, second)
    engine, events = Engine(lcpp_model), []
    engine.run_batch([Request(first, SamplingParams(max_tokens=4, temperature=0), lambda e: None)])
    before = engine.prefill_tokens
    engine.run_batch([Request(second, SamplingParams(max_tokens=12, temperature=0), events.append)])
    assert engine.prefill_tokens - before == len(second) - shared
    assert (engine.prefix.hits, engine.prefix.tokens_reused) == (1, shared)
    assert final(events).token_ids == _alone(lcpp_model, second, 12)[0]
    assert sorted(lcpp_model._free) == list(range(lcpp_model.n_seq))


def test_logprobs_are_llama_cpps_own_log_softmax(lcpp_model, monkeypatch):
    """Issue 44 item 5 on this engine: batched rows of three lengths (greedy and sampled, echo on each):
    each generated and echoed token's logprob and top alternatives are the log-softmax of the very
    logits rows llama.cpp gave the engine (within 1e-4), and agree with llama-cpp-python's own `Llama`
    evaluating each sequence alone (within 1e-2: llama.cpp's kernels sum in another order for another
    batch shape; 1e-3 measured on this f16 export)."""
    import numpy as np
    import torch
    from llama_cpp import Llama

    from smolforge.serve.sampling import SamplingParams
    from test_logprobs import K, TEXTS, check_entry, run_rows

    seen: list[torch.Tensor] = []  # every forward's logits, as the engine got them
    forward = lcpp_model.forward

    def recording(*args, **kw):
        out = forward(*args, **kw)
        seen.append(torch.log_softmax(out.float(), -1))
        return out

    monkeypatch.setattr(lcpp_model, "forward", recording)
    ps = [lcpp_model.tokenizer(t)["input_ids"] for t in TEXTS]
    params = [SamplingParams(max_tokens=4, temperature=0, logprobs=K, prompt_logprobs=True),
              SamplingParams(max_tokens=4, temperature=0.7, seed=3, logprobs=K, prompt_logprobs=True),
              SamplingParams(max_tokens=3, temperature=0, logprobs=K, prompt_logprobs=True)]
    done = run_rows(lcpp_model, ps, params)
    width = max(len(p) for p in ps)
    for i, (p, d) in enumerate(zip(ps, done)):
        prefill = seen[0][i]  # [width, vocab]: row i's prompt is its last columns
        assert d.prompt_logprobs[0] is None and len(d.prompt_logprobs) == len(p)
        for j in range(1, len(p)):
            check_entry(d.prompt_logprobs[j], prefill[width - len(p) + j - 1], p[j])
        answer = [t for t in d.token_ids if t not in lcpp_model.eos_ids]
        assert len(d.logprobs) == len(answer) >= 1
        for t, tok in enumerate(answer):  # step t's rows: those that had not finished before it, in order
            row = prefill[-1] if t == 0 else seen[t][sum(len(o.token_ids) > t for o in done[:i])]
            check_entry(d.logprobs[t], row, tok)
    llm = Llama(model_path=str(lcpp_model.gguf_path), n_ctx=256, n_threads=1, logits_all=True, verbose=False)
    try:
        for p, d in zip(ps, done):
            answer = [t for t in d.token_ids if t not in lcpp_model.eos_ids]
            llm.reset()
            llm.eval(p + answer)
            ref = torch.log_softmax(torch.from_numpy(np.array(llm.scores[:len(p) + len(answer)])).float(), -1)
            got = [e.logprob for e in d.prompt_logprobs[1:] + d.logprobs]
            want = [float(ref[k - 1, tok]) for k, tok in enumerate(p + answer) if k >= 1]
            assert max(abs(a - b) for a, b in zip(got, want)) < 1e-2
    finally:
        llm.close()


def test_bytes_cached_tokens_and_fingerprint_on_both_engines(servers, served_tiny):
    """What llama-server and OpenAI return that we did not (issue 44/46), on both engines through the official
    client: every log-probability's `bytes` are its token's own (each names one id, the answer's join into
    its text: chat and the completions `content`), `usage.prompt_tokens_details.cached_tokens` is what the
    prefix cache served (0, then the shared prefix, streamed and not), and `system_fingerprint` is on every
    answer and chunk, one per server (the engines' differ)."""
    import uuid

    from smolforge.data.encode import render
    from smolforge.distill.teacher_openai import TokenMap
    from smolforge.serve.prefix import common_prefix

    tok = served_tiny.tokenizer
    names = TokenMap(tok)
    system = f"{uuid.uuid4().hex}: you answer in one short sentence and never repeat the question."  # new: no hit
    convs = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
             for q in ("What is 2 + 3?", "Name a colour.")]
    ids = [tok(render(tok, c, add_generation_prompt=True), add_special_tokens=False)["input_ids"] for c in convs]
    stream = {"stream": True, "stream_options": {"include_usage": True}}

    def ask(client):
        kw = dict(model="tiny", temperature=0, max_tokens=6)
        chat = client.chat.completions.create(messages=convs[0], logprobs=True, top_logprobs=5, **kw).model_dump()
        chat2 = [c.model_dump() for c in client.chat.completions.create(messages=convs[1], logprobs=True,
                                                                        top_logprobs=5, **kw, **stream)]
        comp = client.completions.create(prompt=system, logprobs=5, **kw).model_dump()
        comp2 = [c.model_dump() for c in client.completions.create(prompt=system, **kw, **stream)]
        return chat, chat2, comp, comp2

    got = both(servers, ask)
    for engine, (chat, chat2, comp, comp2) in got.items():
        content = chat["choices"][0]["logprobs"]["content"]
        streamed = [c for ch in chat2 if ch["choices"] and ch["choices"][0]["logprobs"]
                    for c in ch["choices"][0]["logprobs"]["content"]]
        legacy = comp["choices"][0]["logprobs"]
        for entries in (content, streamed, legacy["content"]):
            assert entries and all(names((a["token"], a["bytes"])) is not None
                                   for c in entries for a in [c, *c["top_logprobs"]]), engine
        text = chat["choices"][0]["message"]["content"]
        assert b"".join(bytes(c["bytes"]) for c in content).decode("utf-8", "replace") == text
        assert [c["token"] for c in legacy["content"]] == legacy["tokens"]
        cached = [chat["usage"]["prompt_tokens_details"]["cached_tokens"], chat2[-1]["usage"]["prompt_tokens_details"]
                  ["cached_tokens"], comp["usage"]["prompt_tokens_details"]["cached_tokens"],
                  comp2[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]]
        # the same prompt again: all of it but its last token, whose logits give the first token
        assert cached == [0, common_prefix(ids[1], ids[0]), 0, comp["usage"]["prompt_tokens"] - 1], (engine, cached)
        assert cached[1] >= 16  # the shared system prompt (the cache's least)
        prints = {chat["system_fingerprint"], comp["system_fingerprint"],
                  *(c["system_fingerprint"] for c in chat2 + comp2)}
        assert len(prints) == 1 and prints.pop().startswith("fp_"), (engine, prints)
    assert got["torch"][0]["system_fingerprint"] != got["llamacpp"][0]["system_fingerprint"]
    # greedy: the same tokens, but for a near-tie (the prompt is new each run: some have one)
    greedy_alike(got["torch"][0]["choices"][0]["logprobs"]["content"],
                 got["llamacpp"][0]["choices"][0]["logprobs"]["content"])


def test_a_step_of_rows_in_any_sequence_order_is_one_ubatch(lcpp_model, served_tiny):
    """Issue 44 (first-token time, throughput): the context has a KV stream per sequence (its attention reads
    only the row's own cells; one stream shared by all read every row's, 1.3x slower at 90 % load), and
    llama.cpp cuts a call into a ubatch, a pass over the weights, per run of consecutive ids in batch order
    (`split_equal`). So ids are handed out lowest first, and a decode step sends its rows in id order and
    gives their logits back in row order: a running batch whose rows hold ids 2, 0, 3, 1 (as rows leave and
    join) decodes in one ubatch, and each row's logits are those of its sequence decoded alone. llama.cpp's
    own eval callback sees the graph's output node once per ubatch."""
    import torch
    from helpers import llama_ubatch_counter
    from smolforge.serve.llamacpp import LlamaCppModel

    seen, ubatches = llama_ubatch_counter()

    class Counted(LlamaCppModel):
        def _extra_params(self):
            return {"cb_eval": seen}

    model = Counted(lcpp_model.gguf_path, lcpp_model.tokenizer, lcpp_model.eos_ids, name="tiny", quant="f16",
                    n_threads=1, max_batch=4)
    decode, calls = model._decode, [0]

    def counted(entries):
        calls[0] += 1
        decode(entries)

    model._decode = counted
    prompts = [served_tiny.tokenizer(p)["input_ids"] for p in
               ("Hello there", "What is 2 + 3?", "The capital of a small country is", "def fibonacci(n):")]

    def forward(cache, ids, positions):
        ids = torch.tensor(ids, dtype=torch.long)[:, None] if positions else torch.tensor([ids], dtype=torch.long)
        pos = torch.tensor(positions)[:, None] if positions else torch.arange(ids.shape[1])[None]
        return model.forward(ids, torch.ones_like(ids), pos, cache).clone()

    try:
        model._free = [2, 0, 3, 1]  # freed in this order: handed out lowest first all the same
        caches = [model.new_cache() for _ in prompts]
        firsts = [int(forward(c, p, None)[0].argmax()) for c, p in zip(caches, prompts)]
        assert [c.seqs for c in caches] == [[0], [1], [2], [3]]
        order = [2, 0, 3, 1]  # a running batch's rows, as they left and joined
        batch = caches[order[0]]
        for k in order[1:]:
            batch = model.join_caches(batch, caches[k], 0, 0)
        assert batch.seqs == order
        before = (calls[0], ubatches[0])
        together = forward(batch, [firsts[k] for k in order], [len(prompts[k]) for k in order])
        assert (calls[0] - before[0], ubatches[0] - before[1]) == (1, 1)  # one call, one pass over the weights
        for row, k in enumerate(order):  # the same step, each sequence alone: its logits are its row's
            model.context.drop(k, len(prompts[k]))
            alone = forward(_one(k), [firsts[k]], [len(prompts[k])])
            # batched and alone differ in float rounding only; another row's logits differ by whole units
            assert (together[row] - alone[0]).abs().max() < 0.02, (row, k)
            assert all((together[other] - alone[0]).abs().max() > 0.5 for other in range(len(order)) if other != row)
    finally:
        model.close()


def _one(seq):
    """A one-row cache of sequence `seq` (already holding its prompt)."""
    from smolforge.serve.llamacpp import SeqCache

    return SeqCache([seq])
