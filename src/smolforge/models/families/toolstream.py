"""A family's tool-call text read as it is generated: content, each call's name, and its arguments in
fragments, the way OpenAI streams `delta.tool_calls` (and vLLM, llama-server after it).

`CallStream(fmt)` takes the answer's text pieces (`feed`) and says what may be sent now (`Piece`s):
- content outside any call, sent at once except a tail that may begin a call's marker (`<tool_call>`
  split over tokens) and trailing whitespace (`parse` strips the content around calls);
- a call's name once its `"name"` string is whole (a name split across tokens waits for its last token),
  then its arguments as the model writes them, fragment by fragment (the object's own text: a `}` inside a
  string does not end it, `ObjectScan`), with whatever the format's `parse` adds at the end of the call
  (arguments written as a JSON string, or none at all: `{}`).

What the pieces add up to is what `fmt.parse` gives for the whole text (`ToolCall.arguments_text`), for
well-formed calls. The stream cannot take back what it sent, so it differs from `parse` where the end of
the text changes its reading: a call cut off (`max_tokens`) or that turns out not to be JSON was already
begun (OpenAI, vLLM and llama-server stream such a call too), and leading whitespace before the first
content is sent when a call follows (`parse` strips it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from smolforge.models.families.toolcalls import ObjectScan, ToolCallFormat


@dataclass(frozen=True)
class Piece:
    """What may be sent: `content` text, or for call `index` its `name` (first) or an `arguments` fragment."""

    kind: str  # "content" | "name" | "arguments"
    text: str
    index: int = 0


def _held_tail(text: str, marker: str) -> int:
    """How many of `text`'s last characters could begin `marker` (held until the next piece decides)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class CallStream:
    """One answer's text, fed as it comes, turned into `Piece`s in the order OpenAI streams them."""

    def __init__(self, fmt: ToolCallFormat):
        self.fmt = fmt
        self.opener, self.closer = (fmt.markers + ("", ""))[:2]
        self.buf = ""  # text received and not yet decided
        self.state = "start" if fmt.whole_answer else "text"  # start | text | call | after
        self.scan: ObjectScan | None = None
        self.calls = 0  # calls begun (their names sent)
        self.named = False  # the current call's name went out
        self.sent = ""  # the current call's arguments sent so far
        self.space = ""  # whitespace held after the content sent so far
        self.wrote = False  # any content sent

    def feed(self, text: str) -> list[Piece]:
        """The pieces `text` (the answer's next characters) makes sendable."""
        self.buf += text
        out: list[Piece] = []
        while self.buf and self._step(out):
            pass
        return out

    def close(self) -> list[Piece]:
        """The pieces left at the end of the answer (held text, the rest of a call's arguments)."""
        out: list[Piece] = []
        if self.state == "call" and not self.named:  # a marker with no call after it: it was text
            self._content(self.opener + (self.scan.text if self.scan else "") + self.buf, out)
        elif self.state in ("text", "start"):
            self._content(self.buf, out)
        if not self.calls:
            out += [Piece("content", self.space)] if self.space else []
        return out

    @property
    def called(self) -> bool:
        """Whether a call was sent (finish_reason "tool_calls")."""
        return self.calls > 0

    def _step(self, out: list[Piece]) -> bool:
        """Decide what the held text allows; True when the state moved on and more may be decided."""
        if self.state == "start":
            return self._start(out)
        if self.state == "text":
            at = self.buf.find(self.opener) if self.opener else -1
            if at < 0:
                keep = _held_tail(self.buf, self.opener) if self.opener else 0
                self._content(self.buf[:len(self.buf) - keep], out)
                self.buf = self.buf[len(self.buf) - keep:]
                return False
            self._content(self.buf[:at], out)
            self.buf, self.state, self.scan = self.buf[at + len(self.opener):], "call", ObjectScan()
            return True
        if self.state == "call":
            return self._call(out)
        return self._after()

    def _start(self, out: list[Piece]) -> bool:
        """A whole-answer format: the answer is a call when it starts with `{` (after the format's tag)."""
        head = self.buf.lstrip()
        if not head or (self.fmt.prefix.startswith(head) and head != self.fmt.prefix):
            return False
        if head.startswith(self.fmt.prefix) and self.fmt.prefix:
            head = head[len(self.fmt.prefix):].lstrip()
            if not head:
                return False
        if head.startswith("{"):
            self.buf, self.state, self.scan = head, "call", ObjectScan()
        else:
            self.state = "text"
        return True

    def _call(self, out: list[Piece]) -> bool:
        assert self.scan is not None
        used = self.scan.feed(self.buf)
        self.buf = self.buf[used:]
        if self.scan.bad and not self.named:  # not a call: what was held is text again
            text, self.buf, self.state = self.opener + self.scan.text + self.buf, "", "text"
            self._content(text, out)
            return False
        if not self.named:
            name = self.scan.value("name")
            if name is None or not name.startswith('"'):
                return False
            self.named = True
            out.append(Piece("name", _unquote(name), self.calls))
        key = next((k for k in self.fmt.argument_keys() if k in self.scan.spans), None)
        raw = self.scan.value(key, partial=True) if key else None
        if raw is not None and raw.startswith("{") and raw.startswith(self.sent):
            self._args(raw[len(self.sent):], out)
        if not self.scan.closed:
            return False
        call = self.fmt._call(self.scan.text)
        final = call.arguments_text if call is not None else self.sent
        if final.startswith(self.sent):
            self._args(final[len(self.sent):], out)
        self.calls, self.named, self.sent, self.state = self.calls + 1, False, "", "after"
        return True

    def _args(self, text: str, out: list[Piece]) -> None:
        if text:
            out.append(Piece("arguments", text, self.calls))
            self.sent += text

    def _after(self) -> bool:
        """After a call's object: its closing marker (or, in a whole-answer format, nothing more)."""
        head = self.buf.lstrip()
        if self.fmt.whole_answer or not head:
            self.buf = "" if self.fmt.whole_answer else self.buf
            return False
        if head.startswith(self.closer):
            self.buf, self.state = head[len(self.closer):], "text"
            return True
        if self.closer.startswith(head):
            return False
        self.state = "text"  # no closing marker: what follows is text
        return True

    def _content(self, text: str, out: list[Piece]) -> None:
        """Send content, holding its trailing whitespace (sent only when more content follows)."""
        if not text:
            return
        text = self.space + text
        if not self.wrote and self.calls:
            text = text.lstrip()
        body = text.rstrip()
        self.space = text[len(body):]
        if body:
            out.append(Piece("content", body))
            self.wrote = True


def _unquote(raw: str) -> str:
    """A JSON string's value (the raw text, quotes dropped, when it does not parse)."""
    try:
        value = json.loads(raw)
    except ValueError:
        return raw.strip('"')
    return value if isinstance(value, str) else raw
