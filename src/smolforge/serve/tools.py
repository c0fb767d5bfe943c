"""Tool calling on `/v1/chat/completions`: `tools` and `tool_choice` in, `tool_calls` out (streamed and not).

- The tools go to the family's chat template (`render_prompt(..., tools=)`: transformers'
  `apply_chat_template`), so the prompt is the one the model was trained on; a template that renders no
  tools (models/families/chat.py's probe) is a 400 naming `tools`, not a prompt without them.
- The answer's text is parsed into calls by the family's format (`Family.tool_calls`: Hermes'
  `<tool_call>` JSON for Qwen2.5, Llama 3's JSON, models/families/toolcalls.py); its other text is `content`.
- `tool_choice` `required` or a named function is enforced: the answer is generated under the format's
  grammar for one call (serve/structured.py, llguidance), so a call comes back whatever the weights.
  `auto` leaves the model free; `none` renders the tools and returns text only (no parsing).
- Streamed, the answer goes out as it is generated, the way OpenAI streams it (models/families/toolstream.py
  reads the family's format piece by piece): content at once (less a tail that may begin a call's
  marker), then per call one `delta.tool_calls` chunk with its index, id, type, name and `arguments` "",
  then its arguments in fragments as the model writes them; `finish_reason` is "tool_calls". A client
  that accumulates the deltas gets the non-streamed `tool_calls` (`arguments`: the model's own text of
  the object, in both).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from smolforge.models.families.toolcalls import ToolCall, ToolCallFormat
from smolforge.models.families.toolstream import CallStream, Piece
from smolforge.serve.protocol import ChatRequest, sse
from smolforge.serve.streams import ChatChunks


@dataclass
class ToolPlan:
    """What a request's `tools`/`tool_choice` ask: the template's tools, the family's format, the choice
    (`auto`, `none`, `required`, or a function's name)."""

    format: ToolCallFormat
    tools: list[dict[str, Any]]
    choice: str
    named: bool = False
    tokens: frozenset[str] = frozenset()  # the format's markers that are single added tokens here


    def grammar_lark(self) -> str | None:
        """The Lark text a forced call follows (None: the model is free)."""
        if self.choice == "required":
            return self.format.grammar([t["function"] for t in self.tools], self.tokens)
        if self.named:
            return self.format.grammar([t["function"] for t in self.tools if t["function"]["name"] == self.choice],
                                       self.tokens)
        return None

    def answer(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, OpenAI `tool_calls`) of an answer's text; `none` parses nothing."""
        if self.choice == "none":
            return (text or None), []
        content, calls = self.format.parse(text)
        return content, [_openai_call(c) for c in calls]


def single_tokens(tokenizer: Any, texts: tuple[str, ...]) -> frozenset[str]:
    """The `texts` the tokenizer encodes as one added token (`<tool_call>` in Qwen2.5's vocabulary)."""
    added = {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {}) or {}}
    out = set()
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) == 1 and int(ids[0]) in added:
            out.add(text)
    return frozenset(out)


def plan_of(req: ChatRequest, fmt: ToolCallFormat, tokenizer: Any) -> ToolPlan | None:
    """The request's plan, or None without `tools`. ValueError (with the field) for a choice that cannot
    be met: a named function not among `tools`, `required` or a name without tools."""
    choice = req.tool_choice
    name = choice.function.name if choice is not None and not isinstance(choice, str) else None
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise ValueError("tool_choice asks for a call but the request has no tools")
        return None
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    if name is not None and name not in {t["function"]["name"] for t in tools}:
        raise ValueError(f"tool_choice names the function {name!r}, which is not among the request's tools")
    return ToolPlan(fmt, tools, name or (choice if isinstance(choice, str) else "auto"), named=name is not None,
                    tokens=single_tokens(tokenizer, fmt.markers))


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _openai_call(call: ToolCall) -> dict[str, Any]:
    return {"id": _call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments_text}}


def chat_choice(text: str, reason: str, plan: ToolPlan | None) -> dict[str, Any]:
    """A non-streamed answer's choice: its message (with `tool_calls` when the text made any) and reason."""
    content, calls = plan.answer(text) if plan is not None else (text, [])
    message: dict[str, Any] = {"role": "assistant", "content": content if calls else text}
    if calls:
        message["tool_calls"] = calls
    return {"index": 0, "message": message, "logprobs": None, "finish_reason": "tool_calls" if calls else reason}


class ToolChunks(ChatChunks):
    """A tool request's stream: its text read by the family's format as it comes (`CallStream`), sent as
    content and `delta.tool_calls` chunks (`pieces`); `frame` is those chunks' SSE bytes."""

    def __init__(self, cid: str, created: int, model: str, include_usage: bool, plan: ToolPlan, *,
                 fingerprint: str | None = None):
        super().__init__(cid, created, model, include_usage, fingerprint=fingerprint)
        self.plan, self.reader = plan, CallStream(plan.format)
        self.frame = self._frame  # type: ignore[assignment]

    def _frame(self, text: str) -> bytes:
        return b"".join(sse(c) for c in self.pieces(text))

    def pieces(self, text: str) -> list[dict[str, Any]]:
        """The chunks the answer's next text makes sendable (none while a marker or a name is incomplete)."""
        return [self._chunk(p) for p in self.reader.feed(text)]

    def _chunk(self, piece: Piece) -> dict[str, Any]:
        if piece.kind == "content":
            return self.text(piece.text)
        if piece.kind == "name":
            return self.chunk({"tool_calls": [{"index": piece.index, "id": _call_id(), "type": "function",
                                               "function": {"name": piece.text, "arguments": ""}}]}, None)
        return self.chunk({"tool_calls": [{"index": piece.index, "function": {"arguments": piece.text}}]}, None)

    def closing(self, reason: str) -> list[dict[str, Any]]:
        out = [self._chunk(p) for p in self.reader.close()]
        return [*out, self.last("tool_calls" if self.reader.called else reason)]
