"""What a request's sink receives (`TokenEvent`, `DoneEvent`, `ErrorEvent`), the two refusals of
`submit` (`PromptTooLong`, `EngineStopped`) and the context-length rule (`ContextLimits`).

Why a module of their own, without torch: the HTTP side needs exactly these and nothing of the
model, and with `serve --front process` (the default) it runs in a process of its own
(`serve/front.py`) that must not pay torch's import time and memory for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from smolforge.errors import SmolforgeError

LOGPROB_FLOOR = -9999.0  # OpenAI's value for "very unlikely": -inf (a masked logit) is no JSON number


@dataclass
class TokenLogprob:
    """One position's log-probabilities: of the token that stands there (`id`) and of the `top` most
    likely tokens at that position, best first, as (id, logprob) pairs. Natural log, of the raw model
    distribution (log-softmax of the logits, before temperature and top-p: see `sampling.token_logprobs`),
    floored at LOGPROB_FLOOR. Ids, not text: the HTTP side turns them into strings and bytes."""

    id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)

    def wire(self) -> list[Any]:
        """As a JSON value: [id, logprob, [[id, logprob], ...]]."""
        return [self.id, self.logprob, [list(t) for t in self.top]]

    @classmethod
    def from_wire(cls, value: list[Any]) -> "TokenLogprob":
        return cls(int(value[0]), float(value[1]), [(int(i), float(lp)) for i, lp in value[2]])


@dataclass
class TokenEvent:
    """One per generated token: its new text for the client (empty while a stop string or half a
    character is held back, or for a token that has no text), so the first arrives with the first
    token. `logprobs`: when the request asked for them, the positions generated since the last event
    that carried some (text held back still has its tokens' log-probabilities sent with the text that
    releases it: an empty list until then); `prompt_logprobs` (echo) on a request's first event only:
    one per prompt token, the first None."""

    text: str
    token_id: int
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class DoneEvent:
    """The request ended: `finish_reason` is "stop" (EOS or a stop string), "length" or "cancelled".
    `cached_tokens`: how many of the prompt's tokens the prefix cache served (restored, not computed)."""

    finish_reason: str
    text: str
    prompt_tokens: int
    completion_tokens: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # every generated position's, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # echo with logprobs: the prompt's, first None
    cached_tokens: int = 0


@dataclass
class ErrorEvent:
    """The request failed: `status` 400 when its own settings caused it, 500 when the server did."""

    message: str
    status: int = 500


Event = TokenEvent | DoneEvent | ErrorEvent


class PromptTooLong(SmolforgeError):
    """The prompt and the tokens asked for do not fit the model's context."""


class EngineStopped(SmolforgeError):
    """The engine's thread is not running: nothing can be generated (ours, not the caller's: exit 1)."""

    exit_code = 1


class ContextLimits:
    """The one rule for what fits the model's context, shared by the engine and its remote handle
    (`serve/channel.py` `RemoteEngine`), so the HTTP side refuses exactly what the engine would."""

    max_positions: int

    def check_length(self, prompt_tokens: int, max_tokens: int) -> None:
        """Refuse (PromptTooLong) a request whose prompt plus `max_tokens` exceeds the context."""
        if prompt_tokens < 1:
            raise PromptTooLong("the prompt is empty", fix="send at least one token of prompt")
        if prompt_tokens + max_tokens > self.max_positions:
            raise PromptTooLong(
                f"the prompt has {prompt_tokens} tokens and max_tokens is {max_tokens}: together over the model's "
                f"context of {self.max_positions} tokens",
                fix=f"shorten the prompt or lower max_tokens to at most {max(0, self.max_positions - prompt_tokens)}")

    def room(self, prompt_tokens: int) -> int:
        """The most tokens a prompt of this length leaves room for."""
        return max(0, self.max_positions - prompt_tokens)
