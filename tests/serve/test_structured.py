"""Structured output (`response_format`): every answer parses and validates, on both engines.

- 20 seeded sampled answers of a random-weight model, a batch on each engine (torch, llama.cpp on the
  f16 export), all parse and validate against the schema: the grammar's mask (serve/structured.py,
  applied in `Batch._sample`) decided every token; without it the same requests give no JSON;
- through the official `openai` client: `json_schema` and `json_object` answers parse, streamed and not
  equal; an answer cut at `max_tokens` says `finish_reason` "length" (as OpenAI); a schema that cannot
  be compiled, or `json_schema` without a schema, is a 400 that names `response_format`.
"""

from __future__ import annotations

import json
import queue

import pytest

from helpers import require_module
from test_llamacpp_engine import TOKEN, Live, require_llama_cpp  # lcpp_model: a fixture of conftest.py

pytestmark = pytest.mark.timeout(300)

SCHEMA = {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "pick": {"enum": ["red", "green"]},
    "ok": {"type": "boolean"}}, "required": ["n", "pick", "ok"], "additionalProperties": False}
ANSWERS = 20


def _batch_of_answers(model, grammar):
    """ANSWERS seeded sampled answers, submitted together to one engine: (texts, constraints' mask counts)."""
    from smolforge.serve.engine import Engine, TokenEvent
    from smolforge.serve.sampling import SamplingParams

    # as many rows as the model takes (llama.cpp: its sequences), the rest in the next batch
    engine = Engine(model, max_batch=getattr(model, "n_seq", ANSWERS), window_s=0.5, max_wait_s=2.0).start()
    try:
        ids = model.tokenizer("Reply in JSON:", add_special_tokens=False)["input_ids"]
        done: queue.Queue = queue.Queue()
        reqs = [engine.submit(ids, SamplingParams(max_tokens=48, temperature=1.0, seed=k, grammar=grammar),
                              lambda e: None if isinstance(e, TokenEvent) else done.put(e)) for k in range(ANSWERS)]
        events = [done.get(timeout=240) for _ in reqs]
    finally:
        engine.stop()
    return [getattr(e, "text", repr(e)) for e in events], [r.constraint.masks if r.constraint else 0 for r in reqs]


def _valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.mark.parametrize("engine", ["torch", "llamacpp"])
def test_twenty_of_twenty_json_schema_answers_validate(engine, served_tiny, request):
    require_module("llguidance", "llguidance (a smolforge dependency)", "pip install -c constraints.txt llguidance==1.9.1")
    from smolforge.serve.structured import json_schema_grammar

    if engine == "llamacpp":
        require_llama_cpp()
    model = served_tiny if engine == "torch" else request.getfixturevalue("lcpp_model")
    texts, masks = _batch_of_answers(model, json_schema_grammar(SCHEMA))
    assert sum(_valid(t) for t in texts) == ANSWERS, texts
    assert all(m >= 5 for m in masks), masks  # every token of every answer went through the mask
    assert len(set(texts)) > 1, texts  # sampled, seeded apart: not one answer twenty times


@pytest.fixture(scope="module")
def live(served_tiny):
    require_module("llguidance", "llguidance (a smolforge dependency)", "pip install -c constraints.txt llguidance==1.9.1")
    server = Live(served_tiny)
    yield server
    server.close()


def _schema_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}


def test_openai_client_gets_valid_json_streamed_and_not(live):
    client, question = live.client(), [{"role": "user", "content": "Pick a colour."}]
    whole = client.chat.completions.create(model="tiny", messages=question, temperature=0, max_tokens=48,
                                           response_format=_schema_format())
    chunks = list(client.chat.completions.create(model="tiny", messages=question, temperature=0, max_tokens=48,
                                                 response_format=_schema_format(), stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert _valid(whole.choices[0].message.content) and whole.choices[0].finish_reason == "stop"
    assert streamed == whole.choices[0].message.content
    anything = client.chat.completions.create(model="tiny", messages=question, temperature=0, max_tokens=200,
                                              response_format={"type": "json_object"})
    if anything.choices[0].finish_reason == "stop":  # a random model may run its object to max_tokens
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
    else:
        assert anything.choices[0].message.content.startswith("{")


def test_an_answer_cut_at_max_tokens_says_length(live):
    cut = live.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                temperature=0, max_tokens=3, response_format=_schema_format())
    assert cut.choices[0].finish_reason == "length"
    assert cut.choices[0].message.content.startswith("{") and not _valid(cut.choices[0].message.content)


@pytest.mark.parametrize("fmt", [{"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}},
                                 {"type": "json_schema", "json_schema": {"name": "x"}}])
def test_an_unusable_schema_is_a_400_naming_response_format(live, fmt):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        live.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, response_format=fmt)
    assert err.value.status_code == 400 and err.value.body["param"] == "response_format", err.value.body


def test_the_serve_process_constrains_across_its_front(server):
    """The real `serve` (HTTP front in its own process): the grammar made on the front reaches the engine's
    process with the request, and the answer validates; tools on a template that renders none is a 400."""
    import openai

    require_module("llguidance", "llguidance (a smolforge dependency)", "pip install -c constraints.txt llguidance==1.9.1")
    client = server.client()
    done = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=0,
                                          max_tokens=48, response_format=_schema_format())
    assert _valid(done.choices[0].message.content), done
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    assert err.value.body["param"] == "tools", err.value.body
