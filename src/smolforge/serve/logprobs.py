"""Log-probabilities in OpenAI's two response shapes: chat's `logprobs.content` and the legacy
completions' `tokens` / `token_logprobs` / `top_logprobs` / `text_offset`.

What the engine sends are token ids and numbers (`events.TokenLogprob`); the text of each token is
made here, on the HTTP side, which holds the tokenizer. A token's text is what it adds to the text
before it (the difference of two decodes over a short window), so the tokens of an answer join into
its text (a SentencePiece token's leading space, a byte-level token's bytes), as vLLM's incremental
detokenizer makes them; `bytes` is that text's UTF-8 (half a character decodes to U+FFFD, as in vLLM).

Torch-free: with `serve --front process` this runs in the HTTP process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from smolforge.serve.events import TokenLogprob

WINDOW = 4  # tokens of context for a token's text: enough for a character split over byte tokens


@dataclass
class TokenText:
    """Each position's token text after the ids before it (`seen`), for one answer or prompt."""

    tokenizer: Any
    seen: list[int] = field(default_factory=list)

    def piece(self, token: int, before: list[int] | None = None) -> str:
        """What `token` adds to the text of `before` (default: the ids seen so far)."""
        ctx = (self.seen if before is None else before)[-WINDOW:]
        head = self.tokenizer.decode(ctx) if ctx else ""
        full = self.tokenizer.decode([*ctx, token])
        return full[len(head):] if full.startswith(head) else full

    def entries(self, logprobs: list[TokenLogprob | None],
                first_id: int | None = None) -> list[tuple[str, TokenLogprob | None, list[tuple[str, float]]]]:
        """(text, entry, [(alternative's text, logprob), ...]) per position, the ids added to `seen`. A None
        entry (a prompt's first token: nothing before it to predict it) is `first_id`'s text alone."""
        out: list[tuple[str, TokenLogprob | None, list[tuple[str, float]]]] = []
        for entry in logprobs:
            before = list(self.seen)
            if entry is None:
                text = self.piece(first_id, before) if first_id is not None else ""
                if first_id is not None:
                    self.seen.append(first_id)
                out.append((text, None, []))
                continue
            text = self.piece(entry.id, before)
            alts = [(self.piece(i, before), lp) for i, lp in entry.top]
            self.seen.append(entry.id)
            out.append((text, entry, alts))
        return out


def chat_logprobs(names: TokenText, logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """`choices[i].logprobs` of a chat completion (or of one streamed chunk)."""
    content = []
    for text, entry, alts in names.entries(list(logprobs)):
        assert entry is not None
        content.append({"token": text, "logprob": entry.logprob, "bytes": list(text.encode("utf-8")),
                        "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
                                         for t, lp in alts]})
    return {"content": content, "refusal": None}


def completion_logprobs(names: TokenText, logprobs: list[TokenLogprob | None], offset: int = 0,
                        first_id: int | None = None) -> dict[str, Any]:
    """`choices[i].logprobs` of a legacy completion: per position the token's text, its logprob, a dict
    of the most likely tokens' texts to logprobs (the chosen one always among them, as OpenAI's), and
    where its text starts in the choice's `text` (from `offset`). A None entry (the prompt's first
    token with echo: `first_id`) has a null logprob and null alternatives."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for text, entry, alts in names.entries(logprobs, first_id):
        if entry is None:
            values.append(None)
            tops.append(None)
        else:
            values.append(entry.logprob)
            top = dict(alts)
            top.setdefault(text, entry.logprob)
            tops.append(top)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
