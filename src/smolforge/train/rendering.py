"""What training renders with, asked of the model family: the one place train/ and its callers learn
whether a tokenizer's chat template has a system role, so data/ (which must not import models/) is
told, not left to guess. Every path that encodes training rows (`smolforge train`, `eval`, `demo`,
split learning, `smolforge data show`) goes through `load_checked_splits` or `system_role`.
"""

from __future__ import annotations

from typing import Any

from smolforge.config import DataSpec
from smolforge.data.encode import ensure_chat_template, fold_system, render
from smolforge.data.formats import Example
from smolforge.data.splits import Splits, load_splits
from smolforge.models.families import abilities


def system_role(tokenizer: Any) -> bool:
    """Whether the chat template training renders with (the tokenizer's own, or data/'s fallback when it
    has none, set here first) renders a system turn's text (models/families/chat.py probes it)."""
    ensure_chat_template(tokenizer)
    return abilities(tokenizer).system


def load_checked_splits(spec: DataSpec, tokenizer: Any,
                        read: tuple[list[Example], list[Example], str, int] | None = None) -> Splits:
    """`load_splits` told the template's system role: system turns folded where it has none (counted in
    `Splits.folded`), a record the template refuses or drops text of a bad line (file:line, exit 2, or
    skipped and counted under `spec.skip_bad_lines`)."""
    return load_splits(spec, tokenizer, read, system_role=system_role(tokenizer))


def prompt_messages(tokenizer: Any, messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The prompt turns as the model is asked them: system turns folded into the next user turn when the
    template has no system role, as training folds them (`data.encode.fold_system`), so a teacher, the
    server and the trained model read one prompt the same way."""
    return messages if system_role(tokenizer) else fold_system(messages)[0]


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    """`messages` rendered for generation (the assistant header added), folded as `prompt_messages` says;
    `tools` (OpenAI tool objects) go to the template as transformers' `tools=`. Raises what the template
    raises (jinja2's TemplateError for one it refuses)."""
    extra = {"tools": tools} if tools else {}
    return render(tokenizer, prompt_messages(tokenizer, messages), add_generation_prompt=True, **extra)
