"""The OpenAI-compatible HTTP API of `smolforge serve`, and the chat page.

Routes: `POST /v1/chat/completions`, `POST /v1/completions` (both with `stream: true` as
server-sent events ending in `data: [DONE]`), `GET /v1/models`; open without the token: `/health`
and the `/chat` page shell (it reads the token from the URL fragment, which browsers never send).

Why the body is parsed here and not by FastAPI: FastAPI answers a body it cannot parse with its
own 422 shape; OpenAI clients expect `{"error": {"message", "type", "param", "code"}}`, and the
token must be checked before any body byte is read (the shared `Gate`, as on the coordinator).
Handlers are `async`: the model lives on the engine thread, and token streams come back through an
`asyncio.Queue` fed with `call_soon_threadsafe`, so no request holds a worker thread while it waits.
"""

from __future__ import annotations

import asyncio
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, StreamingResponse
from pydantic import ValidationError

from smolforge.data.encode import render
from smolforge.gate import Gate
from smolforge.pipeline.serve.batch import DoneEvent, ErrorEvent, Event, TokenEvent
from smolforge.pipeline.serve.engine import Engine, PromptTooLong
from smolforge.pipeline.serve.model import ServedModel
from smolforge.pipeline.serve.protocol import (
    DEFAULT_MAX_TOKENS,
    ApiError,
    ChatRequest,
    CompletionRequest,
    chat_chunk,
    completion_chunk,
    error_body,
    gate_error_body,
    new_id,
    now,
    sse,
    usage,
    usage_chunk,
)
from smolforge.pipeline.serve.sampling import SamplingParams

MAX_BODY_BYTES = int(os.environ.get("SMOLFORGE_SERVE_MAX_BODY_BYTES", str(4 * 2**20)))
OPEN_PATHS = ("/", "/health", "/chat")
TOKEN_FIX = "send the server's token as `Authorization: Bearer <token>` (openai.OpenAI(api_key=<token>)); " \
            "`smolforge serve` prints the file that holds it"


@lru_cache(maxsize=1)
def chat_page() -> str:
    return Path(__file__).with_name("chat.html").read_text(encoding="utf-8")


def create_app(served: ServedModel, engine: Engine, *, token: str, model_name: str | None = None) -> FastAPI:
    name = model_name or served.name
    created = now()
    app = FastAPI(title="smolforge serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Gate, token=lambda: token, open_paths=OPEN_PATHS, max_body=MAX_BODY_BYTES,
                       token_fix=TOKEN_FIX, size_fix="send a shorter prompt", error_body=gate_error_body)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, err: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(err.status_code)
        return JSONResponse(error_body(str(err.detail), "invalid_request_error", None, code),
                            status_code=err.status_code, headers=getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def _server_error(request: Request, err: Exception):
        return JSONResponse(error_body(f"internal error: {type(err).__name__}: {err}", "server_error"), status_code=500)

    # -- open routes ------------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        return {"ok": True, "service": "smolforge-serve", "model": name, "batches": engine.batches,
                "largest_batch": engine.largest_batch}

    @app.get("/")
    async def root():
        return RedirectResponse("/chat")

    @app.get("/chat", response_class=HTMLResponse)
    async def chat():
        return HTMLResponse(chat_page(), headers={"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"})

    # -- the API ----------------------------------------------------------------------------------

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "smolforge",
                                            "max_model_len": engine.max_positions}]}

    @app.get("/v1/models/{model_id:path}")
    async def model_info(model_id: str):
        _check_model(model_id, name)
        return {"id": name, "object": "model", "created": created, "owned_by": "smolforge"}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await _parse(request, ChatRequest)
        _check_model(req.model, name)
        _refuse_unsupported(req, logprobs=bool(req.logprobs))
        text = render(served.tokenizer, req.conversation(), add_generation_prompt=True)
        ids = served.tokenizer(text, add_special_tokens=False)["input_ids"]
        params = _params(engine, req, len(ids), param="messages")
        cid, stamp = new_id("chatcmpl"), now()
        if req.stream:
            return _stream(engine, ids, params, _ChatChunks(cid, stamp, name, _include_usage(req)))
        done = await _collect(engine, ids, params)
        return {"id": cid, "object": "chat.completion", "created": stamp, "model": name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": done.text},
                             "logprobs": None, "finish_reason": _reason(done)}],
                "usage": usage(done.prompt_tokens, done.completion_tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _parse(request, CompletionRequest)
        _check_model(req.model, name)
        _refuse_unsupported(req, logprobs=req.logprobs is not None)
        if req.echo:
            raise ApiError(400, "echo is not supported by smolforge serve", param="echo", code="unsupported_parameter")
        if req.suffix:
            raise ApiError(400, "suffix is not supported by smolforge serve", param="suffix", code="unsupported_parameter")
        ids = _prompt_ids(served, req.prompt)
        params = _params(engine, req, len(ids), param="prompt")
        cid, stamp = new_id("cmpl"), now()
        if req.stream:
            return _stream(engine, ids, params, _CompletionChunks(cid, stamp, name, _include_usage(req)))
        done = await _collect(engine, ids, params)
        return {"id": cid, "object": "text_completion", "created": stamp, "model": name,
                "choices": [{"index": 0, "text": done.text, "logprobs": None, "finish_reason": _reason(done)}],
                "usage": usage(done.prompt_tokens, done.completion_tokens)}

    return app


# -- request checks ---------------------------------------------------------------------------------

async def _parse(request: Request, model: type[ChatRequest] | type[CompletionRequest]):
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ApiError(400, f"{where}: {first['msg']}", param=where or None, code="invalid_value") from None


def _check_model(asked: str, name: str) -> None:
    if asked != name:
        raise ApiError(404, f"The model `{asked}` does not exist: this server serves `{name}` (see GET /v1/models)",
                       param="model", code="model_not_found")


def _refuse_unsupported(req: ChatRequest | CompletionRequest, *, logprobs: bool) -> None:
    if req.n != 1:
        raise ApiError(400, "n > 1 is not supported by smolforge serve: send n requests", param="n",
                       code="unsupported_parameter")
    if logprobs:
        raise ApiError(400, "logprobs are not supported by smolforge serve", param="logprobs",
                       code="unsupported_parameter")


def _prompt_ids(served: ServedModel, prompt: str | list[str] | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return served.tokenizer(prompt)["input_ids"]
    if prompt and all(isinstance(p, int) for p in prompt):
        vocab = len(served.tokenizer)
        if any(not 0 <= p < vocab for p in prompt):  # type: ignore[operator]
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt", code="invalid_value")
        return list(prompt)  # type: ignore[arg-type]
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return served.tokenizer(prompt[0])["input_ids"]
    raise ApiError(400, "one prompt per request (a string, a list of one string, or token ids)", param="prompt",
                   code="unsupported_parameter")


def _params(engine: Engine, req: ChatRequest | CompletionRequest, prompt_tokens: int, *, param: str) -> SamplingParams:
    asked = req.limit()
    max_tokens = asked if asked is not None else max(1, min(DEFAULT_MAX_TOKENS, engine.room(prompt_tokens)))
    try:
        engine.check_length(prompt_tokens, max_tokens)
    except PromptTooLong as err:
        raise ApiError(400, err.render().replace("\n  fix:", " Fix:"), param=param,
                       code="context_length_exceeded") from None
    return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                          stop=req.stop_list(), seed=req.seed)


def _include_usage(req: ChatRequest | CompletionRequest) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _reason(done: DoneEvent) -> str:
    return "length" if done.finish_reason == "length" else "stop"


# -- from the engine thread to the event loop --------------------------------------------------------

class _Bridge:
    """An engine sink that hands events to this event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()

    def __call__(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


async def _collect(engine: Engine, ids: list[int], params: SamplingParams) -> DoneEvent:
    bridge = _Bridge()
    request = engine.submit(ids, params, bridge)
    try:
        while True:
            event = await bridge.queue.get()
            if isinstance(event, DoneEvent):
                return event
            if isinstance(event, ErrorEvent):
                raise ApiError(500, event.message, type="server_error")
    finally:
        request.cancel()  # a no-op once done; frees the row if the client went away


class _ChatChunks:
    obj = "chat.completion.chunk"

    def __init__(self, cid: str, created: int, model: str, include_usage: bool):
        self.cid, self.created, self.model, self.include_usage = cid, created, model, include_usage

    def first(self) -> dict[str, Any] | None:
        return chat_chunk(self.cid, self.created, self.model, {"role": "assistant", "content": ""}, None)

    def text(self, text: str) -> dict[str, Any]:
        return chat_chunk(self.cid, self.created, self.model, {"content": text}, None)

    def last(self, reason: str) -> dict[str, Any]:
        return chat_chunk(self.cid, self.created, self.model, {}, reason)


class _CompletionChunks(_ChatChunks):
    obj = "text_completion"

    def first(self) -> dict[str, Any] | None:
        return None

    def text(self, text: str) -> dict[str, Any]:
        return completion_chunk(self.cid, self.created, self.model, text, None)

    def last(self, reason: str) -> dict[str, Any]:
        return completion_chunk(self.cid, self.created, self.model, "", reason)


def _stream(engine: Engine, ids: list[int], params: SamplingParams, chunks: _ChatChunks) -> StreamingResponse:
    bridge = _Bridge()
    request = engine.submit(ids, params, bridge)

    async def events() -> AsyncIterator[bytes]:
        try:
            first = chunks.first()
            if first:
                yield sse(first)
            while True:
                event = await bridge.queue.get()
                if isinstance(event, TokenEvent):
                    if event.text:
                        yield sse(chunks.text(event.text))
                elif isinstance(event, DoneEvent):
                    yield sse(chunks.last(_reason(event)))
                    if chunks.include_usage:
                        yield sse(usage_chunk(chunks.cid, chunks.created, chunks.model, chunks.obj,
                                              event.prompt_tokens, event.completion_tokens))
                    break
                else:
                    yield sse(error_body(event.message, "server_error"))
                    break
            yield sse("[DONE]")
        finally:
            request.cancel()  # the client went away mid-stream: its row leaves the batch

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
