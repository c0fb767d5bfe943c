"""The serve app in-process (httpx over ASGI, one event loop): large prompts are tokenized off the event
loop, a stopped engine shows in `/health` (503), requests held behind a busy engine form one batch,
and the OpenAPI description needs the token. Every wait is on an event the test controls."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any, Awaitable, Callable

import httpx
import pytest

from smolforge.data.encode import ensure_chat_template
from smolforge.serve.api import create_app
from smolforge.serve.engine import Engine

from test_serve_engine import Held

pytestmark = pytest.mark.timeout(300)

TOKEN = "in-process-token-28"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MB = 2**20


def chat(content: str, **kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 6, **kw}


async def until(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    """Wait on the event loop until `condition()` (a guard against a hang, not a measurement)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.01)


def run_client(app, scenario: Callable[[httpx.AsyncClient], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://serve", headers=AUTH, timeout=120) as c:
            return await scenario(c)

    return asyncio.run(main())


class HeldTokenizer:
    """The served tokenizer, except that a text over `big` characters stays inside the tokenizer until
    the test releases it (then it is `tokens` tokens long)."""

    def __init__(self, inner: Any, big: int, tokens: int = 600):
        ensure_chat_template(inner)
        self.inner, self.big, self.tokens = inner, big, tokens
        self.inside = 0
        self.timed_out = False
        self.release = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, text: str, **kw: Any) -> Any:
        if len(text) <= self.big:
            return self.inner(text, **kw)
        with self._lock:
            self.inside += 1
        if not self.timed_out and not self.release.wait(20):
            self.timed_out = True  # nothing released it: the event loop itself was waiting here
        return {"input_ids": [1] * self.tokens}

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_health_and_a_small_request_are_answered_while_large_prompts_are_tokenized(served_tiny):
    """Ten 1 MB prompts: the large-body lane's workers are held inside the tokenizer (the rest queue
    behind them) while `/health` and a small chat request are answered; then all ten get their 400.
    The engine's context is made long enough that 1 MB of text might fit (else it is refused before
    tokenizing: the next test); the held tokenizer then says it did not."""
    context = 100_000
    tok = HeldTokenizer(served_tiny.tokenizer, big=100_000, tokens=context + 1)
    served = dataclasses.replace(served_tiny, tokenizer=tok)
    engine = Engine(served, max_positions=context).start()
    app = create_app(served, engine, token=TOKEN, model_name="tiny")
    lanes = app.state.lanes

    async def scenario(c: httpx.AsyncClient):
        big = [asyncio.create_task(c.post("/v1/chat/completions", json=chat("word " * (MB // 5)))) for _ in range(10)]
        await until(lambda: tok.inside == lanes.large_workers or tok.timed_out, "the large lane is busy tokenizing")
        health = await c.get("/health")
        small = await c.post("/v1/chat/completions", json=chat("What is 2 + 3?"))
        meanwhile = (tok.inside, sum(not t.done() for t in big), tok.release.is_set(), tok.timed_out)
        tok.release.set()
        return health, small, meanwhile, await asyncio.gather(*big)

    try:
        health, small, meanwhile, answers = run_client(app, scenario)
    finally:
        tok.release.set()
        engine.stop()
    inside, pending, released, timed_out = meanwhile
    assert not timed_out, "a held tokenization was never released: it ran on the event loop and blocked it"
    assert health.status_code == 200 and health.json()["ok"]
    assert small.status_code == 200 and small.json()["choices"][0]["message"]["content"]
    assert (inside, pending, released) == (lanes.large_workers, 10, False)  # all ten still in progress
    assert [a.status_code for a in answers] == [400] * 10
    assert {a.json()["error"]["code"] for a in answers} == {"context_length_exceeded"}
    assert tok.inside == 10


def test_a_prompt_too_long_in_characters_is_refused_before_tokenizing(served_tiny):
    """The tiny model's 512 tokens hold at most 4 x 13 x 512 characters (13: its longest token): a 1 MB
    prompt is refused on its length alone, chat or completion, and the tokenizer never sees it."""
    tok = HeldTokenizer(served_tiny.tokenizer, big=100_000)
    tok.release.set()
    served = dataclasses.replace(served_tiny, tokenizer=tok)
    engine = Engine(served)  # never started: the refusal comes first
    app = create_app(served, engine, token=TOKEN, model_name="tiny")

    async def scenario(c: httpx.AsyncClient):
        return (await c.post("/v1/chat/completions", json=chat("word " * (MB // 5))),
                await c.post("/v1/completions", json={"model": "tiny", "prompt": "x" * MB}))

    for r in run_client(app, scenario):
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded" and "characters" in err["message"]
    assert tok.inside == 0


def test_a_stopped_engine_is_503_on_health_and_requests(served_tiny, monkeypatch):
    engine = Engine(served_tiny)

    def boom(*_):
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "step", boom)
    monkeypatch.setattr(engine, "_recover", boom)
    engine.start()
    app = create_app(served_tiny, engine, token=TOKEN, model_name="tiny")

    async def scenario(c: httpx.AsyncClient):
        first = await c.post("/v1/chat/completions", json=chat("hi"))  # the request the dying loop held
        await until(lambda: not engine._thread.is_alive(), "the engine thread ended")
        return first, await c.get("/health"), await c.post("/v1/chat/completions", json=chat("hi"))

    first, health, later = run_client(app, scenario)
    assert first.status_code == 503 and "boom" in first.json()["error"]["message"]
    assert health.status_code == 503
    body = health.json()
    assert body["ok"] is False and body["engine"] == "stopped" and "RuntimeError: boom" in body["error"]
    assert later.status_code == 503 and later.json()["error"]["code"] == "engine_stopped"


def test_requests_held_behind_a_busy_engine_are_one_batch(served_tiny):
    """Eight chat requests through the API while the engine is busy: released, they run as one batch,
    and each gets the answer it gets alone."""
    engine = Engine(served_tiny, max_batch=8).start()
    app = create_app(served_tiny, engine, token=TOKEN, model_name="tiny")
    questions = ["What is 1 + 1?", "Reverse abc", "sum of the list", "Uppercase word", "count vowels in code",
                 "what is the first character", "the of and to in is you that it", "python def return print"]

    async def scenario(c: httpx.AsyncClient):
        held = await asyncio.to_thread(Held, engine, served_tiny.tokenizer("hold")["input_ids"])
        before = engine.batches
        asked = [asyncio.create_task(c.post("/v1/chat/completions", json=chat(q, max_tokens=12))) for q in questions]
        await until(lambda: engine._queue.qsize() == len(questions), "all eight are queued")
        held.release()
        together = await asyncio.gather(*asked)
        batches, largest = engine.batches - before, engine.largest_batch
        alone = [await c.post("/v1/chat/completions", json=chat(q, max_tokens=12)) for q in questions]
        return together, (batches, largest), alone

    try:
        together, (batches, largest), alone = run_client(app, scenario)
    finally:
        engine.stop()
    assert (batches, largest) == (1, len(questions))
    texts = [r.json()["choices"][0]["message"]["content"] for r in together]
    assert texts == [r.json()["choices"][0]["message"]["content"] for r in alone]
    assert len(set(texts)) > 1  # different answers: a mix-up between rows would show


def test_the_openapi_description_needs_the_token_and_names_the_model(served_tiny):
    engine = Engine(served_tiny)  # never started: describing the API needs no engine
    app = create_app(served_tiny, engine, token=TOKEN, model_name="tiny")

    async def scenario(c: httpx.AsyncClient):
        return await c.get("/openapi.json", headers={"Authorization": ""}), await c.get("/openapi.json")

    refused, schema = run_client(app, scenario)
    assert refused.status_code == 401
    body = schema.json()["components"]["schemas"]
    assert body["ChatRequest"]["properties"]["model"]["enum"] == ["tiny"]
    assert body["ChatRequest"]["properties"]["seed"]["anyOf"][0]["maximum"] == 2**63 - 1


def test_the_prefix_cache_is_counted_in_health_and_metrics(served_tiny):
    """Two chats with one long system prompt: the second starts from the first's KV; /health and
    /metrics (behind the token) count the hit and the tokens reused."""
    system = ("You are a careful assistant. Answer briefly, in plain words, and say when you do not know the "
              "answer; never guess a number you were not given.")
    engine = Engine(served_tiny).start()
    app = create_app(served_tiny, engine, token=TOKEN, model_name="tiny")

    def turn(question: str) -> dict[str, Any]:
        return {**chat(question), "messages": [{"role": "system", "content": system},
                                               {"role": "user", "content": question}]}

    async def scenario(c: httpx.AsyncClient):
        for question in ("What is 2 + 3?", "Reverse abc"):
            assert (await c.post("/v1/chat/completions", json=turn(question))).status_code == 200
        return (await c.get("/health")).json(), await c.get("/metrics"), await c.get("/metrics", headers={
            "Authorization": "Bearer wrong"})

    try:
        health, metrics, refused = run_client(app, scenario)
    finally:
        engine.stop()
    assert health["prefix_hits"] == 1 and health["prefix_tokens_reused"] >= 30 and health["prefix_entries"] == 2
    assert f"smolforge_serve_prefix_tokens_reused {health['prefix_tokens_reused']}\n" in metrics.text
    assert "# TYPE smolforge_serve_prefix_hits counter" in metrics.text and refused.status_code == 401
