"""How a family's model writes a tool call: the text its chat template teaches, parsed back, and the
grammar that makes a model write one (`tool_choice` required or a named function).

- `HermesCalls` (Qwen2.5, Qwen3, Hermes, and the default): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call, text around them is the answer's content (Qwen2.5's template renders exactly this);
- `LlamaJsonCalls` (Llama 3.1-3.3's JSON tool calling): the whole answer is `{"name": ..., "parameters": {...}}`
  (`<|python_tag|>` before it, when the model writes one, is dropped).

A family names its format (`Family.tool_calls`); serve/tools.py asks the family, never a model type.
The grammars are Lark text with `%json` schemas (llguidance's syntax, compiled in serve/structured.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def call_schema(functions: list[dict[str, Any]], arguments_key: str) -> dict[str, Any]:
    """The JSON schema of one call to any of `functions` (OpenAI `function` objects: name, parameters; a
    function without parameters takes none, as OpenAI reads it)."""
    options = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                  arguments_key: f.get("parameters") or NO_PARAMETERS},
                "required": ["name", arguments_key], "additionalProperties": False} for f in functions]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    # compact JSON (llguidance's option): no free whitespace a model could spend its tokens on
    return {**schema, "x-guidance": {"whitespace_flexible": False}}


def _lark_piece(text: str, tokens: frozenset[str]) -> str:
    """`text` in Lark: a token reference (`<tool_call>`) when the tokenizer has it as one added token (a
    model writes that token, and llguidance matches added tokens only by reference), else a string."""
    return text if text in tokens else json.dumps(text)


class ToolCallFormat:
    """A tool-call text format: `parse` an answer into content and calls; `grammar` for forced calls."""

    name: ClassVar[str] = "none"
    arguments_key: ClassVar[str] = "arguments"
    markers: ClassVar[tuple[str, ...]] = ()  # the texts around a call (single added tokens in some vocabularies)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls): the answer's text outside any call (None when empty), and its calls in order."""
        return (text or None), []

    def grammar(self, functions: list[dict[str, Any]], tokens: frozenset[str] = frozenset()) -> str:
        """Lark text (llguidance's, with `%json`) for one call to one of `functions`; `tokens`: the
        `markers` the tokenizer holds as single added tokens."""
        raise NotImplementedError

    def _call(self, blob: str) -> ToolCall | None:
        try:
            obj = json.loads(blob)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get(self.arguments_key, obj.get("arguments", obj.get("parameters", {})))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return None
        return ToolCall(obj["name"], args) if isinstance(args, dict) else None


class HermesCalls(ToolCallFormat):
    """`<tool_call>` JSON `</tool_call>` blocks (Qwen2.5's and Hermes' templates)."""

    name = "hermes"
    markers = ("<tool_call>", "</tool_call>")
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls, kept, last = [], [], 0
        for m in self._BLOCK.finditer(text):
            call = self._call(m.group(1))
            if call is None:  # not a call after all: it stays text
                continue
            calls.append(call)
            kept.append(text[last:m.start()])
            last = m.end()
        kept.append(text[last:])
        content = "".join(kept).strip() if calls else text
        return (content or None), calls

    def grammar(self, functions: list[dict[str, Any]], tokens: frozenset[str] = frozenset()) -> str:
        schema = json.dumps(call_schema(functions, self.arguments_key))
        start, end = (_lark_piece(m, tokens) for m in self.markers)
        return f'start: {start} "\\n" call "\\n" {end}\ncall: %json {schema}\n'


class LlamaJsonCalls(ToolCallFormat):
    """The answer is one JSON object `{"name", "parameters"}` (Llama 3.x's JSON tool calling)."""

    name = "llama3-json"
    arguments_key = "parameters"
    _TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        blob = text.strip()
        blob = blob[len(self._TAG):].strip() if blob.startswith(self._TAG) else blob
        call = self._call(blob) if blob.startswith("{") else None
        return ((None, [call]) if call is not None else ((text or None), []))

    def grammar(self, functions: list[dict[str, Any]], tokens: frozenset[str] = frozenset()) -> str:
        return f"start: call\ncall: %json {json.dumps(call_schema(functions, self.arguments_key))}\n"


HERMES = HermesCalls()
LLAMA_JSON = LlamaJsonCalls()
