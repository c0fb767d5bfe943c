"""How a family's model writes a tool call: the text its chat template teaches, parsed back, and the
grammar that makes a model write one (`tool_choice` required or a named function).

- `HermesCalls` (Qwen2.5, Qwen3, Hermes, and the default): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call, text around them is the answer's content (Qwen2.5's template renders exactly this);
- `LlamaJsonCalls` (Llama 3.1-3.3's JSON tool calling): the whole answer is `{"name": ..., "parameters": {...}}`
  (`<|python_tag|>` before it, when the model writes one, is dropped).

A family names its format (`Family.tool_calls`); serve/tools.py asks the family, never a model type.
`ObjectScan` finds a call's members in its text in one pass, as the text comes: the arguments' own text
(OpenAI's `arguments` string is what the model wrote) and toolstream.py's streamed calls.
The grammars are Lark text with `%json` schemas (llguidance's syntax, compiled in serve/structured.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments (a JSON object); `text`, the arguments as the
    model wrote them (OpenAI's `arguments` string is the model's own text; None: written here)."""

    name: str
    arguments: dict[str, Any]
    text: str | None = field(default=None, compare=False)

    @property
    def arguments_text(self) -> str:
        """OpenAI's `function.arguments`: the model's text of the object, or its JSON when it wrote none."""
        return self.text if self.text is not None else json.dumps(self.arguments, ensure_ascii=False)


class ObjectScan:
    """A JSON object's text fed piece by piece (a model's call as it is generated): where each top-level
    member's value starts and ends, found in one pass without parsing the values. It checks structure
    only; `json.loads` of the whole decides validity. Positions index `text`."""

    def __init__(self) -> None:
        self.text, self.depth, self.closed, self.bad = "", 0, False, False
        self.in_str = self.esc = False
        self.key_start: int | None = None  # a top-level key's opening quote
        self._key: str | None = None  # the last top-level key read
        self.current: str | None = None  # the member whose value is being read
        self.spans: dict[str, list[int | None]] = {}  # key -> [start, end) of its value (None: not yet)
        self.last = -1  # the last non-whitespace character's index

    def feed(self, piece: str) -> int:
        """Scan `piece`; the number of its characters that belong to the object (all, until it closes)."""
        for n, ch in enumerate(piece):
            if self.closed or self.bad:
                return n
            i = len(self.text)
            self.text += ch
            self._step(ch, i)
        return len(piece)

    def _step(self, ch: str, i: int) -> None:
        if self.in_str:
            self.esc, self.in_str = (False, True) if self.esc else (ch == "\\", ch != '"')
            if not self.in_str and self.depth == 1:
                self._string_ended(i)
            return
        if ch.isspace():
            return
        if self.depth == 0:
            self.depth, self.bad = (1, False) if ch == "{" else (0, True)
            return
        span = self.spans.get(self.current) if self.current is not None else None
        if self.depth == 1 and ch in ",}" and span is not None and span[0] is not None and span[1] is None:
            span[1] = self.last + 1  # a number, true, false or null ends here
        if ch == '"':
            self.in_str = True
            if self.depth == 1 and self.current is None:
                self.key_start = i
        elif self.depth == 1 and ch == ":" and self.current is None:
            if self._key is None:
                self.bad = True
                return
            self.current, self._key = self._key, None
            self.spans[self.current] = [None, None]
        elif self.depth == 1 and ch == ",":
            self.current = None
        elif self.depth == 1 and ch == "}":
            self.closed, self.depth = True, 0
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 1 and span is not None:
                span[1] = i + 1
        if self.depth >= 1 and span is not None and span[0] is None and ch not in ":,}":
            span[0] = i
        self.last = i

    def _string_ended(self, i: int) -> None:
        if self.key_start is not None:  # a key: its value comes after the colon
            try:
                self._key = json.loads(self.text[self.key_start:i + 1])
            except ValueError:
                self.bad = True
            self.key_start = None
            return
        span = self.spans.get(self.current) if self.current is not None else None
        if span is not None and span[1] is None:
            span[1] = i + 1
        self.last = i

    def value(self, key: str, partial: bool = False) -> str | None:
        """The text of member `key`'s value: whole, or (`partial`) as far as it has come; None: not begun."""
        span = self.spans.get(key)
        if span is None or span[0] is None or (span[1] is None and not partial):
            return None
        return self.text[span[0]:span[1]]


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
    whole_answer: ClassVar[bool] = False  # a call is the whole answer (else calls sit between `markers`, among text)
    prefix: ClassVar[str] = ""  # a tag a whole-answer call may start with (dropped)

    def argument_keys(self) -> tuple[str, ...]:
        """The members a call's arguments may come under, in the order `parse` looks (first found wins)."""
        return tuple(dict.fromkeys((self.arguments_key, "arguments", "parameters")))

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
        key = next((k for k in self.argument_keys() if k in obj), None)
        args, text = obj.get(key, {}) if key else {}, None
        if isinstance(args, str):  # some models write the arguments as a JSON string
            text = args
            try:
                args = json.loads(args)
            except ValueError:
                return None
        elif key is not None:
            scan = ObjectScan()
            scan.feed(blob.strip())
            text = scan.value(key)
        return ToolCall(obj["name"], args, text) if isinstance(args, dict) else None


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
    whole_answer = True
    prefix = _TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        blob = text.strip()
        blob = blob[len(self._TAG):].strip() if blob.startswith(self._TAG) else blob
        call = self._call(blob) if blob.startswith("{") else None
        return ((None, [call]) if call is not None else ((text or None), []))

    def grammar(self, functions: list[dict[str, Any]], tokens: frozenset[str] = frozenset()) -> str:
        return f"start: call\ncall: %json {json.dumps(call_schema(functions, self.arguments_key))}\n"


HERMES = HermesCalls()
LLAMA_JSON = LlamaJsonCalls()
