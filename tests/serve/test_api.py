"""`smolforge serve` as a real process, driven by the official `openai` client and raw HTTP."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from helpers import MB, post_raw, tree_rss_mb

pytestmark = pytest.mark.timeout(300)

QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


def streamed_chat(client, model: str, messages, **kw) -> tuple[str, int, list]:
    chunks = list(client.chat.completions.create(model=model, messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage]
    streamed_chat.fingerprints = {c.system_fingerprint for c in chunks}  # type: ignore[attr-defined]
    return text, sum(1 for c in chunks if c.choices and c.choices[0].delta.content), usage


def test_openai_client_stream_equals_non_stream(server):
    client = server.client()
    assert [m.id for m in client.models.list()] == [server.model]
    whole = client.chat.completions.create(model=server.model, messages=QUESTION, temperature=0, max_tokens=24)
    text, pieces, usage = streamed_chat(client, server.model, QUESTION, temperature=0, max_tokens=24)
    assert whole.choices[0].message.content and text == whole.choices[0].message.content
    assert pieces > 1  # it came token by token, not in one piece
    assert whole.choices[0].finish_reason in ("stop", "length")
    u = whole.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 24 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert usage and usage[-1].completion_tokens == u.completion_tokens and usage[-1].prompt_tokens == u.prompt_tokens
    # counted exactly in test_llamacpp_engine.py (both engines); here: through the front process, streamed and not
    assert u.prompt_tokens_details.cached_tokens >= 0 and usage[-1].prompt_tokens_details.cached_tokens >= 0

    done = client.completions.create(model=server.model, prompt="the of and to", temperature=0, max_tokens=12)
    assert done.object == "text_completion" and done.choices[0].text
    assert done.usage.completion_tokens <= 12
    # serve's fingerprint (model, engine, version) reaches the front process: one string, on every answer and chunk
    from smolforge.serve.protocol import system_fingerprint

    assert streamed_chat.fingerprints == {whole.system_fingerprint} == {done.system_fingerprint}
    assert whole.system_fingerprint.startswith("fp_") and whole.system_fingerprint != \
        system_fingerprint(server.model, "FrontModel")  # not the front's own default
    stream = client.completions.create(model=server.model, prompt="the of and to", temperature=0, max_tokens=12,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == done.choices[0].text


def test_raw_sse_chunks_have_openai_shape(server):
    body = {"model": server.model, "messages": QUESTION, "stream": True, "temperature": 0, "max_tokens": 5}
    with httpx.stream("POST", f"{server.base}/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {server.token}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_eight_concurrent_streams_each_get_their_own_text(server):
    client = server.client()
    questions = [[{"role": "user", "content": q}] for q in
                 ["What is 1 + 1?", "Reverse abc", "sum of the list", "Uppercase word", "count vowels in code",
                  "what is the first character", "the of and to in is you that it he was", "python def return print"]]
    alone = [client.chat.completions.create(model=server.model, messages=q, temperature=0, max_tokens=20)
             .choices[0].message.content for q in questions]
    assert len(set(alone)) == len(alone)  # eight different answers: a mix-up would show
    # Whether they share a batch depends on when they arrive: test_api_app.py proves batching through
    # the API with the engine held, so that no clock decides it; here each must get its own text.
    results: dict[int, str] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(questions))

    def ask(i: int) -> None:
        try:
            start.wait(timeout=30)
            results[i] = streamed_chat(client, server.model, questions[i], temperature=0, max_tokens=20)[0]
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert [results[i] for i in range(len(questions))] == alone


def test_bad_requests_get_openai_errors(server):
    auth = {"Authorization": f"Bearer {server.token}"}
    url = f"{server.base}/v1/chat/completions"

    def check(r: httpx.Response, status: int, code: str | None) -> dict:
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert err["code"] == code, err
        return err

    check(httpx.post(url, headers=auth, json={"model": "gpt-9", "messages": QUESTION}), 404, "model_not_found")
    check(httpx.post(f"{server.base}/v1/completions", headers=auth, json={"model": "gpt-9", "prompt": "x"}), 404,
          "model_not_found")
    err = check(httpx.post(url, headers=auth, json={"model": server.model, "messages": QUESTION, "max_tokens": 600}),
                400, "context_length_exceeded")
    assert "512" in err["message"] and err["param"] == "messages"
    long_prompt = "the of and to " * 400
    check(httpx.post(f"{server.base}/v1/completions", headers=auth,
                     json={"model": server.model, "prompt": long_prompt}), 400, "context_length_exceeded")
    check(httpx.post(url, headers={**auth, "Content-Type": "application/json"}, content=b"{not json"), 400, "invalid_json")
    err = check(httpx.post(url, headers=auth, json={"model": server.model, "messages": "hi"}), 400, "invalid_value")
    assert err["param"].startswith("messages")
    err = check(httpx.post(url, headers=auth, json={"model": server.model, "messages": QUESTION,
                                                    "logit_bias": {"1000000": 5}}), 400, "invalid_value")
    assert err["param"] == "logit_bias"
    # n and logit_bias honoured, across the front process's channel (its JSON makes the bias's ids strings)
    two = httpx.post(url, headers=auth, json={"model": server.model, "messages": QUESTION, "n": 2, "temperature": 0,
                                              "max_tokens": 2, "logit_bias": {"100": 100}}, timeout=60).json()
    assert [c["index"] for c in two["choices"]] == [0, 1] and two["usage"]["completion_tokens"] == 4, two
    err = check(httpx.post(url, json={"model": server.model, "messages": QUESTION}), 401, "invalid_api_key")
    assert err["type"] == "authentication_error"
    check(httpx.post(url, headers={"Authorization": "Bearer wrong"}, content=b"{not json"), 401, "invalid_api_key")
    check(httpx.get(f"{server.base}/v1/models"), 401, "invalid_api_key")
    # the router's own refusals too (a newline in a model id matches no route: found by schemathesis)
    check(httpx.get(f"{server.base}/v1/models/a%0Ab", headers=auth), 404, "not_found")
    check(httpx.delete(f"{server.base}/v1/models", headers=auth), 405, "method_not_allowed")
    # the official client sees the same as typed exceptions
    import openai

    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="gpt-9", messages=QUESTION)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.base}/v1", api_key="wrong", max_retries=0).models.list()
    # the page shell is open; it holds nothing but the script
    page = httpx.get(f"{server.base}/chat")
    assert page.status_code == 200 and "smolforge chat" in page.text and server.token not in page.text


def _post_raw(port: int, body_bytes: int, token: str | None = None, chunked: bool = False) -> tuple[int, int]:
    return post_raw(port, "/v1/chat/completions", body_bytes, token=token, chunked=chunked)


def test_a_50_mb_body_without_the_token_is_refused_unread(server):
    pid = server.proc.pid
    before = tree_rss_mb(pid)
    for token in (None, "wrong"):
        status, sent = _post_raw(server.port, 50 * MB, token=token)
        assert status == 401
    assert _post_raw(server.port, 50 * MB, chunked=True)[0] == 401
    grown = tree_rss_mb(pid) - before
    assert grown < 20, f"the server grew by {grown:.0f} MB on bodies it should not have read"
    # with the token, a body over the 4 MiB bound is refused too (413), declared or streamed
    assert _post_raw(server.port, 50 * MB, token=server.token)[0] == 413
    assert _post_raw(server.port, 6 * MB, token=server.token, chunked=True)[0] == 413
    assert httpx.get(f"{server.base}/health").status_code == 200  # still serving
