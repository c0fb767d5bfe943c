"""The OpenAI-compatible HTTP API of `smolforge serve`, and the chat page.

Routes: `POST /v1/chat/completions`, `POST /v1/completions` (both with `stream: true` as
server-sent events ending in `data: [DONE]`), `GET /v1/models`, `GET /openapi.json`; open without
the token: `/health` (503 once the engine has stopped) and the `/chat` page shell (it reads the
token from the URL fragment, which browsers never send).

Why the body is parsed here and not by FastAPI: FastAPI answers a body it cannot parse with its
own 422 shape; OpenAI clients expect `{"error": {"message", "type", "param", "code"}}`, and the
token must be checked before any body byte is read (the shared `Gate`, as on the coordinator).
Handlers are `async` and only move bytes: the body's parsing, the chat template and the tokenizer
run in `intake.Lanes` (bounded thread pools), the model on the engine thread, and token streams
come back through `streams.py`, so neither a large prompt nor a long answer holds the event loop.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse, StreamingResponse
from starlette.exceptions import HTTPException  # the router's own 404/405 too, not only FastAPI's subclass

from smolforge.train.rendering import render_prompt
from smolforge.gate import Gate
from smolforge.http_limits import page_headers
from smolforge.serve import openapi
from smolforge.serve.events import DoneEvent, EngineStopped, PromptTooLong
from smolforge.serve.intake import Lanes, char_bound, read_json, validate
from smolforge.models.token_bytes import vocab_bytes
from smolforge.serve.logprobs import TokenText, chat_logprobs, completion_logprobs
from smolforge.serve.protocol import (
    DEFAULT_MAX_TOKENS,
    ApiError,
    ChatRequest,
    CompletionRequest,
    error_body,
    gate_error_body,
    new_id,
    now,
    system_fingerprint,
    usage,
)
from smolforge.serve.sampling import SamplingParams
from smolforge.models.families import abilities, family_of
from smolforge.serve.structured import lark_grammar, response_grammar, response_grammar_wanted
from smolforge.serve.tools import ToolChunks, ToolPlan, chat_choice, plan_of
from smolforge.serve.streams import (
    ChatChunks,
    CompletionChunks,
    choice_params,
    collect_choices,
    reason,
    stream,
    stream_choices,
)

if TYPE_CHECKING:  # an Engine, or in the HTTP front process its handle (`channel.RemoteEngine`); a ServedModel,
    # or there `front.FrontModel` (the name and the tokenizer: all the HTTP side reads of the model)
    from smolforge.serve.engine import Engine
    from smolforge.serve.model import ServedModel

MAX_BODY_BYTES = int(os.environ.get("SMOLFORGE_SERVE_MAX_BODY_BYTES", str(4 * 2**20)))
# A body must arrive whole within this (408 after); `http_limits` closes one that stalls, this bounds a trickle.
BODY_TIMEOUT_S = float(os.environ.get("SMOLFORGE_SERVE_BODY_TIMEOUT_S", "30"))
OPEN_PATHS = ("/", "/health", "/chat")
TOKEN_FIX = "send the server's token as `Authorization: Bearer <token>` (openai.OpenAI(api_key=<token>)); " \
            "`smolforge serve` prints the file that holds it"


@lru_cache(maxsize=1)
def chat_page() -> str:
    return Path(__file__).with_name("chat.html").read_text(encoding="utf-8")


@dataclass
class Prepared:
    """A request checked and tokenized (in a lane), ready for the engine; `echo_text`: the prompt's text
    when a completion echoes it."""

    req: ChatRequest | CompletionRequest
    ids: list[int]
    params: SamplingParams
    echo_text: str | None = None
    tools: ToolPlan | None = None  # the chat request's tools and tool_choice (serve/tools.py)


def _names(served: ServedModel, job: Prepared) -> TokenText | None:
    """The token texts of this request's log-probabilities, after its prompt (None: none asked for).
    A completion that echoes starts empty: its prompt's own log-probabilities come first."""
    if job.params.logprobs is None:
        return None
    return TokenText(served.tokenizer, [] if job.params.prompt_logprobs else list(job.ids))


def _completion_logprobs(names: TokenText | None, job: Prepared, done: DoneEvent) -> dict[str, Any] | None:
    """A whole completion's legacy `logprobs` (with echo, the prompt's positions first)."""
    if names is None:
        return None
    if job.params.prompt_logprobs:
        return completion_logprobs(names, [*(done.prompt_logprobs or []), *(done.logprobs or [])], 0, job.ids[0])
    return completion_logprobs(names, list(done.logprobs or []))


def create_app(served: ServedModel, engine: Engine, *, token: str, model_name: str | None = None,
               lanes: Lanes | None = None, fingerprint: str | None = None) -> FastAPI:
    """The app serving `served` through `engine`. `fingerprint`: every answer's `system_fingerprint`
    (`protocol.system_fingerprint` of what `serve` loaded; default: of the model's name and class)."""
    name = model_name or served.name
    fingerprint = fingerprint or system_fingerprint(name, type(served).__name__)
    vocab_bytes(served.tokenizer)  # each id's bytes made now (0.3 s for 150k ids), not on the event loop later
    created = now()
    lanes = lanes or Lanes()
    app = FastAPI(title="smolforge serve", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.lanes = lanes
    app.add_middleware(Gate, token=lambda: token, open_paths=OPEN_PATHS, max_body=MAX_BODY_BYTES,
                       token_fix=TOKEN_FIX, size_fix="send a shorter prompt", error_body=gate_error_body)
    _error_handlers(app)
    openapi.install(app, [ChatRequest, CompletionRequest], name)
    ctx = Served(served, engine, name, char_bound(served.tokenizer, engine.max_positions))
    authed = (400, 401, 404, 408, 413, 500, 503)

    @app.get("/health", responses={200: {"model": openapi.Health}, 503: {"model": openapi.Health}})
    async def health():
        body = _health(engine, name)
        return JSONResponse(body, status_code=200 if body["ok"] else 503)

    @app.get("/metrics", response_class=PlainTextResponse, responses={401: {}})
    async def metrics():
        # off the event loop: a staged model asks each stage for its counters (a network call per remote stage)
        return PlainTextResponse(await asyncio.to_thread(metrics_text, engine), media_type="text/plain; version=0.0.4")

    @app.get("/", include_in_schema=False)
    async def root():
        return RedirectResponse("/chat")

    @app.get("/chat", response_class=HTMLResponse)
    async def chat():
        return HTMLResponse(chat_page(), headers=page_headers(chat_page()))

    @app.get("/v1/models", responses=openapi.responses(openapi.ModelList, errors=(401,)))
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "smolforge",
                                            "max_model_len": engine.max_positions}]}

    @app.get("/v1/models/{model_id:path}", responses=openapi.responses(openapi.ModelCard, errors=(401, 404)))
    async def model_info(model_id: str):
        _check_model(model_id, name)
        return {"id": name, "object": "model", "created": created, "owned_by": "smolforge"}

    @app.post("/v1/chat/completions", responses=openapi.responses(openapi.ChatCompletion, stream=True, errors=authed),
              openapi_extra=openapi.body(ChatRequest))
    async def chat_completions(request: Request):
        raw = await _body(request)
        job = await lanes.run(len(raw), _prepare_chat, raw, ctx)
        cid, stamp = new_id("chatcmpl"), now()
        if job.req.stream:
            held = job.tools is not None and job.tools.choice != "none"
            return _streamed(engine, job, lambda: ToolChunks(cid, stamp, name, _include_usage(job.req), job.tools,
                                                             fingerprint=fingerprint)
                             if held else ChatChunks(cid, stamp, name, _include_usage(job.req), _names(served, job),
                                                     fingerprint=fingerprint))
        dones = await collect_choices(engine, job.ids, choice_params(job.params, job.req.n))
        return {"id": cid, "object": "chat.completion", "created": stamp, "model": name,
                "system_fingerprint": fingerprint,
                "choices": [_chat_choice(served, job, k, d) for k, d in enumerate(dones)], "usage": _usage(dones)}

    @app.post("/v1/completions", responses=openapi.responses(openapi.Completion, stream=True, errors=authed),
              openapi_extra=openapi.body(CompletionRequest))
    async def completions(request: Request):
        raw = await _body(request)
        job = await lanes.run(len(raw), _prepare_completion, raw, ctx)
        cid, stamp = new_id("cmpl"), now()
        echo = (job.echo_text, job.ids) if job.echo_text is not None else None
        if job.req.stream:
            return _streamed(engine, job, lambda: CompletionChunks(cid, stamp, name, _include_usage(job.req),
                                                                   _names(served, job), echo, fingerprint=fingerprint))
        dones = await collect_choices(engine, job.ids, choice_params(job.params, job.req.n))
        return {"id": cid, "object": "text_completion", "created": stamp, "model": name,
                "system_fingerprint": fingerprint,
                "choices": [{"index": k, "text": (job.echo_text or "") + done.text,
                             "logprobs": _completion_logprobs(_names(served, job), job, done),
                             "finish_reason": reason(done)} for k, done in enumerate(dones)],
                "usage": _usage(dones)}

    return app


def _streamed(engine: Engine, job: Prepared, chunks: Callable[[], ChatChunks]) -> StreamingResponse:
    """The answer's event stream: one choice (`stream`), or `n` (`stream_choices`, each its own `chunks()`)."""
    if job.req.n == 1:
        return stream(engine, job.ids, job.params, chunks())
    return stream_choices(engine, job.ids, choice_params(job.params, job.req.n), [chunks() for _ in range(job.req.n)],
                          _include_usage(job.req))


def _chat_choice(served: ServedModel, job: Prepared, index: int, done: DoneEvent) -> dict[str, Any]:
    """Choice `index` of a non-streamed chat answer (its tool calls parsed, its log-probabilities when asked)."""
    names = _names(served, job)
    logprobs = chat_logprobs(names, done.logprobs or []) if names is not None else None
    return {**chat_choice(done.text, reason(done), job.tools), "index": index, "logprobs": logprobs}


def _usage(dones: list[DoneEvent]) -> dict[str, Any]:
    """A request's usage over its choices, as OpenAI counts it: the prompt once (its cached tokens the first
    choice's), every choice's tokens."""
    return usage(dones[0].prompt_tokens, sum(d.completion_tokens for d in dones), dones[0].cached_tokens)


def _error_handlers(app: FastAPI) -> None:
    """Every refusal in OpenAI's shape: ours (ApiError), Starlette's (404, 405, 413) and the rest (500)."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(EngineStopped)
    async def _engine_stopped(request: Request, err: EngineStopped):
        return JSONResponse(error_body(err.render().replace("\n  fix:", " Fix:"), "server_error", None,
                                       "engine_stopped"), status_code=503)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, err: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(err.status_code)
        return JSONResponse(error_body(str(err.detail), "invalid_request_error", None, code),
                            status_code=err.status_code, headers=getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def _server_error(request: Request, err: Exception):
        return JSONResponse(error_body(f"internal error: {type(err).__name__}: {err}", "server_error"), status_code=500)


def _health(engine: Engine, name: str) -> dict[str, Any]:
    alive = engine.alive
    return {"ok": alive, "service": "smolforge-serve", "model": name, "engine": "running" if alive else "stopped",
            "restarts": engine.restarts, **engine.counters(),
            "error": None if alive else f"the generation engine stopped: {engine.failure or 'not running'}; "
                                        "restart the server"}


def metrics_text(engine: Engine) -> str:
    """The engine's counters in Prometheus' text format (`smolforge_serve_<counter>`), one per line; a staged
    model's (`serve --stages`) also each stage's, `smolforge_serve_stage_<counter>{stage="<index>"}` (`stage_lines`).
    Blocks while remote stages answer (each within its scrape bound, never a step's): call it off the event loop."""
    lines = []
    for key, value in {"up": int(engine.alive), "restarts": engine.restarts, **engine.counters()}.items():
        kind = "gauge" if key in GAUGES else "counter"
        lines += [f"# HELP smolforge_serve_{key} {METRIC_HELP.get(key, key.replace('_', ' '))}",
                  f"# TYPE smolforge_serve_{key} {kind}", f"smolforge_serve_{key} {value}"]
    infos = engine.stage_infos()  # [] without stages (one process, llama.cpp, the front process's handle)
    return "\n".join(lines + (stage_lines(infos) if infos else [])) + "\n"


def stage_lines(stages: list[dict[str, Any] | None]) -> list[str]:
    """Per-stage samples of the stages' `info()`s (`StagedModel.stage_infos`) with a `stage` label (its index
    from 0): `smolforge_serve_stage_up` 1 for a stage that answered, 0 for one that did not (`None`: its other
    samples are left out, not reported as 0), then each of `STAGE_METRIC_HELP` for the stages that answered.
    A stage re-placed counts from 0 again (a counter reset, as Prometheus' `rate` reads one)."""
    lines = ["# HELP smolforge_serve_stage_up 1 while the stage answers", "# TYPE smolforge_serve_stage_up gauge"]
    lines += [f'smolforge_serve_stage_up{{stage="{i}"}} {int(c is not None)}' for i, c in enumerate(stages)]
    for key, (kind, words) in STAGE_METRIC_HELP.items():
        lines += [f"# HELP smolforge_serve_stage_{key} {words}", f"# TYPE smolforge_serve_stage_{key} {kind}"]
        lines += [f'smolforge_serve_stage_{key}{{stage="{i}"}} {int(c.get(key, 0))}' for i, c in enumerate(stages)
                  if c is not None]
    return lines


GAUGES = ("up", "largest_batch", "prefix_entries", "prefix_bytes")
METRIC_HELP = {"up": "1 while the generation engine runs", "batches": "batches started on an idle engine",
               "largest_batch": "most rows generated together", "steps": "scheduling steps (prefill and decode)",
               "prefill_tokens": "prompt tokens computed (padding included)",
               "prefix_hits": "prompts started from a kept prefix", "prefix_tokens_reused": "prompt tokens restored, "
               "not computed", "prefix_evictions": "kept prefixes evicted (least recently used)",
               "prefix_entries": "prefixes kept now", "prefix_bytes": "bytes the kept prefixes hold"}
# `serve --stages`: what each stage counts, as its `StageServer.info()` names it: (Prometheus type, help)
STAGE_METRIC_HELP = {
    "tokens": ("counter", "positions the stage's layers computed (prompts and answers, padding included)"),
    "prefix_tokens_reused": ("counter", "prompt positions the stage restored from its share of a kept prefix, "
                                        "not computed"),
    "prefix_entries": ("gauge", "kept prefixes whose K/V share the stage holds now"),
    "prefix_bytes": ("gauge", "bytes of the stage's share of the kept prefixes")}


async def _body(request: Request) -> bytes:
    """The body, within BODY_TIMEOUT_S (a client that sends its body slowly holds a connection)."""
    try:
        return await asyncio.wait_for(request.body(), BODY_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s", code="request_timeout") \
            from None


# -- in a lane: parse, check, render, tokenize --------------------------------------------------------

@dataclass
class Served:
    """What the lanes need to prepare a request: the model, its engine, its name, the prompt bound."""

    model: ServedModel
    engine: Engine
    name: str
    max_chars: int | None  # `intake.char_bound`: longer prompts cannot fit the context


def _prepare_chat(raw: bytes, s: Served) -> Prepared:
    req = validate(ChatRequest, read_json(raw))
    _check_model(req.model, s.name)
    _refuse_unsupported(req)
    plan = _tool_plan(req, s)
    try:
        text = render_prompt(s.model.tokenizer, _conversation(req), tools=plan.tools if plan else None)
    except _template_errors() as err:  # the template refuses this conversation (roles out of order)
        raise ApiError(400, f"the model's chat template refuses these messages: {err}", param="messages",
                       code="invalid_value") from None
    ids = _tokenize(s, text, "messages", add_special_tokens=False)
    params = _params(s.engine, req, len(ids), param="messages", vocab=len(s.model.tokenizer))
    params.grammar = _grammar(req, plan)
    return Prepared(req, ids, params, tools=plan)


def _conversation(req: ChatRequest) -> list[dict[str, Any]]:
    try:
        return req.conversation()
    except ValueError as err:  # a history call's arguments that are not a JSON object
        raise ApiError(400, str(err), param="messages", code="invalid_value") from None


def _tool_plan(req: ChatRequest, s: Served) -> ToolPlan | None:
    """`tools`/`tool_choice` as the family's format and the template's ability allow (400 naming the field)."""
    try:
        plan = plan_of(req, family_of(s.model.model_type).tool_calls, s.model.tokenizer)
    except ValueError as err:
        raise ApiError(400, str(err), param="tool_choice", code="invalid_value") from None
    if plan is not None and not abilities(s.model.tokenizer).tools:
        raise ApiError(400, "this model's chat template renders no tools, so it was never shown how to call one. "
                            "Fix: serve a model whose template takes tools (Qwen2.5, Llama 3.1), or send no tools",
                       param="tools", code="unsupported_parameter")
    return plan


def _grammar(req: ChatRequest, plan: ToolPlan | None) -> str | None:
    """The grammar the answer must follow (a forced tool call, or `response_format`), checked here: 400."""
    lark = plan.grammar_lark() if plan is not None else None
    param = "tool_choice" if lark is not None else "response_format"
    if lark is not None and response_grammar_wanted(req.response_format):
        raise ApiError(400, "response_format and a forced tool_choice cannot both shape one answer", param=param,
                       code="unsupported_parameter")
    try:
        return lark_grammar(lark) if lark is not None else response_grammar(req.response_format)
    except Exception as err:  # noqa: BLE001 - a client's schema the compiler refuses, or no llguidance: a 400
        raise ApiError(400, f"{err}", param=param, code="invalid_value") from None


def _prepare_completion(raw: bytes, s: Served) -> Prepared:
    req = validate(CompletionRequest, read_json(raw))
    _check_model(req.model, s.name)
    _refuse_unsupported(req)
    ids = _prompt_ids(s, req.prompt)
    echo = _prompt_text(s, req.prompt, ids) if req.echo else None
    return Prepared(req, ids, _params(s.engine, req, len(ids), param="prompt", vocab=len(s.model.tokenizer)), echo)


def _tokenize(s: Served, text: str, param: str, **kw: Any) -> list[int]:
    """The text's token ids; a text too long in characters to fit the context is refused untokenized."""
    if s.max_chars is not None and len(text) > s.max_chars:
        raise ApiError(400, f"the prompt has {len(text)} characters: more than the model's context of "
                            f"{s.engine.max_positions} tokens can hold (at most {s.max_chars} with this tokenizer). "
                            "Fix: shorten the prompt", param=param, code="context_length_exceeded")
    return s.model.tokenizer(text, **kw)["input_ids"]


def _template_errors() -> tuple[type[Exception], ...]:
    from jinja2 import TemplateError

    return (TemplateError,)


# -- request checks ---------------------------------------------------------------------------------

def _check_model(asked: str, name: str) -> None:
    if asked != name:
        shown = asked if len(asked) <= 100 else asked[:100] + "..."
        raise ApiError(404, f"The model `{shown}` does not exist: this server serves `{name}` (see GET /v1/models)",
                       param="model", code="model_not_found")


def _refuse_unsupported(req: ChatRequest | CompletionRequest) -> None:
    """A 400 naming the first field set to what this server cannot honour (`protocol` says which)."""
    found = req.refused()
    if found is not None:
        param, message = found
        raise ApiError(400, message, param=param, code="unsupported_parameter")


def _prompt_text(s: Served, prompt: str | list[str] | list[int] | list[list[int]], ids: list[int]) -> str:
    """The prompt as text, for echo: as sent, or its token ids decoded."""
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    return s.model.tokenizer.decode(ids)


def _prompt_ids(s: Served, prompt: str | list[str] | list[int] | list[list[int]]) -> list[int]:
    if isinstance(prompt, str):
        return _tokenize(s, prompt, "prompt")
    if len(prompt) == 1 and isinstance(prompt[0], list):  # a batch of one tokenized prompt (lm-eval sends it)
        prompt = prompt[0]
    if prompt and all(isinstance(p, int) for p in prompt):
        vocab = len(s.model.tokenizer)
        if any(not 0 <= p < vocab for p in prompt):  # type: ignore[operator]
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt", code="invalid_value")
        return list(prompt)  # type: ignore[arg-type]
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return _tokenize(s, prompt[0], "prompt")
    raise ApiError(400, "one prompt per request (a string, a list of one string, or token ids)", param="prompt",
                   code="unsupported_parameter")


def _params(engine: Engine, req: ChatRequest | CompletionRequest, prompt_tokens: int, *, param: str,
            vocab: int) -> SamplingParams:
    """The engine's settings for this request; 400 for a prompt and answer over the context (naming
    `param`), more choices (`n`) than the engine's rows at once, or a `logit_bias` id outside the `vocab` tokens."""
    asked = req.limit()
    max_tokens = asked if asked is not None else max(1, min(DEFAULT_MAX_TOKENS, engine.room(prompt_tokens)))
    try:
        engine.check_length(prompt_tokens, max_tokens)
    except PromptTooLong as err:
        raise ApiError(400, err.render().replace("\n  fix:", " Fix:"), param=param,
                       code="context_length_exceeded") from None
    rows = getattr(engine, "max_batch", None)  # the engine's rows at once (None: a handle that does not say)
    if rows is not None and req.n > rows:
        raise ApiError(400, f"n: {req.n} choices, but this server generates at most {rows} rows at once (--max-batch "
                            f"{rows}). Fix: send n <= {rows} (or several requests), or serve with --max-batch {req.n}",
                       param="n", code="invalid_value")
    bias = req.bias()
    if bias and max(bias) >= vocab:
        raise ApiError(400, f"logit_bias names token {max(bias)}, but this model's vocabulary has {vocab} tokens "
                            f"(ids 0..{vocab - 1})", param="logit_bias", code="invalid_value")
    return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                          stop=req.stop_list(), seed=req.seed, logprobs=req.alternatives(),
                          prompt_logprobs=req.echoes_logprobs(), frequency_penalty=req.frequency_penalty or 0.0,
                          presence_penalty=req.presence_penalty or 0.0, logit_bias=bias)


def _include_usage(req: ChatRequest | CompletionRequest) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)
