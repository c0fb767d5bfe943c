"""Training data with tools: a chat record's `tools`, an assistant turn's `tool_calls` and a `tool` turn
reach the model as the family's template renders them (transformers' `apply_chat_template(..., tools=)`),
the calls are learnt (in the loss), and nothing of them is dropped: a key the template would not see, a
template that leaves the tools out, and distillation (whose teacher prompts carry no tools yet) refuse
by name. One answer for a call's arguments with `serve`'s history (`data.chat_turns.call_arguments`)."""

from __future__ import annotations

import json

import pytest

from helpers import smolforge_here, write_jsonl

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
RECORD = {"tools": TOOLS, "messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny, 21 C"},
    {"role": "assistant", "content": "It is sunny in Paris."}]}


@pytest.fixture(scope="module")
def qwen_tok():
    from smolforge.models.loading import load_tokenizer
    from smolforge.models.twins import twin_dir

    return load_tokenizer(str(twin_dir("twin:qwen2.5-0.5b-instruct")))


def test_a_tool_record_renders_as_transformers_renders_it_and_its_calls_are_learnt(qwen_tok):
    from smolforge.data.encode import IGNORE, encode_rendered
    from smolforge.data.formats import to_example

    ex = to_example(RECORD, "chat", "t.jsonl:1")
    rendered = encode_rendered(qwen_tok, ex)
    as_transformers = [dict(m, content=m["content"] or "") for m in RECORD["messages"]]
    as_transformers[1] = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    want = qwen_tok.apply_chat_template(as_transformers, tools=TOOLS, tokenize=False)
    assert rendered.text == want
    assert "get_weather" in rendered.text.split("<|im_start|>user")[0]  # the tools in the system turn
    assert rendered.input_ids == qwen_tok(want, add_special_tokens=False)["input_ids"]
    learnt = qwen_tok.decode([t for t, y in zip(rendered.input_ids, rendered.labels) if y != IGNORE])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in learnt
    assert "sunny, 21 C" not in learnt and "It is sunny in Paris." in learnt  # the tool's answer is prompt


def test_tools_stored_as_json_text_are_read_as_the_list(qwen_tok):
    from smolforge.data.encode import encode_rendered
    from smolforge.data.formats import to_example

    as_text = to_example({**RECORD, "tools": json.dumps(TOOLS)}, "chat", "t.jsonl:1")  # a Parquet dataset's column
    assert as_text.tools == TOOLS
    assert encode_rendered(qwen_tok, as_text).text == encode_rendered(qwen_tok, to_example(RECORD, "chat", "x")).text


def test_the_prompt_of_a_tool_record_carries_its_tools(qwen_tok):
    from smolforge.data.encode import prompt_text
    from smolforge.data.formats import to_example

    ex = to_example({"tools": TOOLS, "messages": RECORD["messages"][:2]}, "chat", "t.jsonl:1")
    assert prompt_text(qwen_tok, ex) == qwen_tok.apply_chat_template(RECORD["messages"][:1], tools=TOOLS,
                                                                     tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("turn, words", [
    ({"role": "user", "content": "hi", "weight": 0}, "messages[0]: weight not supported"),
    ({"role": "user", "content": "hi", "tool_calls": [CALL]}, "messages[0].tool_calls: only an assistant turn"),
    ({"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "[1]"}}]}, "tool call f: arguments must be"),
    ({"role": "user", "content": "hi", "name": "bob"}, "messages[0].name: only a tool turn has one"),
], ids=["unknown-key", "calls-on-user", "arguments-not-object", "name-on-user"])
def test_what_a_template_would_not_see_is_refused_by_name_at_its_line(tmp_path, turn, words):
    data = write_jsonl(tmp_path / "d.jsonl", [RECORD, {"messages": [turn, {"role": "assistant", "content": "ok"}]}])
    proc = smolforge_here("data", "show", str(data))
    assert proc.exit_code == 2, proc.output[-2000:]
    assert f"d.jsonl:2" in proc.stderr and words in proc.stderr and "Traceback" not in proc.output


def test_a_template_without_tools_refuses_a_tool_record_instead_of_dropping_them():
    from smolforge.data.encode import RenderError, encode_rendered
    from smolforge.data.formats import to_example
    from smolforge.models.loading import load_tokenizer
    from smolforge.models.tiny import preset_dir

    tok = load_tokenizer(str(preset_dir("tiny-llama")))  # its template renders no tools
    ex = to_example({"tools": TOOLS, "messages": [RECORD["messages"][0], {"role": "assistant", "content": "ok"}]},
                    "chat", "t.jsonl:1")
    with pytest.raises(RenderError, match="the tool 'get_weather' does not reach the rendered row"):
        encode_rendered(tok, ex)


def test_distillation_refuses_tool_records_by_name(tmp_path):
    from smolforge.distill.teacher import prompts_from_dataset
    from smolforge.errors import SmolforgeError

    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "hi"}]},
                                              {"tools": TOOLS, "messages": [{"role": "user", "content": "Paris?"}]}])
    with pytest.raises(SmolforgeError, match="has tools, which distillation does not take") as err:
        prompts_from_dataset(str(data))
    assert "d.jsonl:2" in str(err.value)


def test_serve_and_training_read_a_calls_arguments_alike():
    from smolforge.data.chat_turns import call_arguments
    from smolforge.serve.protocol import ChatMessage

    msg = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [CALL]})
    assert msg.for_template()["tool_calls"][0]["function"]["arguments"] == call_arguments("f", '{"city": "Paris"}')
    assert json.loads(CALL["function"]["arguments"]) == {"city": "Paris"}


def test_data_show_shows_a_records_tools_and_calls(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [RECORD])
    proc = smolforge_here("data", "show", str(data))
    assert proc.exit_code == 0, proc.output[-2000:]
    assert "columns used: messages, tools" in proc.stdout
    assert "tools: get_weather" in proc.stdout and 'get_weather({"city": "Paris"})' in proc.stdout
