"""Log-probabilities (issue 44 items 5 and 7) and nothing ignored (item 6).

- Each generated token's and each echoed prompt token's logprob, and the top alternatives, are the
  model's own log-softmax over the whole sequence (one HF forward, no cache) within 1e-4: batched
  prompts of different lengths (left padding), a greedy and a sampled row (raw, before temperature),
  in one process and through 2 stages;
- the API's shapes (chat `logprobs.content`, the legacy `tokens`/`token_logprobs`/`top_logprobs`/
  `text_offset`) are the same streamed and not, the tokens join into the text, echo with max_tokens 0
  returns the prompt's alone, and the events cross the front process's channel whole;
- every field of the official client's chat and completions request types is honoured (200) or a 400
  whose `param` names it; a field OpenAI does not define is a 400 naming it.
"""

from __future__ import annotations

import asyncio
import json
import typing
from typing import Any

import httpx
import pytest
import torch

from smolforge.serve.api import create_app
from smolforge.serve.batch import Request
from smolforge.serve.channel import event_message, message_event
from smolforge.serve.engine import Engine
from smolforge.serve.events import DoneEvent, TokenEvent, TokenLogprob
from smolforge.serve.sampling import SamplingParams

pytestmark = pytest.mark.timeout(300)

TOKEN = "logprobs-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
K = 5
TOL = 1e-4
TEXTS = ["What is 2 + 3?", "the of and to in is you that it he was for on are as", "sum"]


def run_rows(model, ps: list[list[int]], params: list[SamplingParams]) -> list[DoneEvent]:
    """One static batch of these rows, on this thread; each row's DoneEvent."""
    done: dict[int, DoneEvent] = {}
    reqs = [Request(p, sp, (lambda i: lambda e: done.__setitem__(i, e) if not isinstance(e, TokenEvent) else None)(i))
            for i, (p, sp) in enumerate(zip(ps, params))]
    Engine(model).run_batch(reqs)
    assert all(isinstance(done[i], DoneEvent) for i in range(len(ps))), done
    return [done[i] for i in range(len(ps))]


def reference(net, ids: list[int]) -> torch.Tensor:
    """The model's log-softmax at every position of `ids`, [len, vocab]: one forward, no cache, no padding."""
    with torch.no_grad():
        return torch.log_softmax(net(input_ids=torch.tensor([ids])).logits[0].float(), -1)


def check_entry(entry: TokenLogprob, row: torch.Tensor, token: int) -> None:
    assert entry.id == token
    assert abs(entry.logprob - float(row[token])) < TOL, (entry.logprob, float(row[token]))
    want = torch.topk(row, K)
    assert len(entry.top) == K
    assert max(abs(lp - float(v)) for (_, lp), v in zip(entry.top, want.values)) < TOL
    assert [i for i, _ in entry.top] == want.indices.tolist()


def check_against(net, prompt: list[int], done: DoneEvent, eos: frozenset[int]) -> None:
    """The row's prompt and generated log-probabilities are `net`'s own over prompt + answer."""
    answer = [t for t in done.token_ids if t not in eos]
    ref = reference(net, prompt + answer)
    assert done.prompt_logprobs is not None and done.prompt_logprobs[0] is None
    assert len(done.prompt_logprobs) == len(prompt)
    for j in range(1, len(prompt)):
        check_entry(done.prompt_logprobs[j], ref[j - 1], prompt[j])
    assert done.logprobs is not None and len(done.logprobs) == len(answer) >= 1
    for t, tok in enumerate(answer):
        check_entry(done.logprobs[t], ref[len(prompt) + t - 1], tok)


@pytest.fixture(scope="module")
def served(served_tiny):
    """The serve tests' shared in-process model (conftest), read-only here."""
    return served_tiny


@pytest.mark.parametrize("where", ["one process", "2 stages"])
def test_logprobs_are_the_models_own_log_softmax(served, model_copy, where):
    """Greedy and sampled rows (temperature 0.7: the numbers are still the raw model's), prompts of three
    lengths in one left-padded batch, echo on every row."""
    model = served
    if where == "2 stages":
        from smolforge.serve.stages import local_stages, staged_model

        model = staged_model(str(model_copy), local_stages(str(model_copy), [0, 2, 4]), name="tiny")
    ps = [served.tokenizer(t)["input_ids"] for t in TEXTS]
    params = [SamplingParams(max_tokens=4, temperature=0, logprobs=K, prompt_logprobs=True),
              SamplingParams(max_tokens=4, temperature=0.7, seed=3, logprobs=K, prompt_logprobs=True),
              SamplingParams(max_tokens=3, temperature=0, logprobs=K, prompt_logprobs=True)]
    for p, d in zip(ps, run_rows(model, ps, params)):
        check_against(served.model, p, d, served.eos_ids)


def test_a_row_without_logprobs_gets_none_and_max_tokens_0_reads_the_prompt_only(served):
    ps = [served.tokenizer(t)["input_ids"] for t in TEXTS[:2]]
    plain, echo_only = run_rows(served, ps, [SamplingParams(max_tokens=2, temperature=0),
                                             SamplingParams(max_tokens=0, logprobs=1, prompt_logprobs=True)])
    assert plain.logprobs is None and plain.prompt_logprobs is None and plain.completion_tokens == 2
    assert echo_only.token_ids == [] and echo_only.logprobs == [] and len(echo_only.prompt_logprobs) == len(ps[1])


def test_logprob_events_cross_the_front_process_channel_whole():
    entry = TokenLogprob(7, -1.25, [(7, -1.25), (3, -2.5)])
    for event in (TokenEvent("x", 7, [entry], [None, entry]), TokenEvent("y", 8),
                  DoneEvent("stop", "xy", 2, 1, [7], [entry], [None, entry], cached_tokens=1),
                  DoneEvent("length", "", 1, 0, [])):
        assert message_event(json.loads(json.dumps(event_message(1, event)))) == event


BYTES_TEXT = "café 日本 🙂 ok ꙮ𝄞 ok"  # characters of 2, 3 and 4 bytes; the last two rare: byte tokens in every kind


@pytest.mark.parametrize("tokenizer", ["tiny-llama", "twin:tinyllama-1.1b-chat-v1.0",
                                       pytest.param("twin:qwen2.5-0.5b-instruct", marks=pytest.mark.soak)])  # 150k ids: 20 s
def test_each_token_is_named_by_its_own_bytes_even_a_byte_of_a_character(tokenizer):
    """`bytes` (chat `content`, and the completions `content` llama-server sends) are each token's own: a byte of
    a multi-byte character is that byte, not U+FFFD's three; the bytes join into the text's UTF-8 and the texts
    into the text (a token that only starts a character adds ""). Byte-level BPE (tiny, Qwen2.5) and
    SentencePiece with byte fallback (TinyLlama) alike."""
    from smolforge.distill.teacher_openai import TokenMap
    from smolforge.models.loading import load_tokenizer
    from smolforge.models.twins import twin_dir
    from smolforge.serve.logprobs import TokenText, chat_logprobs, completion_logprobs

    tok = load_tokenizer(str(twin_dir(tokenizer)) if tokenizer.startswith("twin:") else tokenizer)
    ids = tok.encode(BYTES_TEXT, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    partial = [i for i, p in zip(ids, pieces) if "\ufffd" in p]
    assert len(partial) >= 2, pieces  # the text does split characters into byte tokens here
    entries = [TokenLogprob(i, -1.0, [(i, -1.0), (partial[0], -2.0)]) for i in ids]
    content = chat_logprobs(TokenText(tok), entries)["content"]
    assert b"".join(bytes(c["bytes"]) for c in content).lstrip(b" ") == BYTES_TEXT.encode()
    assert "".join(c["token"] for c in content).lstrip(" ") == BYTES_TEXT
    assert not any(bytes(c["bytes"]) == "\ufffd".encode() for c in content)
    names = TokenMap(tok)  # the endpoint teacher names every token, and the byte alternative, by its bytes
    assert [names((c["token"], c["bytes"])) for c in content] == ids
    assert {names((a["token"], a["bytes"])) for c in content for a in c["top_logprobs"]} == set(ids) | {partial[0]}
    legacy = completion_logprobs(TokenText(tok), entries)
    assert legacy["content"] == content and legacy["tokens"] == [c["token"] for c in content]
    assert legacy["text_offset"] == [sum(len(t) for t in legacy["tokens"][:i]) for i in range(len(ids))]


# -- the HTTP API -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def app(served):
    engine = Engine(served, max_batch=4).start()
    yield create_app(served, engine, token=TOKEN, model_name="tiny")
    engine.stop()


def post_all(app, bodies: list[tuple[str, dict[str, Any]]]) -> list[httpx.Response]:
    """Each body to its path, one after the other, in-process."""
    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://serve", headers=AUTH, timeout=120) as c:
            return [await c.post(path, json=body) for path, body in bodies]

    return asyncio.run(main())


def sse_chunks(resp: httpx.Response) -> list[dict[str, Any]]:
    lines = [ln[len("data: "):] for ln in resp.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_the_api_shapes_streamed_and_not(app, served):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 5,
            "logprobs": True, "top_logprobs": 3}
    comp = {"model": "tiny", "prompt": TEXTS[0], "temperature": 0, "max_tokens": 3, "logprobs": 2, "echo": True}
    ids = served.tokenizer(TEXTS[0])["input_ids"]
    whole_chat, streamed_chat, whole, streamed, only_prompt = post_all(app, [
        ("/v1/chat/completions", chat), ("/v1/chat/completions", {**chat, "stream": True}),
        ("/v1/completions", comp), ("/v1/completions", {**comp, "stream": True}),
        ("/v1/completions", {**comp, "prompt": [ids], "max_tokens": 0})])
    choice = whole_chat.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == choice["message"]["content"] and len(content) >= 1
    assert b"".join(bytes(c["bytes"]) for c in content).decode("utf-8", "replace") == choice["message"]["content"]
    assert all(len(c["top_logprobs"]) == 3 for c in content)
    assert all(c["logprob"] <= c["top_logprobs"][0]["logprob"] for c in content)
    got = [c for chunk in sse_chunks(streamed_chat) if chunk["choices"][0]["logprobs"]
           for c in chunk["choices"][0]["logprobs"]["content"]]
    assert got == content

    legacy = whole.json()["choices"][0]
    lp = legacy["logprobs"]
    assert legacy["text"].startswith(TEXTS[0]) and len(lp["tokens"]) == len(ids) + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(len(top) in (2, 3) and tok in top for tok, top in zip(lp["tokens"][1:], lp["top_logprobs"][1:]))
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    chunks = [c["choices"][0] for c in sse_chunks(streamed)]
    assert "".join(c["text"] for c in chunks) == legacy["text"]
    joined = {k: [v for c in chunks if c["logprobs"] for v in c["logprobs"][k]] for k in lp}
    assert joined == lp

    prompt_only = only_prompt.json()["choices"][0]
    assert prompt_only["logprobs"]["token_logprobs"] == lp["token_logprobs"][:len(ids)]
    assert only_prompt.json()["usage"]["completion_tokens"] == 0


# -- every field of OpenAI's request types ----------------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
OK = 200
# field -> (a value that asks for something, the status it gets). 200: honoured; 400: refused, naming it.
CHAT_FIELDS: dict[str, tuple[Any, int]] = {
    "messages": ([{"role": "user", "content": "hi"}], OK), "model": ("tiny", OK),
    "audio": ({"voice": "alloy", "format": "wav"}, 400), "frequency_penalty": (0.5, OK),
    "function_call": ({"name": "f"}, 400), "functions": ([{"name": "f"}], 400), "logit_bias": ({"1": 5}, OK),
    "logprobs": (True, OK), "max_completion_tokens": (1, OK), "max_tokens": (1, OK),
    "metadata": ({"k": "v"}, 400), "modalities": (["text", "audio"], 400), "moderation": ({"model": "m"}, 400),
    "n": (2, OK), "parallel_tool_calls": (False, OK), "prediction": ({"type": "content", "content": "x"}, 400),
    "presence_penalty": (-0.5, OK), "prompt_cache_key": ("k", OK), "prompt_cache_options": ({"ttl": 1}, 400),
    "prompt_cache_retention": ("24h", 400), "reasoning_effort": ("low", 400),
    "response_format": ({"type": "json_object"}, OK), "safety_identifier": ("u1", OK), "seed": (5, OK),
    "service_tier": ("flex", 400), "stop": (["\n"], OK), "store": (True, 400),
    "stream_options": ({"include_usage": True}, OK), "temperature": (0.5, OK), "tool_choice": ("required", 400),  # no tools to call: a 400 naming it
    "tools": ([TOOL], 400),  # tiny's template renders no tools: a 400 naming them (honoured: tests/serve/test_tools.py)
    "top_logprobs": (2, OK), "top_p": (0.5, OK), "user": ("u1", OK),
    "verbosity": ("low", 400), "web_search_options": ({}, 400),
}
COMPLETION_FIELDS: dict[str, tuple[Any, int]] = {
    "model": ("tiny", OK), "prompt": ("hi", OK), "best_of": (2, 400), "echo": (True, OK),
    "frequency_penalty": (0.5, OK), "logit_bias": ({"1": 5}, OK), "logprobs": (2, OK), "max_tokens": (1, OK),
    "n": (2, OK), "presence_penalty": (0.5, OK), "seed": (5, OK), "stop": ("\n", OK),
    "stream_options": ({"include_usage": True}, OK), "suffix": ("x", 400), "temperature": (0.5, OK),
    "top_p": (0.5, OK), "user": ("u1", OK),
}
NEEDS = {"top_logprobs": {"logprobs": True}}  # a field honoured only with another


def request_fields(module: Any) -> set[str]:
    """The fields of the official client's request type (its TypedDict, base and streaming flag)."""
    return set(typing.get_type_hints(module.CompletionCreateParamsBase)) | {"stream"}


def test_every_openai_request_field_is_honoured_or_refused_by_name(app):
    from openai.types import completion_create_params as completion
    from openai.types.chat import completion_create_params as chat

    base = {"/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                     "max_tokens": 1},
            "/v1/completions": {"model": "tiny", "prompt": "hi", "max_tokens": 1}}
    cases = []
    for path, module, table in (("/v1/chat/completions", chat, CHAT_FIELDS),
                                ("/v1/completions", completion, COMPLETION_FIELDS)):
        assert request_fields(module) - {"stream"} == set(table), "a field of the client's types is not classified"
        for name, (value, status) in table.items():
            cases.append((path, name, {**base[path], **NEEDS.get(name, {}), name: value}, status))
        cases.append((path, "stream", {**base[path], "stream": True}, OK))
        cases.append((path, "max_tokenz", {**base[path], "max_tokenz": 1}, 400))  # not OpenAI's: refused by name
    cases.append(("/v1/chat/completions", "top_logprobs", {**base["/v1/chat/completions"], "top_logprobs": 2}, 400))
    cases.append(("/v1/chat/completions", "top_logprobs",
                  {**base["/v1/chat/completions"], "logprobs": True, "top_logprobs": 21}, 400))
    cases.append(("/v1/completions", "logprobs", {**base["/v1/completions"], "logprobs": 21}, 400))
    cases.append(("/v1/completions", "max_tokens", {**base["/v1/completions"], "max_tokens": 0}, 400))
    chat_base = base["/v1/chat/completions"]
    cases.append(("/v1/chat/completions", "parallel_tool_calls", {**chat_base, "tools": [TOOL],
                                                                  "parallel_tool_calls": False}, 400))  # auto: not enforced
    cases.append(("/v1/chat/completions", "logprobs", {**chat_base, "tools": [TOOL], "logprobs": True}, 400))
    hi = {"role": "user", "content": "hi"}
    for field, value in (("name", "ann"), ("tool_call_id", "c1"), ("tool_calls", []), ("colour", "red")):  # a message's fields too
        cases.append(("/v1/chat/completions", f"messages.1.{field}",
                      {**base["/v1/chat/completions"], "messages": [hi, {**hi, field: value}]}, 400))
    cases.append(("/v1/chat/completions", "messages.0.content.0.colour",
                  {**base["/v1/chat/completions"], "messages": [{**hi, "content": [{"type": "text", "text": "hi",
                                                                                    "colour": "red"}]}]}, 400))
    assistant = {"role": "assistant", "content": "ok", "refusal": None, "tool_calls": None, "name": None}
    cases.append(("/v1/chat/completions", "messages", {**base["/v1/chat/completions"],
                                                       "messages": [hi, assistant, hi]}, OK))  # nulls: not given
    cases.append(("/v1/chat/completions", "stream_options.include_obfuscation",
                  {**base["/v1/chat/completions"], "stream_options": {"include_obfuscation": True}}, 400))
    responses = post_all(app, [(path, body) for path, _, body, _ in cases])
    wrong = []
    for (path, name, _, status), resp in zip(cases, responses):
        param = resp.json()["error"]["param"] if resp.status_code == 400 else None
        if resp.status_code != status or (status == 400 and param != name):
            wrong.append((path, name, resp.status_code, resp.text[:200]))
    assert not wrong, wrong
