"""OpenAI's request and response shapes, as far as `smolforge serve` implements them.

Why every field is honoured or refused by name (issue 44): a field dropped with a 200 is a setting
the client believes applied (`logprobs` for an evaluation harness, `tools` for an agent). So each
field of OpenAI's chat and completions requests is declared here: read and honoured (`n`,
`frequency_penalty`, `presence_penalty`, `logit_bias` among them: serve/sampling.py), or accepted
only at its neutral value (the one that asks for nothing: `store: false`, `best_of: 1`) and
refused otherwise with a 400 whose `param` is the field (`REFUSED`); a field
OpenAI does not define is refused too (`unknown_parameter`), so a typo (`max_token`) is not a
silent default. A `null` means "not given", as in OpenAI's types. `user` and `safety_identifier`
(who the end user is, for a provider's abuse monitoring) and `prompt_cache_key` (a routing hint for
a provider's prompt cache; one server here has one cache) change no output: accepted as they are.

Why every number has bounds here: the schema is the first check a request meets, and a number
nothing bounds reaches code that cannot take it (`"seed": 2**64` overflowed the random generator
on the engine thread). The bounds are OpenAI's where it states them (seed: a signed 64-bit integer;
at most 4 stop strings) and generous elsewhere; the context length is checked per request.
`logprobs`/`top_logprobs` allow up to 20 alternatives (OpenAI's chat bound; its legacy endpoint
says 5, vLLM allows 20 on both).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from smolforge.data.chat_turns import call_arguments

DEFAULT_MAX_TOKENS = 256  # when a request names none: OpenAI's chat default is "to the context", too long here
MAX_TOKENS_LIMIT = 2**20  # over any context served here: the real bound is the context, checked per request
MAX_STOPS, MAX_STOP_CHARS = 4, 512
MAX_N = 128  # choices per request (each a row of the batch, `n`)
MAX_LOGIT_BIAS = 1024  # biased tokens per request: generous (each is one entry of the row's offset)
MAX_TOKEN_ID = 2**31 - 1  # the vocabulary check gives the real bound
INT64 = 2**63
MAX_LOGPROBS = 20  # alternatives per position
NOT_YET = "not supported yet by smolforge serve"

TokenCount = Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)]
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


class _Strict(BaseModel):
    """A request part that refuses fields it does not declare; `null` is "not given" (its default)."""

    model_config = ConfigDict(extra="forbid")
    # field -> (its neutral values: asking for nothing, accepted; why any other value is refused)
    REFUSED: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in cls.model_fields)}
        return data

    def refused(self) -> tuple[str, str] | None:
        """(field, why) of the first field set to a value this server cannot honour, or None."""
        for name, (neutral, why) in self.REFUSED.items():
            value = getattr(self, name)
            if value is not None and value not in neutral:
                return name, f"{name}: {why}"
        return None


class StreamOptions(_Strict):
    REFUSED = {"include_obfuscation": ((False,), "stream obfuscation is not supported by smolforge serve")}

    include_usage: bool = False
    include_obfuscation: bool | None = None


_COMMON_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {}


class _Sampling(_Strict):
    model: str
    max_tokens: TokenCount | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    stop: Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOPS)], None] = None
    seed: int | None = Field(default=None, ge=-INT64, le=INT64 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    user: str | None = None  # the end user, for a provider's abuse monitoring: changes no output

    @field_validator("logit_bias")
    @classmethod
    def _bias_entries(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        """Keys are token ids (decimal strings), values -100..100 (OpenAI's range); the vocabulary
        bound is checked per model (api.py)."""
        for key, value in (bias or {}).items():
            if not (key.isascii() and key.isdigit()) or int(key) > MAX_TOKEN_ID:
                raise ValueError(f"keys must be token ids (decimal integers), got {key[:40]!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"the bias of token {key} is {value}: biases go from -100 to 100")
        return bias

    def bias(self) -> dict[int, float]:
        """`logit_bias` with int token ids (empty when not given)."""
        return {int(k): float(v) for k, v in (self.logit_bias or {}).items()}

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def refused(self) -> tuple[str, str] | None:
        found = super().refused()
        if found is None and self.stream_options is not None:
            inner = self.stream_options.refused()
            if inner is not None:
                return f"stream_options.{inner[0]}", f"stream_options.{inner[1]}"
        return found


class TextPart(_Strict):
    type: Literal["text"] = "text"
    text: str


FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]


class FunctionCall(_Strict):
    """A call the assistant made: `arguments` is a JSON object's text, as OpenAI sends it."""

    name: FunctionName
    arguments: str = "{}"


class ToolCallIn(_Strict):
    """An assistant turn's `tool_calls` entry in the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    """One turn. OpenAI's other message fields are declared so that they are refused by name, not dropped.
    `name` is passed to the template on a `tool` turn (the function that answered, as transformers'
    templates read it) and refused on any other (the chat templates have no place for it)."""

    REFUSED = {
        "function_call": ((), "deprecated by OpenAI and not supported by smolforge serve: send `tool_calls`"),
        "refusal": ((), "an assistant turn's refusal is not supported by smolforge serve: send it as content"),
        "audio": ((), "audio is not supported: smolforge serve serves text models"),
    }

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    name: str | None = None
    function_call: Any = None
    refusal: Any = None
    audio: Any = None

    def refused(self) -> tuple[str, str] | None:
        if self.tool_call_id is not None and self.role != "tool":
            return "tool_call_id", f"tool_call_id: only a tool turn answers a call, not a {self.role} turn"
        if self.tool_calls is not None and self.role != "assistant":
            return "tool_calls", f"tool_calls: only an assistant turn makes calls, not a {self.role} turn"
        if self.name is not None and self.role != "tool":
            return "name", ("name: message names are not supported by smolforge serve on a "
                            f"{self.role} turn (the chat template has no place for them); only a tool turn's")
        return super().refused()

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
    """A history call's arguments as the template reads them: the one answer training data gets too
    (`data.chat_turns.call_arguments`). ValueError for text that is not a JSON object."""
    return call_arguments(call.name, call.arguments)


class FunctionSpec(_Strict):
    """A function the model may call: `parameters` is its arguments' JSON schema."""

    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    """`tool_choice` naming one function: the answer is a call to it."""

    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    """`response_format.json_schema`: the schema the answer must follow (`strict` is always honoured)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """`response_format`: `text` (no constraint), `json_object` (any JSON object) or `json_schema`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatRequest(_Sampling):
    REFUSED = {
        **_COMMON_REFUSED,
        "functions": (([],), "deprecated by OpenAI and not supported by smolforge serve: send `tools`"),
        "function_call": (("none",), "deprecated by OpenAI and not supported by smolforge serve: send `tool_choice`"),
        "audio": ((), "audio output is not supported: smolforge serve serves text models"),
        "modalities": ((["text"],), "only the text modality is served"),
        "prediction": ((), "predicted outputs are not supported by smolforge serve"),
        "reasoning_effort": ((), "not supported by smolforge serve (no reasoning budget to set)"),
        "verbosity": ((), "not supported by smolforge serve"),
        "web_search_options": ((), "web search is not supported by smolforge serve"),
        "moderation": ((), "moderation is not supported by smolforge serve"),
        "store": ((False,), "smolforge serve stores no completions"),
        "metadata": (({},), "metadata is kept with stored completions, and smolforge serve stores none"),
        "service_tier": (("auto", "default"), "smolforge serve has one service tier: `auto` or `default`"),
        "prompt_cache_retention": (("in_memory",), "the prompt cache is in memory only"),
        "prompt_cache_options": ((), "not supported by smolforge serve"),
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: TokenCount | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    safety_identifier: str | None = None  # as `user`: changes no output
    prompt_cache_key: str | None = None  # a routing hint for a provider's cache: one server, one cache
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def conversation(self) -> list[dict[str, Any]]:
        """Messages for the chat template (`ChatMessage.for_template`). ValueError for a call's arguments
        that are not a JSON object."""
        return [m.for_template() for m in self.messages]

    def alternatives(self) -> int | None:
        """How many most likely tokens to return per position (None: no log-probabilities)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def echoes_logprobs(self) -> bool:
        """True when the prompt's own log-probabilities are asked for (a completion's echo only)."""
        return False

    def refused(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs: needs `logprobs: true`"
        if self.logprobs and self.tools and self.tool_choice != "none":
            return "logprobs", ("logprobs: not supported yet by smolforge serve together with `tools` (a tool answer "
                                "is parsed whole at its end); send tool_choice none, or no logprobs")
        if self.parallel_tool_calls is False and self.tools and self.tool_choice in (None, "auto"):
            return "parallel_tool_calls", ("parallel_tool_calls: false is not enforced by smolforge serve with "
                                           "tool_choice auto; a `required` or named tool_choice gives exactly one call")
        for i, m in enumerate(self.messages):
            found = m.refused()
            if found is not None:
                return f"messages.{i}.{found[0]}", f"messages.{i}.{found[1]}"
        return super().refused()


TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(_Sampling):
    REFUSED = {
        **_COMMON_REFUSED,
        "best_of": ((1,), "best_of > 1 is not supported by smolforge serve"),
        "suffix": (("",), "suffix (insertion) is not supported by smolforge serve"),
    }

    max_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS_LIMIT)] | None = None  # 0: with echo only
    prompt: Union[str, list[str], TokenIds, list[TokenIds]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)

    def limit(self) -> int | None:
        return self.max_tokens

    def alternatives(self) -> int | None:
        return self.logprobs

    def echoes_logprobs(self) -> bool:
        return self.echo and self.logprobs is not None

    def refused(self) -> tuple[str, str] | None:
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens: 0 asks for nothing: it is allowed with `echo: true` only"
        return super().refused()


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


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's `usage`: token counts, and of the prompt's the ones the prefix cache served
    (`prompt_tokens_details.cached_tokens`, as OpenAI and llama-server report them)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def system_fingerprint(model: str, engine: str, adapter: str | None = None) -> str:
    """OpenAI's `system_fingerprint`: `fp_` and 12 hex digits of the SHA-256 of what decides the answers
    besides the request: smolforge's version, the model as served from (its path or name), the adapter,
    and the engine's description (engine, dtype or GGUF quantization, device, threads: `engines.Loaded.label`).
    The same server started the same way gives the same string; a change to any of these changes it."""
    import hashlib
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("smolforge")
    except PackageNotFoundError:
        ours = "unknown"
    what = json.dumps({"smolforge": ours, "model": model, "adapter": adapter, "engine": engine}, sort_keys=True)
    return "fp_" + hashlib.sha256(what.encode()).hexdigest()[:12]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def sse(obj: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: {json}` and a blank line."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def chat_chunk(cid: str, created: int, model: str, delta: dict[str, Any], finish_reason: str | None,
               fingerprint: str | None = None) -> dict[str, Any]:
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            **_fingerprint(fingerprint),
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def completion_chunk(cid: str, created: int, model: str, text: str, finish_reason: str | None,
                     fingerprint: str | None = None) -> dict[str, Any]:
    return {"id": cid, "object": "text_completion", "created": created, "model": model,
            **_fingerprint(fingerprint),
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def usage_chunk(cid: str, created: int, model: str, obj: str, prompt_tokens: int, completion_tokens: int,
                cached_tokens: int = 0, fingerprint: str | None = None) -> dict[str, Any]:
    """The last chunk when `stream_options.include_usage`: no choices, the usage."""
    return {"id": cid, "object": obj, "created": created, "model": model, **_fingerprint(fingerprint),
            "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def _fingerprint(fingerprint: str | None) -> dict[str, str]:
    return {"system_fingerprint": fingerprint} if fingerprint else {}
