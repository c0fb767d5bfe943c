"""Tool calling on `/v1/chat/completions`: `tools` and `tool_choice` in, `tool_calls` out (streamed and not).

- The tools go to the family's chat template (`render_prompt(..., tools=)`: transformers'
  `apply_chat_template`), so the prompt is the one the model was trained on; a template that renders no
  tools (models/families/chat.py's probe) is a 400 naming `tools`, not a prompt without them.
- The answer's text is parsed into calls by the family's format (`Family.tool_calls`: Hermes'
  `<tool_call>` JSON for Qwen2.5, Llama 3's JSON, models/families/toolcalls.py); its other text is `content`.
- `tool_choice` `required` or a named function is enforced: the answer is generated under the format's
  grammar for one call (serve/structured.py, llguidance), so a call comes back whatever the weights.
  `auto` leaves the model free; `none` renders the tools and returns text only (no parsing).
- Streamed, a tool request's text is held until the answer is complete (a call's start is only known
  once its text is there); then the content, each call's id and name, and its arguments go out as
  OpenAI's `delta.tool_calls` chunks, and `finish_reason` is "tool_calls".
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from smolforge.models.families.toolcalls import ToolCall, ToolCallFormat
from smolforge.serve.protocol import ChatRequest
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


def _openai_call(call: ToolCall) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}


def chat_choice(text: str, reason: str, plan: ToolPlan | None) -> dict[str, Any]:
    """A non-streamed answer's choice: its message (with `tool_calls` when the text made any) and reason."""
    content, calls = plan.answer(text) if plan is not None else (text, [])
    message: dict[str, Any] = {"role": "assistant", "content": content if calls else text}
    if calls:
        message["tool_calls"] = calls
    return {"index": 0, "message": message, "logprobs": None, "finish_reason": "tool_calls" if calls else reason}


class ToolChunks(ChatChunks):
    """A tool request's stream: the text is held, and sent at the end as content and `delta.tool_calls`."""

    def __init__(self, cid: str, created: int, model: str, include_usage: bool, plan: ToolPlan, *,
                 fingerprint: str | None = None):
        super().__init__(cid, created, model, include_usage, fingerprint=fingerprint)
        self.plan, self.held = plan, []
        self.frame = self._hold  # type: ignore[assignment]

    def _hold(self, text: str) -> bytes:
        self.held.append(text)
        return b""

    def closing(self, reason: str) -> list[dict[str, Any]]:
        content, calls = self.plan.answer("".join(self.held))
        text = "".join(self.held)
        out = []
        if (content if calls else text):
            out.append(self.text(content if calls else text))
        for i, call in enumerate(calls):
            fn = call["function"]
            out.append(self.chunk({"tool_calls": [
                {"index": i, "id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": ""}}]},
                None))
            out.append(self.chunk({"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]}, None))
        out.append(self.last("tool_calls" if calls else reason))
        return out
