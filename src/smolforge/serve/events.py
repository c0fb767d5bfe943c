"""What a request's sink receives (`TokenEvent`, `DoneEvent`, `ErrorEvent`), the two refusals of
`submit` (`PromptTooLong`, `EngineStopped`) and the context-length rule (`ContextLimits`).

Why a module of their own, without torch: the HTTP side needs exactly these and nothing of the
model, and with `serve --front process` (the default) it runs in a process of its own
(`serve/front.py`) that must not pay torch's import time and memory for them.
"""

from __future__ import annotations

from dataclasses import dataclass

from smolforge.errors import SmolforgeError


@dataclass
class TokenEvent:
    """New text for the client (may be empty while a stop string or half a character is held back)."""

    text: str
    token_id: int


@dataclass
class DoneEvent:
    """The request ended: `finish_reason` is "stop" (EOS or a stop string), "length" or "cancelled"."""

    finish_reason: str
    text: str
    prompt_tokens: int
    completion_tokens: int
    token_ids: list[int]


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
