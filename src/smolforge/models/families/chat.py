"""What a chat template does, read by rendering it (never by its model type): the one probe every path asks.

A template is asked with probe messages whose texts are unlikely markers, and the rendered string says:
- `end_of_turn`: the token that closes an assistant turn (the first added or special token after the
  assistant's text: `<|im_end|>` for ChatML, `<|end|>` for Phi-3, `<|eot_id|>` for Llama 3, `</s>` for Zephyr);
- `system`: whether a system message's text reaches the rendering (Phi-3's published template drops it;
  Gemma's raises "System role not supported");
- `tools`: whether a `tools` list changes the rendering;
- `uses_time`: whether the template reads the clock (`strftime_now`) or a `date_string` it defaults itself,
  so a rendering depends on the day (Llama 3.x's "Today Date").

Rendering goes through transformers' `apply_chat_template` (its sandboxed Jinja environment and its
`strftime_now`, the same one training uses); a template that raises on a probe lacks that ability.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

SYSTEM_PROBE = "SYSTEMPROBE7Q"
USER_PROBE = "USERPROBE7Q"
ANSWER_PROBE = "ANSWERPROBE7Q"
TOOL_PROBE = {"type": "function", "function": {"name": "toolprobe7q", "description": "a probe",
                                                "parameters": {"type": "object", "properties": {}}}}


@dataclass(frozen=True)
class ChatAbilities:
    """A chat template's abilities. `template` is None when the tokenizer has none (then all False)."""

    template: str | None
    system: bool
    tools: bool
    uses_time: bool
    end_of_turn: str | None  # the token text that ends an assistant turn, None when it is not one token

    @property
    def has_template(self) -> bool:
        return self.template is not None


_CACHE: "weakref.WeakKeyDictionary[Any, ChatAbilities]" = weakref.WeakKeyDictionary()


def render(tokenizer: Any, messages: list[dict], **kwargs: Any) -> str:
    """`messages` through the tokenizer's chat template as text (transformers' Jinja environment). Raises
    what the template raises (jinja2's TemplateError for `raise_exception`)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def _renders(tokenizer: Any, messages: list[dict], **kwargs: Any) -> str | None:
    try:
        return render(tokenizer, messages, **kwargs)
    except Exception:  # noqa: BLE001 - any failure of a probe means "not able"
        return None


def _end_of_turn(tokenizer: Any) -> str | None:
    """The first token after the assistant's text in a rendered turn, when it is an added/special token."""
    text = _renders(tokenizer, [{"role": "user", "content": USER_PROBE}, {"role": "assistant", "content": ANSWER_PROBE}])
    if not text or ANSWER_PROBE not in text:
        return None
    suffix = text[text.rindex(ANSWER_PROBE) + len(ANSWER_PROBE):]
    ids = tokenizer(suffix, add_special_tokens=False)["input_ids"] if suffix else []
    if not ids:
        return None
    added = {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {}) or {}}
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    first = int(ids[0])
    return tokenizer.convert_ids_to_tokens(first) if first in added | special else None


def abilities(tokenizer: Any) -> ChatAbilities:
    """The tokenizer's chat template's abilities (cached per tokenizer object and template)."""
    template = getattr(tokenizer, "chat_template", None)
    try:
        cached = _CACHE[tokenizer]
        if cached.template == (template if isinstance(template, str) and template else None):
            return cached
    except (KeyError, TypeError):
        pass
    if not isinstance(template, str) or not template:
        found = ChatAbilities(None, False, False, False, None)
    else:
        user = [{"role": "user", "content": USER_PROBE}]
        with_system = _renders(tokenizer, [{"role": "system", "content": SYSTEM_PROBE}, *user])
        plain = _renders(tokenizer, user)
        with_tools = _renders(tokenizer, user, tools=[TOOL_PROBE])
        found = ChatAbilities(
            template=template,
            system=bool(with_system and SYSTEM_PROBE in with_system),
            tools=bool(with_tools and plain is not None and with_tools != plain and "toolprobe7q" in with_tools),
            uses_time="strftime_now" in template or "date_string" in template,
            end_of_turn=_end_of_turn(tokenizer),
        )
    try:
        _CACHE[tokenizer] = found
    except TypeError:
        pass
    return found
