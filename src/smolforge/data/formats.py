"""Read JSONL in the formats people have, into one normalised `Example`.

Formats (detected per file from the first record, or forced):
- alpaca: {instruction, input?, output}
- chat: {messages: [{role, content}, ...], tools?} (tool calls and tool turns: `chat_turns`)
- prompt_completion: {prompt, completion}
- text: {text}

Every problem names file:line and the fix; with `skip_bad_lines` bad lines are counted, not fatal.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from smolforge.data.chat_turns import tools_of, turn_of
from smolforge.errors import SmolforgeError
from smolforge.paths import not_a_regular_file

FORMATS = ("alpaca", "chat", "prompt_completion", "text")
_FIX = {
    "alpaca": 'each line must look like {"instruction": "...", "input": "...", "output": "..."} (input optional)',
    "chat": 'each line must look like {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}',
    "prompt_completion": 'each line must look like {"prompt": "...", "completion": "..."}',
    "text": 'each line must look like {"text": "..."}',
}


@dataclass
class Example:
    """One training record: either chat messages (loss on assistant turns) or raw text (loss on all).
    `tools`: the record's OpenAI tool objects, given to the chat template with every rendering of it
    (`chat_turns`); a turn may then carry `tool_calls` / `tool_call_id` / `name`."""

    source: str
    messages: list[dict[str, Any]] | None = None
    text: str | None = None
    tools: list[dict[str, Any]] | None = None

    @property
    def prompt_messages(self) -> list[dict[str, str]]:
        """The conversation up to the last assistant turn: what a model is asked at eval time (all of
        it when there is no assistant turn: a prompt for a teacher to answer)."""
        assert self.messages is not None
        turns = [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]
        return self.messages[: turns[-1]] if turns else list(self.messages)

    @property
    def answer(self) -> str | None:
        """The reference answer (last assistant turn) for exact-match accuracy; None for text."""
        if not self.messages:
            return None
        for m in reversed(self.messages):
            if m["role"] == "assistant":
                return m["content"]
        return None


@dataclass
class ReadResult:
    examples: list[Example]
    format: str
    skipped: int = 0
    problems: list[str] = field(default_factory=list)


def detect_format(record: dict) -> str | None:
    if "messages" in record:
        return "chat"
    if "instruction" in record or "output" in record:
        return "alpaca"
    if "prompt" in record or "completion" in record:
        return "prompt_completion"
    if "text" in record:
        return "text"
    return None


def _need_str(record: dict, key: str, fmt: str, optional: bool = False) -> str:
    if key not in record:
        if optional:
            return ""
        raise ValueError(f'missing field "{key}" for {fmt} format')
    value = record[key]
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        raise ValueError(f'field "{key}" must be a string, got {type(value).__name__}')
    return value


def _asked(user: str, answer: str | None) -> list[dict[str, str]]:
    turns = [{"role": "user", "content": user}]
    return turns + [{"role": "assistant", "content": answer}] if answer is not None else turns


def to_example(record: dict, fmt: str, source: str, prompts_only: bool = False) -> Example:
    """Normalise one record; raises ValueError with the field at fault.

    `prompts_only`: the answer may be missing (a prompt for a teacher to answer: distillation needs
    prompts, not labels); an answer that is there is kept as the reference."""
    if fmt == "alpaca":
        instruction = _need_str(record, "instruction", fmt)
        extra = _need_str(record, "input", fmt, optional=True)
        output = _need_str(record, "output", fmt) if not prompts_only or "output" in record else None
        return Example(source, messages=_asked(f"{instruction}\n\n{extra}" if extra else instruction, output))
    if fmt == "prompt_completion":
        prompt = _need_str(record, "prompt", fmt)
        completion = _need_str(record, "completion", fmt) if not prompts_only or "completion" in record else None
        return Example(source, messages=_asked(prompt, completion))
    if fmt == "chat":
        messages = record.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError('field "messages" must be a non-empty list')
        clean = [turn_of(m, i) for i, m in enumerate(messages)]
        if not prompts_only and not any(m["role"] == "assistant" for m in clean):
            raise ValueError("messages has no assistant turn to learn from")
        if prompts_only and clean[-1]["role"] == "system":
            raise ValueError("messages ends with a system turn: nothing asked to answer")
        return Example(source, messages=clean, tools=tools_of(record.get("tools")))
    if fmt == "text":
        return Example(source, text=_need_str(record, "text", fmt))
    raise ValueError(f"unknown format {fmt!r}")


class BadLine(Exception):
    """One line that is not a usable record: what is wrong with it and how to fix it."""

    def __init__(self, what: str, fix: str):
        super().__init__(what)
        self.what, self.fix = what, fix


def jsonl_records(path: str | Path) -> Iterator[tuple[int, dict | BadLine]]:
    """Every non-blank line of a JSONL file as (line number from 1, its JSON object), or a `BadLine`
    in place of a line that is not one (the caller decides: refuse with file:line, or skip and count).

    The one reader of JSONL files: a UTF-8 byte-order mark at the start of the file (what Windows
    editors and PowerShell's `Out-File -Encoding utf8` write) is not part of the first record (as
    `encoding="utf-8-sig"` reads it), and CRLF line ends are LF ones; line numbers count the file's
    own lines either way. Each line is decoded on its own, so one line of bad UTF-8 is one bad line.
    Raises SmolforgeError at the call (not at the first record) for a missing path, a directory or a
    file with nothing but blank lines."""
    path = Path(path)
    problem = not_a_regular_file(path)
    if problem == "does not exist":
        raise SmolforgeError(f"data file {path} does not exist", fix="check the --data path (or use --data bundled)")
    if problem:
        raise SmolforgeError(f"{path} {problem}, not a JSONL file", fix="point --data at a .jsonl file")
    raw = path.read_bytes().removeprefix(codecs.BOM_UTF8)
    if not raw.strip():
        raise SmolforgeError("data file is empty", where=str(path), fix="add one JSON object per line")
    lines = enumerate((line.removesuffix(b"\r") for line in raw.split(b"\n")), start=1)
    return ((lineno, _record(line)) for lineno, line in lines if line.strip())


def _record(line: bytes) -> dict | BadLine:
    """One line's JSON object, or what is wrong with it."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as err:
        return BadLine(f"not valid UTF-8 (byte {err.start})", "save the file as UTF-8 (e.g. iconv -t UTF-8)")
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        return BadLine(f"malformed JSON: {err.msg} at column {err.colno}", "write one complete JSON object per line")
    except RecursionError:  # e.g. [[[[...]]]] 100 000 deep: json recurses per level
        return BadLine("JSON nested too deeply", "write flat records (messages are one list of objects)")
    if not isinstance(record, dict):
        return BadLine(f"expected a JSON object, got {type(record).__name__}", "write one JSON object per line")
    return record


def read_examples(path: str | Path, fmt: str = "auto", skip_bad_lines: bool = False,
                  prompts_only: bool = False, skip_hint: bool = True) -> ReadResult:
    """Every record of a JSONL file as an Example; `prompts_only` (a teacher's prompts): answers optional.
    A bad line is a SmolforgeError at its FILE:LINE whose fix offers --skip-bad-lines where the command
    has it (`skip_hint`)."""
    records = jsonl_records(path)
    if fmt != "auto" and fmt not in FORMATS:
        raise SmolforgeError(f"unknown --format {fmt!r}", fix=f"use one of auto, {', '.join(FORMATS)}")
    result = ReadResult(examples=[], format=fmt)
    for lineno, record in records:
        where = f"{path}:{lineno}"
        try:
            if isinstance(record, BadLine):
                raise record
            if result.format == "auto":
                detected = detect_format(record)
                if detected is None:
                    raise BadLine(
                        f"cannot tell the format from keys {sorted(record)}",
                        "use keys of one format (instruction/output, messages, prompt/completion or text) or pass --format",
                    )
                result.format = detected
            try:
                result.examples.append(to_example(record, result.format, where, prompts_only))
            except ValueError as err:
                raise BadLine(str(err), _FIX[result.format])
        except BadLine as bad:
            if not skip_bad_lines:
                raise SmolforgeError(bad.what, where=where, fix=bad.fix + (
                    "; or pass --skip-bad-lines to skip such lines" if skip_hint else "")) from None
            result.skipped += 1
            result.problems.append(f"{where}: {bad.what}")
    if not result.examples:
        raise SmolforgeError(
            f"no usable examples ({result.skipped} bad lines skipped)", where=str(path),
            fix="check the file's format; the first problems were: " + "; ".join(result.problems[:3]),
        )
    return result
