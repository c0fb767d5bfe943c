"""Streamed tool calls, read as they are generated (models/families/toolstream.py): the pieces of any split
of an answer add up to what the family's format parses from the whole, a call's name comes before its
arguments, and a marker or a name split across tokens is held until whole (no model: a few milliseconds).
The official client against a served model: tests/serve/test_tools.py."""

from __future__ import annotations

import random

import pytest

from smolforge.models.families.toolcalls import HERMES, LLAMA_JSON
from smolforge.models.families.toolstream import CallStream

HERMES_TEXTS = [  # the edge cases peers' trackers name (vLLM's hermes parser, llama-server's tool deltas)
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo}"}}\n</tool_call>',  # } in a string
    '<tool_call>\n{"name": "a", "arguments": {"x": [1, {"y": "}\\""}]}}\n</tool_call>\n'
    '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',  # two calls, nested brackets, an escaped quote
    'plain text < not a call <tool',  # a marker's beginning that never completes
    '<tool_call>{"arguments": {"q": 1}, "name": "late"}</tool_call> after',  # arguments before the name
    '<tool_call>{"name": "s", "arguments": "{\\"a\\": 2}"}</tool_call>',  # arguments as a JSON string
    '<tool_call>{"name": "noargs"}</tool_call>',  # no arguments: {}
    'A <tool_call>bad</tool_call> B',  # not JSON: text
    '<tool_call>\n{"name": "x", "arguments": {"k": "v ü"}}',  # no closing marker (parse takes it)
    '  \n<tool_call>{"name": "x", "arguments": {"k": 1}}</tool_call>\n\n',  # whitespace around the call
]
WHOLE_AT_THE_END = HERMES_TEXTS[3:5]  # arguments before the name, or a string: sent once the call is whole
LLAMA_TEXTS = ['{"name": "f", "parameters": {"a": "}"}}', '<|python_tag|>{"name": "f", "parameters": {"a": 1}}',
               'It is sunny.', ' {"name":"g","parameters":{}}']


def _stream(fmt, text: str, split: int):
    """The pieces of `text` fed `split` characters at a time (0: random sizes 1-7, seeded)."""
    reader, pieces, at, rnd = CallStream(fmt), [], 0, random.Random(len(text))
    while at < len(text):
        n = split or rnd.randint(1, 7)
        pieces += reader.feed(text[at:at + n])
        at += n
    return pieces + reader.close(), reader.called


def _assembled(pieces):
    """(content, [(name, arguments)]) as a client accumulates the deltas."""
    calls: dict[int, list[str]] = {}
    for p in pieces:
        if p.kind != "content":
            assert p.kind == "name" or p.index in calls, "arguments before the call's name"
            assert p.kind != "name" or p.index not in calls, "a call named twice"
            calls.setdefault(p.index, ["", ""])[p.kind == "arguments"] += p.text
    content = "".join(p.text for p in pieces if p.kind == "content") or None
    return content, [tuple(c) for _, c in sorted(calls.items())]


def _parsed(fmt, text: str):
    content, calls = fmt.parse(text)
    return (content if calls else (text or None)), [(c.name, c.arguments_text) for c in calls]


@pytest.mark.parametrize("fmt,text", [(HERMES, t) for t in HERMES_TEXTS] + [(LLAMA_JSON, t) for t in LLAMA_TEXTS])
def test_streamed_pieces_add_up_to_the_parse_of_the_whole(fmt, text):
    want = _parsed(fmt, text)
    for split in (1, 2, 3, 0, len(text)):
        pieces, called = _stream(fmt, text, split)
        assert _assembled(pieces) == want, (split, pieces)
        assert called == bool(want[1])
    per_char = [p for p in _stream(fmt, text, 1)[0] if p.kind == "arguments"]
    if text not in WHOLE_AT_THE_END and any(len(args) > 2 for _, args in want[1]):
        assert len(per_char) > 1  # the arguments went out as they came, not in one piece at the end


def test_a_marker_and_a_name_split_across_tokens_are_held_until_whole():
    reader = CallStream(HERMES)
    assert [(p.kind, p.text) for p in reader.feed("Sure.\n<tool")] == [("content", "Sure.")]
    assert reader.feed("_call>\n{\"na") == []
    assert reader.feed('me": "get_w') == []  # half a name is not sent
    got = reader.feed('eather", "arguments": {"ci')
    assert [(p.kind, p.text) for p in got] == [("name", "get_weather"), ("arguments", '{"ci')]
    assert [p.text for p in reader.feed('ty": "Paris"}}\n</tool_call>')] == ['ty": "Paris"}']
    assert reader.close() == [] and reader.called


def test_each_choice_of_n_marks_its_tool_chunks_with_its_index():
    """`n` > 1 streamed: a choice's content and `delta.tool_calls` chunks carry that choice's index."""
    import json

    from smolforge.serve.streams import Indexed
    from smolforge.serve.tools import ToolChunks, ToolPlan

    view = Indexed(ToolChunks("c", 0, "tiny", False, ToolPlan(HERMES, [], "auto")), 2)
    text = 'Hi <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    frames = b"".join(view.frame(text[k:k + 4]) for k in range(0, len(text), 4))
    chunks = [json.loads(line[6:]) for line in frames.decode().splitlines() if line.startswith("data: ")]
    chunks += view.closing("stop")
    deltas = [c["choices"][0] for c in chunks]
    assert {d["index"] for d in deltas} == {2}
    assert [d["delta"]["tool_calls"][0]["function"].get("name") for d in deltas if "tool_calls" in d["delta"]][0] == "f"
    assert deltas[0]["delta"] == {"content": "Hi"} and deltas[-1]["finish_reason"] == "tool_calls"
