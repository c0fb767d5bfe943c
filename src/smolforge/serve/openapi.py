"""The OpenAPI description of `smolforge serve` (`GET /openapi.json`, with the token): request bodies,
answers and errors, as the handlers produce them.

Why written out here: the handlers read their bodies themselves (the gate runs first, the depth
is checked before parsing, the parsing runs off the event loop), so FastAPI cannot see what they
take. The request models are `protocol.py`'s, put into the schema's components; the response models
below describe what the handlers return. A fuzzer (schemathesis, tests/serve/test_fuzz.py) checks
every answer against them: a route that answers what it does not describe fails there.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape: what every refusal of this server looks like."""

    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # the prompt's tokens the prefix cache served (restored, not computed)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CalledFunction(BaseModel):
    name: str
    arguments: str  # a JSON object's text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None  # None when the answer is only tool calls
    tool_calls: list[ToolCallOut] | None = None


class TopLogprob(BaseModel):
    token: str  # what the token adds to the text ("" for a token that only starts a character)
    logprob: float
    bytes: list[int] | None  # the token's own UTF-8 bytes (a byte of a character: that byte)


class TokenLogprob(TopLogprob):
    logprob: float | None  # type: ignore[assignment]  # null: a completion's echoed first prompt token
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """`logprobs: true`: each answer token's log-probability (natural log, of the model's own
    distribution: before temperature and top-p) and its `top_logprobs` most likely alternatives."""

    content: list[TokenLogprob]
    refusal: None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str  # `protocol.system_fingerprint`: version, model, adapter, engine
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    """`logprobs: k`, OpenAI's legacy shape: per token its text, log-probability, the `k` most likely
    tokens' (and its own) by text, and where its text starts in `text`. With `echo`, the prompt's tokens
    come first, the very first with nulls (nothing before it predicts it)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]
    content: list[TokenLogprob]  # the same positions in the chat shape, with bytes (as llama-server answers)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"]


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    """`ok` false (and 503) once the generation engine has stopped; `error` says why."""

    ok: bool
    service: str
    model: str
    engine: Literal["running", "stopped"]
    restarts: int
    batches: int
    largest_batch: int
    steps: int = 0
    prefill_tokens: int = 0
    prefix_hits: int = 0
    prefix_tokens_reused: int = 0
    prefix_evictions: int = 0
    prefix_entries: int = 0
    prefix_bytes: int = 0
    error: str | None = None


ERRORS = {400: "the request is not acceptable (the message says what and where)",
          401: "missing or wrong token", 404: "no such model or route", 408: "the body did not arrive in time",
          413: "the body is over the size bound", 500: "the server failed this request (the message says why)",
          503: "the generation engine stopped, or the server is at its connection bound"}
# One server-sent event: `data` holds a chunk's JSON (or an error's), the last one `[DONE]`.
STREAM = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"], "description": "one server-sent event per chunk, then `data: [DONE]`",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}}


def responses(ok: type[BaseModel], *, stream: bool = False, errors: tuple[int, ...] = tuple(ERRORS)) -> dict:
    """The `responses=` of a route: its answer (and its event stream) and the errors it can give."""
    out: dict[int | str, dict[str, Any]] = {200: {"model": ok, **({"content": STREAM} if stream else {})}}
    for status in errors:
        out[status] = {"model": ErrorResponse, "description": ERRORS[status]}
    return out


def body(model: type[BaseModel]) -> dict:
    """The `openapi_extra=` of a route that reads a JSON body of this model itself."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def install(app: FastAPI, models: list[type[BaseModel]], model_name: str) -> None:
    """Make `app.openapi()` include the request models its routes name in `body()`; their `model`
    field names the one model this server serves (any other is a 404)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(js.pop("$defs", {}))
                js["properties"]["model"]["enum"] = [model_name]
                components[model.__name__] = js
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
