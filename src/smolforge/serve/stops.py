"""Text from tokens as they come, cut at the first stop string.

Why hold text back: a token can end in the middle of a UTF-8 character (byte-level BPE, byte
fallback) and a stop string can span tokens. Text is released only once it can no longer turn out
to be part of a stop string or a half character, so a streamed answer is the non-streamed one,
chunk by chunk.

Why a window and not the whole answer: decoding every id again at every token costs time that
grows with the answer (quadratic over a generation). Only the ids since a recent character
boundary are decoded, with a few ids before them (`_start`) so the tokenizer sees their context (a
SentencePiece decoder drops the leading space of the first token it decodes; both decodes of the
window drop it alike); the new text is the window's text after the text its older ids already gave.
This is what HF's `TextStreamer` and vLLM's incremental detokenizer do. A tokenizer that rewrites
earlier text (`clean_up_tokenization_spaces`, or a window whose decode does not extend the last
one) is decoded whole instead, as before: exact first, fast where that is exact.
"""

from __future__ import annotations

from typing import Any

_WINDOW = 8  # ids of context before the window slides on (one extra short decode each time)
_PROBE = "a . b , c ! d ? e 's f n't"  # what `clean_up_tokenization_spaces` rewrites


class TextStream:
    """Feed token ids; get the new text that is safe to show, and whether a stop string was hit."""

    def __init__(self, tokenizer: Any, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.sent = 0  # characters of the answer already released
        self.text = ""  # the answer so far, cut at a stop string once one is found
        self.stopped = False
        self.decodes = 0  # tokenizer calls, and ids they read: the tests check the work is linear
        self.decoded_ids = 0
        self._whole = rewrites_spaces(tokenizer)
        self._start = 0  # the window: ids[_start:] are decoded at each token
        self._read = 0  # ids[:_read] end on a character boundary; their text is text[:_confirmed]
        self._confirmed = 0
        self._prefix = ""  # decode(ids[_start:_read]): the part of the window's text already in `text`

    def push(self, token_id: int) -> str:
        """Add one token; return the text it releases (may be empty)."""
        if self.stopped:
            return ""
        unchanged = self._confirmed  # text before this index is what the last push had too
        self.ids.append(token_id)
        self.text = self._decode_new()
        if self._whole:  # decoded whole: any part may have changed
            unchanged = 0
        for s in self.stop:  # an earlier match would have stopped the last push: look where it can be new
            at = self.text.find(s, max(0, unchanged - len(s) + 1))
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

    def _decode(self, ids: list[int]) -> str:
        self.decodes += 1
        self.decoded_ids += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _decode_new(self) -> str:
        """The whole answer's text with the newest id: the confirmed text, then the window's new text."""
        if self._whole:
            return self._decode(self.ids)
        window = self._decode(self.ids[self._start:])
        if not window.startswith(self._prefix):  # this tokenizer rewrote earlier text: decode whole answers
            self._whole = True
            return self._decode(self.ids)
        text = self.text[:self._confirmed] + window[len(self._prefix):]
        if len(window) > len(self._prefix) and not window.endswith("\ufffd"):  # a character boundary
            last, self._read, self._confirmed, self._prefix = self._read, len(self.ids), len(text), window
            if self._read - self._start > _WINDOW:  # slide on to the last boundary but one
                self._start, self._prefix = last, self._decode(self.ids[last:self._read])
        return text

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


def rewrites_spaces(tokenizer: Any) -> bool:
    """Whether this tokenizer's decode cleans up spaces ("a ." becomes "a."): a change to text
    before a window that the window cannot see. transformers skips the cleanup for BPE models even
    when the flag is set (Llama 3 sets it), so the flag alone would cost them the window: decode a
    probe both ways (once per request, only when the flag is set)."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    try:
        ids = tokenizer.encode(_PROBE, add_special_tokens=False)
        return tokenizer.decode(ids) != tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    except Exception:  # noqa: BLE001 - cannot tell: decode whole answers, exact as before
        return True
