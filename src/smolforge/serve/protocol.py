"""OpenAI's request and response shapes, as far as `smolforge serve` implements them.

Why pydantic models that ignore unknown fields: clients (the official `openai` package, LangChain,
curl scripts) send fields we do not use (`user`, `frequency_penalty`, ...); refusing them would
break those clients, while the fields we do read are checked strictly, and the ones we cannot
honour (`n` > 1, `logprobs`, `echo`) are refused by name rather than silently ignored.

Why every number has bounds here: the schema is the first check a request meets, and a number
nothing bounds reaches code that cannot take it (`"seed": 2**64` overflowed the random generator
on the engine thread). The bounds are OpenAI's where it states them (seed: a signed 64-bit integer;
at most 4 stop strings) and generous elsewhere; the context length is checked per request.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_MAX_TOKENS = 256  # when a request names none: OpenAI's chat default is "to the context", too long here
MAX_TOKENS_LIMIT = 2**20  # over any context served here: the real bound is the context, checked per request
MAX_STOPS, MAX_STOP_CHARS = 4, 512
MAX_N = 128  # n > 1 is refused by name; beyond this it is not a number of choices at all
MAX_TOKEN_ID = 2**31 - 1  # the vocabulary check gives the real bound
INT64 = 2**63

TokenCount = Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)]
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: TokenCount | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    stop: Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOPS)], None] = None
    seed: int | None = Field(default=None, ge=-INT64, le=INT64 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"] = "text"
    text: str


FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]


class FunctionCall(BaseModel):
    """A call the assistant made: `arguments` is a JSON object's text, as OpenAI sends it."""

    model_config = ConfigDict(extra="ignore")
    name: FunctionName
    arguments: str = "{}"


class ToolCallIn(BaseModel):
    """An assistant turn's `tool_calls` entry in the history."""

    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (transformers' shape): `developer` is `system`, a call's
        arguments a dict (templates write them with `tojson`). ValueError for arguments that are not a
        JSON object."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [{"type": "function", **({"id": c.id} if c.id else {}),
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function)}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            out["name"] = self.name
        return out


def _arguments(call: FunctionCall) -> dict[str, Any]:
    try:
        args = json.loads(call.arguments or "{}")
    except ValueError:
        args = None
    if not isinstance(args, dict):
        raise ValueError(f"tool call {call.name}: arguments must be a JSON object's text, got {call.arguments[:80]!r}")
    return args


class FunctionSpec(BaseModel):
    """A function the model may call: `parameters` is its arguments' JSON schema."""

    model_config = ConfigDict(extra="ignore")
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: FunctionName


class NamedToolChoice(BaseModel):
    """`tool_choice` naming one function: the answer is a call to it."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: the schema the answer must follow (`strict` is always honoured)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`response_format`: `text` (no constraint), `json_object` (any JSON object) or `json_schema`."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: TokenCount | None = None
    logprobs: bool | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def conversation(self) -> list[dict[str, Any]]:
        """Messages for the chat template (`ChatMessage.for_template`). ValueError for a call's arguments
        that are not a JSON object."""
        return [m.for_template() for m in self.messages]


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[TokenId]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None

    def limit(self) -> int | None:
        return self.max_tokens


class ApiError(Exception):
    """An error the client caused or should know about, in OpenAI's shape and with its HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def gate_error_body(status: int, error: str, fix: str | None) -> bytes:
    """The gate's refusals (401, 413) in OpenAI's shape."""
    kind = {401: ("authentication_error", "invalid_api_key"), 413: ("invalid_request_error", "request_too_large")}
    type_, code = kind.get(status, ("invalid_request_error", None))
    message = f"{error}: {fix}" if fix else error
    return json.dumps(error_body(message, type_, None, code)).encode()


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def sse(obj: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: {json}` and a blank line."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def chat_chunk(cid: str, created: int, model: str, delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def completion_chunk(cid: str, created: int, model: str, text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def usage_chunk(cid: str, created: int, model: str, obj: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The last chunk when `stream_options.include_usage`: no choices, the usage."""
    return {"id": cid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}
