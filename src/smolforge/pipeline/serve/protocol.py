"""OpenAI's request and response shapes, as far as `smolforge serve` implements them.

Why pydantic models that ignore unknown fields: clients (the official `openai` package, LangChain,
curl scripts) send fields we do not use (`user`, `frequency_penalty`, ...); refusing them would
break those clients, while the fields we do read are checked strictly, and the ones we cannot
honour (`n` > 1, `logprobs`, `echo`) are refused by name rather than silently ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_MAX_TOKENS = 256  # when a request names none: OpenAI's chat default is "to the context", too long here


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"] = "text"
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def conversation(self) -> list[dict[str, str]]:
        """Messages for the chat template (`developer` is the newer name of `system`)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]
    echo: bool = False
    logprobs: int | None = None
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
