"""Text from tokens as they come, cut at the first stop string.

Why decode the whole answer each time and hold text back: a token can end in the middle of a UTF-8
character (byte-level BPE) and a stop string can span tokens. Text is released only once it can
no longer turn out to be part of a stop string or a half character, so a streamed answer is the
non-streamed one, chunk by chunk.
"""

from __future__ import annotations

from typing import Any


class TextStream:
    """Feed token ids; get the new text that is safe to show, and whether a stop string was hit."""

    def __init__(self, tokenizer: Any, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.sent = 0  # characters of the answer already released
        self.text = ""  # the answer so far, cut at a stop string once one is found
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one token; return the text it releases (may be empty)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            at = self.text.find(s)
            if at >= 0:
                self.text, self.stopped = self.text[:at], True
        if self.stopped:
            return self._release(len(self.text))
        safe = len(self.text)
        if self.text.endswith("\ufffd"):  # half a character: wait for the rest of its bytes
            safe = len(self.text.rstrip("\ufffd"))
        safe -= self._stop_prefix_len(self.text[:safe])
        return self._release(safe)

    def finish(self) -> str:
        """The generation ended: release what was held back."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:upto], upto
        return out

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest end of `text` that begins some stop string (it may complete later)."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
