"""Log-probabilities in OpenAI's two response shapes: chat's `logprobs.content` and the legacy
completions' `tokens` / `token_logprobs` / `top_logprobs` / `text_offset` (with llama-server's `content`
list beside them, so a client that reads bytes gets them from either endpoint).

What the engine sends are token ids and numbers (`events.TokenLogprob`); the text of each token is
made here, on the HTTP side, which holds the tokenizer. A token's text is what it adds to the complete
characters of the text before it (the difference of two decodes over a short window), so the tokens of
an answer join into its text (a SentencePiece token's leading space, a byte-level token's bytes), as
vLLM's incremental detokenizer makes them; a token that only starts a character adds no text yet (""),
the one that completes it adds the character (llama-server names such a token "" too).

`bytes` are the token's own bytes (`models.token_bytes.vocab_bytes`: the tokenizer's one answer), so a
byte of a multi-byte character is its raw byte, not U+FFFD's three; the bytes of an answer's tokens join
into its UTF-8. A special token (no bytes of its own) gives its text's UTF-8.

Torch-free: with `serve --front process` this runs in the HTTP process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from smolforge.models.token_bytes import vocab_bytes
from smolforge.serve.events import TokenLogprob

WINDOW = 4  # tokens of context for a token's text: enough for a character split over byte tokens
PARTIAL = "\ufffd"  # what a decode shows for the bytes of a character not yet complete


@dataclass
class Named:
    """One position as the API names it: the token's text and bytes, its entry (None: a prompt's first
    token, which nothing before it predicts) and its alternatives as (text, bytes, logprob), best first."""

    text: str
    raw: bytes
    entry: TokenLogprob | None
    alts: list[tuple[str, bytes, float]]


@dataclass
class TokenText:
    """Each position's token text and bytes after the ids before it (`seen`), for one answer or prompt."""

    tokenizer: Any
    seen: list[int] = field(default_factory=list)
    raw: list[bytes | None] = field(init=False)

    def __post_init__(self) -> None:
        self.raw = vocab_bytes(self.tokenizer)

    def piece(self, token: int, before: list[int] | None = None) -> str:
        """What `token` adds to the complete characters of the text of `before` (default: the ids seen so
        far): "" for a token that only starts a character, the whole character for the one ending it.
        Where a character is split over tokens it is counted in bytes (a SentencePiece decoder turns a
        run of byte tokens that ends mid-character into U+FFFDs, the complete characters before too)."""
        before = self.seen if before is None else before
        raw = self.raw[token] if 0 <= token < len(self.raw) else None
        pending = self._pending(before)
        if raw is not None and (pending or incomplete_tail(raw) or (raw and raw[0] & 0xC0 == 0x80)):
            joined = pending + raw
            return joined[:len(joined) - len(incomplete_tail(joined))].decode("utf-8", "replace")
        ctx = self._window(before)
        head = self.tokenizer.decode(ctx) if ctx else ""
        full = self.tokenizer.decode([*ctx, token])
        if full.startswith(head) and not full.endswith(PARTIAL):
            return full[len(head):]
        head, whole = head.rstrip(PARTIAL), full.rstrip(PARTIAL)  # half a character is no text yet
        return whole[len(head):] if whole.startswith(head) else full

    def _window(self, before: list[int]) -> list[int]:
        """The last WINDOW ids of `before`, reaching back (at most WINDOW more) so that the first one does not
        continue a character begun before it (its decode would start with U+FFFD)."""
        start = max(0, len(before) - WINDOW)
        while start > 0 and start > len(before) - 2 * WINDOW and self._continues(before[start]):
            start -= 1
        return before[start:]

    def _pending(self, before: list[int]) -> bytes:
        """The bytes of a character the tokens of `before` began and have not finished (b"" if none)."""
        tail = b""
        for t in reversed(before[-4:]):
            raw = self.raw[t] if 0 <= t < len(self.raw) else None
            if raw is None:
                break
            tail = raw + tail
            if len(tail) >= 4:
                break
        return incomplete_tail(tail)

    def _continues(self, token: int) -> bool:
        raw = self.raw[token] if 0 <= token < len(self.raw) else None
        return bool(raw) and raw[0] & 0xC0 == 0x80  # type: ignore[index]

    def bytes_of(self, token: int, text: str) -> bytes:
        """The token's own bytes; a token without any (a special token) gives its text's UTF-8."""
        found = self.raw[token] if 0 <= token < len(self.raw) else None
        return found if found is not None else text.encode("utf-8")

    def named(self, token: int, before: list[int]) -> tuple[str, bytes]:
        text = self.piece(token, before)
        return text, self.bytes_of(token, text)

    def entries(self, logprobs: list[TokenLogprob | None], first_id: int | None = None) -> list[Named]:
        """Each position named (`Named`), its id added to `seen`. A None entry (a prompt's first token:
        nothing before it to predict it) is `first_id`'s text alone."""
        out: list[Named] = []
        for entry in logprobs:
            before = list(self.seen)
            if entry is None:
                text, raw = self.named(first_id, before) if first_id is not None else ("", b"")
                if first_id is not None:
                    self.seen.append(first_id)
                out.append(Named(text, raw, None, []))
                continue
            text, raw = self.named(entry.id, before)
            alts = [(*self.named(i, before), lp) for i, lp in entry.top]
            self.seen.append(entry.id)
            out.append(Named(text, raw, entry, alts))
        return out


def incomplete_tail(data: bytes) -> bytes:
    """The last bytes of `data` that begin a UTF-8 character and do not finish it (b"" if none)."""
    for back in range(1, min(4, len(data)) + 1):
        c = data[-back]
        if c & 0xC0 == 0x80:  # a continuation byte: the character began further back
            continue
        need = 2 if c >> 5 == 0b110 else 3 if c >> 4 == 0b1110 else 4 if c >> 3 == 0b11110 else 1
        return data[-back:] if need > back else b""
    return b""


def _content(named: list[Named]) -> list[dict[str, Any]]:
    """OpenAI's chat `logprobs.content` entries (a prompt's first position: logprob null, no alternatives)."""
    return [{"token": n.text, "logprob": n.entry.logprob if n.entry is not None else None, "bytes": list(n.raw),
             "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(raw)} for t, raw, lp in n.alts]}
            for n in named]


def chat_logprobs(names: TokenText, logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """`choices[i].logprobs` of a chat completion (or of one streamed chunk)."""
    return {"content": _content(names.entries(list(logprobs))), "refusal": None}


def completion_logprobs(names: TokenText, logprobs: list[TokenLogprob | None], offset: int = 0,
                        first_id: int | None = None) -> dict[str, Any]:
    """`choices[i].logprobs` of a legacy completion: per position the token's text, its logprob, a dict
    of the most likely tokens' texts to logprobs (the chosen one always among them, as OpenAI's), and
    where its text starts in the choice's `text` (from `offset`); and `content`, the same positions in
    the chat shape with each token's bytes, as llama-server answers completions (a dict keyed by text
    cannot tell apart two tokens whose text is the same, such as two bytes of different characters).
    A None entry (the prompt's first token with echo: `first_id`) has a null logprob and no alternatives."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    named = names.entries(logprobs, first_id)
    for n in named:
        if n.entry is None:
            values.append(None)
            tops.append(None)
        else:
            values.append(n.entry.logprob)
            top = {t: lp for t, _, lp in reversed(n.alts)}  # a text two alternatives share: the likelier's
            top = dict(sorted(top.items(), key=lambda kv: -kv[1]))
            top.setdefault(n.text, n.entry.logprob)
            tops.append(top)
        tokens.append(n.text)
        offsets.append(offset)
        offset += len(n.text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets,
            "content": _content(named)}
