"""`frequency_penalty`, `presence_penalty`, `logit_bias` and `n` honoured (issue 44 item 6), on both engines.

- a penalized greedy answer is token for token the argmax of the engine's own logits less OpenAI's
  `c[j] * frequency + (c[j] > 0) * presence`, c counting the tokens generated so far (computed here by
  hand from the logits the engine's model returned); the penalties change the answer of a repetitive
  prompt, and the prompt's own tokens are not counted;
- `logit_bias` +100 on a token makes the greedy answer that token, -100 bans the greedy one;
- over HTTP: a `logit_bias` id outside the vocabulary or out of range is a 400 naming `logit_bias`;
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
def engine_model(request, served_tiny, model_copy):
    """(engine name, its BatchModel) for the serve tests' tiny model; llamacpp from its f16 export."""
    if request.param == "torch":
        yield "torch", served_tiny
        return
    from test_llamacpp_engine import require_llama_cpp

    require_llama_cpp()
    from smolforge.serve.engines import EngineSpec, load_engine

    loaded = load_engine("llamacpp", EngineSpec(model=str(model_copy), name="tiny", device="cpu", quant="f16",
                                                threads=1, max_batch=4))
    yield "llamacpp", loaded.model
    loaded.model.close()


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
