"""Turn examples into token ids and labels: chat template, response-only loss, truncation, packing.

The chat template is rendered turn by turn and each piece tokenized on its own, so the boundary
between prompt and response is exact (tokenizing the whole string and searching for the response
breaks when BPE merges across the boundary).

Rendering is checked against the messages: every message's text must reach the rendered row.
- A system turn under a template without a system role (the caller says so: `system_role`, the
  model family's answer, models/families/chat.py) is folded into the user turn after it,
  `system + "\n\n" + user`, as Gemma 3's published template does itself and LlamaFactory's
  gemma/gemma2/gemma3 fine-tuning templates do (`format_system` "{{content}}\n\n" put before the
  first user turn); the rows folded are counted (`EncodeStats.folded`, `fold_note`).
- A record's `tools` go to every rendering of it (transformers' `tools=`); its calls' function names and
  its tools' names must reach the row too (a template without tools leaves them out: refused, not
  learnt without them).
- Any other loss (a message whose text is not in the rendering) and a template that raises is a
  `RenderError`: a bad line (`file:line`, the template's own words), skipped and counted under
  `skip_bad_lines` as the reader does its bad lines (formats.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from smolforge.data.chat_turns import names_in
from smolforge.data.formats import Example
from smolforge.errors import SmolforgeError

IGNORE = -100
FOLD_SEPARATOR = "\n\n"
# Used when a tokenizer has no chat template (e.g. base GPT-2): plain and easy to read.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}### {{ message['role'] }}:\n{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant:\n{% endif %}"
)
_REFUSED_FIX = ("edit the record so the model's chat template accepts it (its words say what it refuses), "
                "or train a model whose template does")
_LOST_FIX = "move that text into a user turn (the model's chat template leaves such a turn out)"
_TOOLS_FIX = ("train a model whose chat template renders tools (e.g. a Qwen2.5 or Llama 3.x kind), or drop the "
              "record's tools and tool calls")


class RenderError(ValueError):
    """A record the chat template does not render whole: `what` (the template's own words, or which
    message's text does not reach the row) and `fix`. A bad line, like a malformed one."""

    def __init__(self, what: str, fix: str):
        super().__init__(what)
        self.what, self.fix = what, fix


def ensure_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = FALLBACK_TEMPLATE


def render(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool, **template_kwargs) -> str:
    """`messages` through the chat template as text; `template_kwargs` (`tools=`) go to `apply_chat_template`."""
    ensure_chat_template(tokenizer)
    if not messages:
        return ""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **template_kwargs)


def prompt_text(tokenizer, example: Example) -> str:
    """What the model sees at generation time: the prompt turns plus the assistant header."""
    return render(tokenizer, example.prompt_messages, add_generation_prompt=True, **_tools(example.tools))


def _tools(tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The template's keyword for a record's tools (`chat_turns`): none when it has none."""
    return {"tools": tools} if tools else {}


def fold_system(messages: list[dict[str, str]]) -> tuple[list[dict[str, str]], bool]:
    """(messages, folded?): each run of system turns joined into the user turn right after it,
    `system + "\n\n" + user`. A system turn not followed by a user turn stays where it is (rendering
    then keeps it, drops it or refuses it, and the check says which)."""
    out: list[dict[str, str]] = []
    pending: list[dict[str, str]] = []
    folded = False
    for message in messages:
        if message["role"] == "system":
            pending.append(message)
            continue
        if pending and message["role"] == "user":
            text = FOLD_SEPARATOR.join([m["content"] for m in pending] + [message["content"]])
            out.append({**message, "content": text})
            folded = True
        else:
            out += pending + [message]
        pending = []
    return out + pending, folded


def fold_note(rows: int, model: str) -> str:
    """The one line a run prints when it folded system turns (`rows` of its examples)."""
    return (f"folded the system turn into the first user turn in {rows} row{'s' if rows != 1 else ''}: "
            f"the template of {model} has no system role")


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


@dataclass
class Rendered:
    """One example as training sees it: `input_ids` and `labels` (same length; IGNORE where the loss
    does not reach), the rendered `text`, the `messages` rendered (after any fold; None for text
    examples) and whether a system turn was `folded`."""

    input_ids: list[int]
    labels: list[int]
    text: str
    messages: list[dict[str, str]] | None = None
    folded: bool = False


def _render_checked(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None = None) -> str:
    """`render`, with whatever the template raises on this record turned into a RenderError in its words."""
    try:
        return render(tokenizer, messages, add_generation_prompt, **_tools(tools))
    except Exception as err:  # noqa: BLE001 - raise_exception's TemplateError, or Jinja failing on this record
        words = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RenderError(f"the chat template refuses this record: {words}", _REFUSED_FIX) from None


def _unstable() -> RenderError:
    return RenderError("the chat template renders earlier turns differently once later turns follow, so the "
                       "prompt cannot be masked", "use a model whose chat template renders a conversation turn by turn "
                       "(or convert the record to prompt/completion)")


def _turns(tokenizer, msgs: list[dict[str, Any]],
           tools: list[dict[str, Any]] | None = None) -> tuple[list[int], list[int], str, list[int]]:
    """(input_ids, labels, rendered text, where each message's piece starts in the text); `tools` go to
    every rendering (the template writes them into the first turn)."""
    input_ids: list[int] = []
    labels: list[int] = []
    starts: list[int] = []
    done = ""
    for i, message in enumerate(msgs):
        starts.append(len(done))
        if message["role"] == "assistant":
            before = _render_checked(tokenizer, msgs[:i], add_generation_prompt=True, tools=tools)
            after = _render_checked(tokenizer, msgs[: i + 1], add_generation_prompt=False, tools=tools)
            if not (before.startswith(done) and after.startswith(before)):
                raise _unstable()
            head = _ids(tokenizer, before[len(done):])
            body = _ids(tokenizer, after[len(before):])
            input_ids += head + body
            labels += [IGNORE] * len(head) + body
        else:
            after = _render_checked(tokenizer, msgs[: i + 1], add_generation_prompt=False, tools=tools)
            if not after.startswith(done):
                raise _unstable()
            head = _ids(tokenizer, after[len(done):])
            input_ids += head
            labels += [IGNORE] * len(head)
        done = after
    return input_ids, labels, done, starts


def _check_reached(msgs: list[dict[str, Any]], text: str, starts: list[int],
                   tools: list[dict[str, Any]] | None = None) -> None:
    """Every message's text (stripped: templates may trim) and its calls' function names in the rendering,
    at or after where its piece starts (a template may place it later, e.g. a system text in the first user
    turn); every tool's name in it (a template without tools drops them: nothing is learnt silently without)."""
    for message, start in zip(msgs, starts):
        for needle in [message["content"].strip(), *names_in(message)]:
            if needle and needle not in text[start:]:
                shown = needle if len(needle) <= 40 else needle[:37] + "..."
                raise RenderError(f"the {message['role']} turn {shown!r} does not reach the rendered row: the chat "
                                  "template leaves it out", _LOST_FIX)
    for tool in tools or ():
        if tool["function"]["name"] not in text:
            raise RenderError(f"the tool {tool['function']['name']!r} does not reach the rendered row: the chat "
                              "template leaves the record's tools out", _TOOLS_FIX)


def encode_rendered(tokenizer, example: Example, system_role: bool = True) -> Rendered:
    """The example rendered, checked and tokenized: labels = IGNORE everywhere but assistant turns (or
    all, for text). `system_role`: whether the model's chat template renders a system turn (the
    family's answer, `abilities(tokenizer).system`); when False, system turns are folded first.
    Raises RenderError (the template refuses the record, or drops a message's text)."""
    if example.text is not None:
        ids = _ids(tokenizer, example.text)
        bos = tokenizer.bos_token_id
        if bos is not None and bos != tokenizer.eos_token_id:
            ids = [bos] + ids
        if tokenizer.eos_token_id is not None:
            ids = ids + [tokenizer.eos_token_id]
        return Rendered(ids, list(ids), example.text)
    msgs, folded = (list(example.messages or []), False) if system_role else fold_system(example.messages or [])
    input_ids, labels, text, starts = _turns(tokenizer, msgs, example.tools)
    _check_reached(msgs, text, starts, example.tools)
    return Rendered(input_ids, labels, text, msgs, folded)


def encode_example(tokenizer, example: Example, system_role: bool = True) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of `encode_rendered`."""
    rendered = encode_rendered(tokenizer, example, system_role)
    return rendered.input_ids, rendered.labels


@dataclass
class EncodeStats:
    examples: int = 0
    truncated: int = 0
    dropped_no_target: int = 0
    tokens: int = 0
    target_tokens: int = 0
    sequences: int = 0
    folded: int = 0  # examples whose system turns were folded into the next user turn
    skipped: int = 0  # bad lines (RenderError) skipped under skip_bad_lines
    problems: list[str] = field(default_factory=list)  # "file:line: what", one per skipped line
    kept: list[Example] = field(default_factory=list, repr=False)  # the examples as rendered (folded), bad ones out
    notes: list[str] = field(default_factory=list)


def _rendered_or_skipped(tokenizer, ex: Example, system_role: bool, skip_bad_lines: bool,
                         stats: EncodeStats) -> Rendered | None:
    try:
        return encode_rendered(tokenizer, ex, system_role)
    except RenderError as bad:
        if not skip_bad_lines:
            raise SmolforgeError(bad.what, where=ex.source,
                                 fix=f"{bad.fix}; or pass --skip-bad-lines to skip such lines") from None
        stats.skipped += 1
        stats.problems.append(f"{ex.source}: {bad.what}")
        return None


def encode_all(tokenizer, examples: list[Example], max_length: int, packing: bool = False, *,
               system_role: bool = True, skip_bad_lines: bool = False):
    """Encode (checked, folded where `system_role` is False), truncate to max_length (counted), drop
    examples left with no target, optionally pack. Returns (rows, EncodeStats). A record the template
    refuses or drops text of raises SmolforgeError at its file:line, or with `skip_bad_lines` is
    skipped and counted (`stats.skipped`, `stats.problems`)."""
    stats = EncodeStats(examples=len(examples))
    rows: list[dict[str, list[int]]] = []
    for ex in examples:
        rendered = _rendered_or_skipped(tokenizer, ex, system_role, skip_bad_lines, stats)
        if rendered is None:
            continue
        stats.folded += rendered.folded
        stats.kept.append(ex if not rendered.folded else Example(ex.source, messages=rendered.messages))
        ids, labels = rendered.input_ids, rendered.labels
        if len(ids) > max_length:
            stats.truncated += 1
            ids, labels = ids[:max_length], labels[:max_length]
        if all(x == IGNORE for x in labels[1:]):
            stats.dropped_no_target += 1
            continue
        rows.append({"input_ids": ids, "labels": labels})
    if packing:
        rows = pack(rows, max_length)
    stats.sequences = len(rows)
    stats.tokens = sum(len(r["input_ids"]) for r in rows)
    stats.target_tokens = sum(sum(1 for x in r["labels"][1:] if x != IGNORE) for r in rows)
    return rows, stats


def pack(rows: list[dict[str, list[int]]], max_length: int) -> list[dict[str, list[int]]]:
    """Concatenate examples into max_length blocks, so no compute goes to padding."""
    packed: list[dict[str, list[int]]] = []
    cur_ids: list[int] = []
    cur_labels: list[int] = []
    for r in rows:
        if cur_ids and len(cur_ids) + len(r["input_ids"]) > max_length:
            packed.append({"input_ids": cur_ids, "labels": cur_labels})
            cur_ids, cur_labels = [], []
        cur_ids = cur_ids + r["input_ids"]
        cur_labels = cur_labels + r["labels"]
    if cur_ids:
        packed.append({"input_ids": cur_ids, "labels": cur_labels})
    return packed
