"""`frequency_penalty`, `presence_penalty`, `logit_bias` and `n` honoured (issue 44 item 6), on both engines.

- a penalized greedy answer is token for token the argmax of the engine's own logits less OpenAI's
  `c[j] * frequency + (c[j] > 0) * presence`, c counting the tokens generated so far (computed here by
  hand from the logits the engine's model returned); the penalties change the answer of a repetitive
  prompt, and the prompt's own tokens are not counted;
- `logit_bias` +100 on a token makes the greedy answer that token, -100 bans the greedy one;
- over HTTP: a `logit_bias` id outside the vocabulary or out of range is a 400 naming `logit_bias`, and
  an `n` over the engine's `max_batch` one naming `n`;
  `n: 3` with a seed gives 3 choices (index 0..2, streamed and not alike) and usage summed as OpenAI
  sums it (the prompt once, every choice's tokens), through the official `openai` client.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from smolforge.serve.batch import Request
from smolforge.serve.engine import Engine
from smolforge.serve.events import DoneEvent
from smolforge.serve.sampling import SamplingParams

pytestmark = pytest.mark.timeout(300)

FREQ, PRES = 0.5, 0.5
REPETITIVE = "the the the the the the the the"


@pytest.fixture(scope="module", params=["torch", "llamacpp"])
def engine_model(request, served_tiny):
    """(engine name, its BatchModel) for the serve tests' tiny model; llamacpp from its f16 export (conftest)."""
    if request.param == "torch":
        return "torch", served_tiny
    return "llamacpp", request.getfixturevalue("lcpp_model")


def generate(model, ids: list[int], params: SamplingParams, monkeypatch=None) -> tuple[list[int], list[torch.Tensor]]:
    """One request alone on `model`: its token ids, and (with `monkeypatch`) the logits rows its
    model returned, one per sampled token (copied: llama.cpp's are views of its buffer)."""
    seen: list[torch.Tensor] = []
    if monkeypatch is not None:
        forward = model.forward

        def recording(*args: Any, **kw: Any) -> torch.Tensor:
            out = forward(*args, **kw)
            seen.append(out[0].float().clone())
            return out

        monkeypatch.setattr(model, "forward", recording)
    done: dict[int, DoneEvent] = {}
    Engine(model).run_batch([Request(ids, params, lambda e: done.__setitem__(0, e) if isinstance(e, DoneEvent)
                                     else None)])
    if monkeypatch is not None:
        monkeypatch.undo()
    return done[0].token_ids, seen


def by_hand(rows: list[torch.Tensor], freq: float, pres: float) -> list[int]:
    """OpenAI's penalties on each logits row, c[j] counting the tokens chosen before it; the argmax."""
    counts: dict[int, int] = {}
    out = []
    for row in rows:
        row = row.clone()
        for j, c in counts.items():
            row[j] -= c * freq + pres
        token = int(row.argmax())
        counts[token] = counts.get(token, 0) + 1
        out.append(token)
    return out


def test_penalties_are_openais_by_hand_from_the_engines_logits(engine_model, served_tiny, monkeypatch):
    name, model = engine_model
    ids = served_tiny.tokenizer(REPETITIVE)["input_ids"]
    plain, _ = generate(model, ids, SamplingParams(max_tokens=12, temperature=0))
    params = SamplingParams(max_tokens=12, temperature=0, frequency_penalty=FREQ, presence_penalty=PRES)
    penalized, rows = generate(model, ids, params, monkeypatch)
    assert len(rows) == len(penalized)
    assert penalized == by_hand(rows, FREQ, PRES)
    assert len(set(plain)) < len(plain) and penalized != plain  # it repeats itself; the penalties change that
    if name == "llamacpp":  # where the engines agree without penalties, they agree with them
        torch_plain, _ = generate(served_tiny, ids, SamplingParams(max_tokens=12, temperature=0))
        if torch_plain == plain:
            assert generate(served_tiny, ids, params)[0] == penalized

    # The prompt is not counted: the answer so far, sent as the prompt, is not penalized.
    seen = next(k for k in range(1, len(plain)) if plain[k] in plain[:k])  # the first token it repeated
    head = ids + plain[:seen]
    assert generate(model, head, SamplingParams(max_tokens=1, temperature=0, frequency_penalty=2,
                                                presence_penalty=2))[0] == [plain[seen]]


def test_logit_bias_forces_and_bans_a_token(engine_model, served_tiny):
    _, model = engine_model
    ids = served_tiny.tokenizer(REPETITIVE)["input_ids"]
    plain, _ = generate(model, ids, SamplingParams(max_tokens=3, temperature=0))
    chosen = next(t for t in range(100, 200) if t not in plain and t not in served_tiny.eos_ids)
    assert generate(model, ids, SamplingParams(max_tokens=3, temperature=0, logit_bias={chosen: 100}))[0] == [chosen] * 3
    banned, _ = generate(model, ids, SamplingParams(max_tokens=3, temperature=0, logit_bias={plain[0]: -100}))
    assert plain[0] not in banned


# -- over HTTP, through the official client ---------------------------------------------------------------

TOKEN = "penalties-test-token"
LONG_PROMPT = "Count the vowels of each word in this sentence and then say which word has the most of them"


@pytest.fixture(scope="module")
def live(served_tiny):
    """The torch engine and its app behind uvicorn (test_llamacpp_engine's `Live`)."""
    from test_llamacpp_engine import Live

    server = Live(served_tiny)
    yield server
    server.close()


def test_a_logit_bias_out_of_the_vocabulary_or_range_and_n_over_max_batch_are_400s_naming_them(live, served_tiny):
    import openai

    client = live.client()
    for bias in ({str(len(served_tiny.tokenizer)): 1}, {"x": 1}, {"-1": 1}, {"5": 101}):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                           logit_bias=bias)
        assert caught.value.body["param"] == "logit_bias", (bias, caught.value.body)
    with pytest.raises(openai.BadRequestError) as caught:  # more choices than the engine's rows (max_batch 4)
        client.completions.create(model="tiny", prompt="hi", max_tokens=1, n=5)
    assert caught.value.body["param"] == "n"
    forced = client.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0,
                                       logit_bias={"100": 100}, presence_penalty=0.5, frequency_penalty=-0.5)
    assert forced.choices[0].text == served_tiny.tokenizer.decode([100, 100])


def test_n_choices_with_a_seed_streamed_and_not_with_usage_summed(live):
    client = live.client()
    ask = {"model": "tiny", "messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 6,
           "temperature": 1.0, "seed": 11}
    before = dict(live.engine.counters())
    whole = client.chat.completions.create(n=3, **ask)
    after = dict(live.engine.counters())
    alone = [client.chat.completions.create(**{**ask, "seed": 11 + k}) for k in range(3)]

    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.message.content for c in whole.choices] == [a.choices[0].message.content for a in alone]
    assert len({c.message.content for c in whole.choices}) > 1  # sampled with their own seeds: not one text thrice
    prompt = alone[0].usage.prompt_tokens
    assert whole.usage.prompt_tokens == prompt >= 16  # the prompt once
    assert whole.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    # The prompt was computed once: the other two choices started from its KV (the prefix cache).
    assert after["prefill_tokens"] - before["prefill_tokens"] == prompt + 2
    assert after["prefix_hits"] - before["prefix_hits"] == 2

    texts, reasons, usage = {}, {}, None
    for chunk in client.chat.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **ask):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    assert [texts[k] for k in range(3)] == [c.message.content for c in whole.choices]
    assert [reasons[k] for k in range(3)] == [c.finish_reason for c in whole.choices]
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)

    legacy = client.completions.create(model="tiny", prompt="hi", max_tokens=3, temperature=1.0, seed=5, n=2)
    streamed = {}
    for chunk in client.completions.create(model="tiny", prompt="hi", max_tokens=3, temperature=1.0, seed=5, n=2,
                                           stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [c.index for c in legacy.choices] == [0, 1] and [streamed[0], streamed[1]] == [c.text for c in legacy.choices]


def test_each_row_keeps_its_own_settings_as_rows_join_and_leave(engine_model, served_tiny):
    """Rows with different penalties and biases, prefilled at different steps (a small step budget: each
    joins the running batch) and leaving at different steps (max_tokens): each row's tokens are its own
    alone, so each row's counts went with it, not with its place in the batch."""
    _, model = engine_model
    texts = ["the the the the the the the the", "What is 2 + 3? What is", "sum of the of and to in", "hello hello"]
    ids = [served_tiny.tokenizer(t)["input_ids"] for t in texts]
    params = [SamplingParams(max_tokens=10, temperature=0, frequency_penalty=FREQ, presence_penalty=PRES),
              SamplingParams(max_tokens=3, temperature=0),
              SamplingParams(max_tokens=5, temperature=0, logit_bias={150: 100}, frequency_penalty=2),
              SamplingParams(max_tokens=8, temperature=0, presence_penalty=2)]
    alone = [generate(model, i, p)[0] for i, p in zip(ids, params)]
    done: dict[int, DoneEvent] = {}
    engine = Engine(model, step_tokens=12)
    engine.run_batch([Request(i, p, (lambda k: lambda e: done.__setitem__(k, e) if isinstance(e, DoneEvent)
                                     else None)(k)) for k, (i, p) in enumerate(zip(ids, params))])
    assert [done[k].token_ids for k in range(len(ids))] == alone
    assert engine.largest_batch >= 3 and alone[2][0] == 150
