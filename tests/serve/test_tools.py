"""Tool calling: `tools`/`tool_choice` in, `tool_calls` out, through the family's template and format.

Every test that serves runs on both engines: torch on the Qwen2.5 twin, and `serve --engine llamacpp`'s
model of the same twin (its f16 GGUF export, loaded by the engine registry as `serve` loads it). The
llamacpp cases are soak: the export of a 150k vocabulary with its own llama.cpp check took 66 s and the
first constrained request 75 s at load 10 (about 160 s for the module's llamacpp cases). What CI still
proves for llama.cpp: the engines meet only below the `BatchModel` seam (logits in; the template, the
grammar's mask, the tool-call reader and the HTTP side above it are shared code), and every engine's
model names the checkpoint's family, the one the HTTP side asks for the tool-call format (torch,
llama.cpp, 2 stages; CI).

- the real `serve --engine llamacpp` process (its HTTP front a process of its own) returns a forced call,
  streamed and not, equal (soak);
- Llama 3's JSON call (soak, a 128k vocabulary) on one process, 2 stages and llama.cpp: a model that
  named no family got the Generic family's Hermes `<tool_call>` block (`serve --stages` did);

- a Qwen2.5-kind twin (random weights) served in-process, asked by the official `openai` client with
  `tool_choice` required and named: the grammar forces one `<tool_call>` block, parsed into `tool_calls`
  (finish_reason "tool_calls"), streamed as `delta.tool_calls` and equal to the non-streamed calls;
- streamed incrementally: the first delta of a call has its id, type, name and `arguments` "", a long
  argument follows in several fragments, and the `openai` client's stream helper assembles the
  non-streamed `tool_calls` (string-equal arguments);
- the follow-up (the assistant's call and the `tool` answer in the history) is tokenized exactly as
  transformers' `apply_chat_template(..., tools=)` tokenizes it;
- a twin TRAINED to call a tool (soak: smolforge's own `train` on the user's tool-use chat JSONL, a full
  fine-tune of the 150k-vocabulary twin for 100 steps; the data's rendering and its calls in the loss are CI in
  tests/test_tool_data.py): under `tool_choice` "auto" (nothing forced) the untrained twin answers text and
  the trained one the call, through the official client, streamed and not equal, finish_reason
  "tool_calls", arguments a JSON object; the follow-up with the `tool` answer is counted as transformers'
  `apply_chat_template(..., tools=)` tokenizes it;
- a named function not among the tools is a 400 naming `tool_choice`;
- the families' formats parse their own text (Hermes blocks among text, Llama 3's JSON).
"""

from __future__ import annotations

import json

import pytest

from helpers import require_module
from test_llamacpp_engine import Live, require_llama_cpp

pytestmark = pytest.mark.timeout(300)
TWIN = "twin:qwen2.5-0.5b-instruct"
# the engines each serving test runs on (llamacpp: soak, see the module doc)
ENGINES = ["torch", pytest.param("llamacpp", marks=pytest.mark.soak)]
VERIFY_PROMPTS = 4  # the GGUF export's own llama.cpp check on this many chat prompts (the product's: 16)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
                   "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time here"}}]  # no parameters
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def qwen_twin():
    require_module("llguidance", "llguidance (a smolforge dependency)", "pip install -c constraints.txt llguidance==1.9.1")
    from smolforge.models.twins import twin_dir
    from smolforge.serve.model import ServedModel

    return ServedModel.load(str(twin_dir(TWIN)), name="tiny", device="cpu")


def llamacpp_model(path: str):
    """`serve --engine llamacpp --quant f16`'s model of a checkpoint: its GGUF export (the node's cache, checked
    by the export in llama.cpp on VERIFY_PROMPTS prompts), loaded by `engines.load_engine` as `serve` does."""
    require_llama_cpp()
    from functools import partial

    from smolforge.models.export import verify
    from smolforge.serve.engines import EngineSpec, load_engine

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(verify, "verify_gguf", partial(verify.verify_gguf, count=VERIFY_PROMPTS))
        return load_engine("llamacpp", EngineSpec(model=path, name="tiny", device="cpu", quant="f16", threads=1,
                                                  max_batch=4)).model


@pytest.fixture(scope="module")
def lcpp_qwen():
    from smolforge.models.twins import twin_dir

    model = llamacpp_model(str(twin_dir(TWIN)))
    yield model
    model.close()


@pytest.fixture(scope="module", params=ENGINES)
def engine_model(request, qwen_twin):
    """The twin as the engine named by the parameter serves it."""
    return qwen_twin if request.param == "torch" else request.getfixturevalue("lcpp_qwen")


@pytest.fixture(scope="module")
def live(engine_model):
    server = Live(engine_model)
    yield server
    server.close()


def _calls(message_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message_calls]


def _streamed_calls(chunks) -> tuple[list[tuple[str, dict]], str]:
    """The calls a client assembles from `delta.tool_calls` (by index: id and name first, then arguments)."""
    calls: dict[int, dict] = {}
    reason = None
    for chunk in chunks:
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            for d in choice.delta.tool_calls or []:
                slot = calls.setdefault(d.index, {"name": "", "arguments": ""})
                slot["name"] += (d.function.name or "") if d.function else ""
                slot["arguments"] += (d.function.arguments or "") if d.function else ""
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], reason


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_choice_returns_a_tool_call_streamed_and_not(live, choice):
    client = live.client()
    ask = dict(model="tiny", messages=QUESTION, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=40)
    whole = client.chat.completions.create(**ask)
    streamed, reason = _streamed_calls(client.chat.completions.create(stream=True, **ask))
    got = _calls(whole.choices[0].message.tool_calls or [])
    assert whole.choices[0].finish_reason == "tool_calls" and reason == "tool_calls", whole
    assert len(got) == 1 and got == streamed, (got, streamed)
    name, args = got[0]
    assert name in {"get_weather", "get_time"} and (choice == "required" or name == "get_weather")
    if name == "get_weather":
        assert args["city"] in {"Paris", "Oslo"}
    assert whole.usage.prompt_tokens > 100  # the tools went into the prompt (the template renders them)


NOTE = {"type": "function", "function": {"name": "take_note", "description": "Write a note down", "parameters": {
    "type": "object", "properties": {"text": {"type": "string", "minLength": 16, "maxLength": 32}},
    "required": ["text"], "additionalProperties": False}}}


@pytest.mark.soak  # a `serve` process of the 150k-vocabulary twin (the module doc's llamacpp cost, again)
def test_serve_engine_llamacpp_returns_tool_calls_through_its_front(lcpp_qwen, tmp_path):
    """The real `smolforge serve --engine llamacpp` process, whose HTTP front runs in a process of its own and
    knows the family only from what `serve` hands it: a forced call comes back, streamed and not, equal."""
    from servehelpers import start_server

    from smolforge.models.export.cache import cache_root
    from smolforge.models.twins import twin_dir

    (tmp_path / "home").mkdir()  # the server's SMOLFORGE_HOME: its GGUF cache is lcpp_qwen's export (same key)
    (tmp_path / "home" / "gguf").symlink_to(cache_root(), target_is_directory=True)
    srv = start_server(tmp_path, twin_dir(TWIN), extra=("--engine", "llamacpp", "--quant", "f16"),
                       bound=300)  # over 90 s at load 28: the tokenizer's 150k ids read by both processes
    try:
        client = srv.client()
        ask = dict(model="tiny", messages=QUESTION, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=40)
        whole = client.chat.completions.create(**ask)
        streamed, reason = _streamed_calls(client.chat.completions.create(stream=True, **ask))
    finally:
        srv.proc.terminate()
        srv.proc.wait(timeout=30)
    got = _calls(whole.choices[0].message.tool_calls or [])
    assert (whole.choices[0].finish_reason, reason) == ("tool_calls", "tool_calls"), whole
    assert len(got) == 1 and got == streamed, (got, streamed)
    assert "llama.cpp f16" in srv.log.read_text()  # the engine `serve` says it runs
    assert "exporting" not in srv.log.read_text()  # it served lcpp_qwen's export, not one of its own


def test_a_streamed_call_sends_its_name_then_its_arguments_in_fragments(live):
    client = live.client()
    ask = dict(model="tiny", messages=[{"role": "user", "content": "Note: buy milk"}], tools=[NOTE, *TOOLS],
               tool_choice={"type": "function", "function": {"name": "take_note"}}, temperature=0, max_tokens=120)
    whole = client.chat.completions.create(**ask).choices[0].message.tool_calls
    with client.chat.completions.stream(**ask) as helper:  # the client's own accumulation of the deltas
        events = list(helper)
        final = helper.get_final_completion().choices[0]
    deltas = [d for e in events if e.type == "chunk" for ch in e.chunk.choices for d in ch.delta.tool_calls or []]
    first, rest = deltas[0], deltas[1:]
    assert (first.index, first.type, first.function.name, first.function.arguments) == (0, "function", "take_note", "")
    assert first.id and all(d.index == 0 and d.id is None and d.function.name is None for d in rest), deltas
    assert len(rest) > 1, deltas  # the arguments came as they were generated, not in one piece at the end
    assert "".join(d.function.arguments for d in rest) == whole[0].function.arguments
    assert [e.type for e in events].count("tool_calls.function.arguments.delta") == len(deltas)
    assert final.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole]
    print("streamed arguments:", [d.function.arguments for d in rest])
    assert len(json.loads(whole[0].function.arguments)["text"]) >= 16


def test_the_follow_up_renders_as_transformers_renders_it(engine_model):
    from smolforge.serve.api import Served, _prepare_chat
    from smolforge.serve.events import ContextLimits

    class _Room(ContextLimits):  # the engine's length checks, without an engine
        max_positions = 32768

    history = [*QUESTION,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    body = {"model": "tiny", "messages": history, "tools": TOOLS, "max_tokens": 8}
    job = _prepare_chat(json.dumps(body).encode(), Served(engine_model, _Room(), "tiny", None))
    reference = [*QUESTION,
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                 {"role": "tool", "content": "18 C and sunny"}]
    text = engine_model.tokenizer.apply_chat_template(reference, tools=TOOLS, add_generation_prompt=True,
                                                      tokenize=False)
    want = engine_model.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert job.ids == want
    assert "<tool_call>" in text and "18 C and sunny" in text and "get_time" in text


def test_a_named_function_not_among_the_tools_is_a_400(live):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        live.client().chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS, max_tokens=4,
                                              tool_choice={"type": "function", "function": {"name": "nope"}})
    assert err.value.body["param"] == "tool_choice" and "nope" in err.value.body["message"]


@pytest.mark.parametrize("engine", ["torch", "llamacpp", "2 stages"])
def test_every_engines_model_names_the_checkpoints_family(engine, served_tiny, model_copy, request):
    """The HTTP side asks the model for its family (tools in the template, the tool-call format, the grammar):
    every engine's model answers with the checkpoint's config, so a Llama checkpoint gets Llama 3's JSON calls
    on each (a model that named none got the Generic family's Hermes blocks: `serve --stages` did)."""
    from smolforge.models.families import family_of
    from smolforge.models.families.toolcalls import LLAMA_JSON

    if engine == "torch":
        model = served_tiny
    elif engine == "llamacpp":
        model = request.getfixturevalue("lcpp_model")  # conftest's: `load_engine("llamacpp", ...)`'s model
    else:
        from smolforge.serve.stages import local_stages, staged_model

        model = staged_model(str(model_copy), local_stages(str(model_copy), [0, 2, 4]), name="tiny")
    config = json.loads((model_copy / "config.json").read_text())
    assert model.model_type == config["model_type"] == "llama"
    assert family_of(model.model_type).tool_calls is family_of(config).tool_calls is LLAMA_JSON


def test_each_familys_format_parses_its_own_text():
    from smolforge.models.families import family_of
    from smolforge.models.families.toolcalls import ToolCall

    qwen, llama = family_of("qwen2").tool_calls, family_of("llama").tool_calls
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert qwen.parse(text) == ("Let me look.", [ToolCall("get_weather", {"city": "Oslo"})])
    assert qwen.parse("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert llama.parse('{"name": "get_time", "parameters": {}}') == (None, [ToolCall("get_time", {})])
    assert llama.parse("It is sunny.") == ("It is sunny.", [])


@pytest.mark.soak  # a second family's format (the first is Qwen2.5's above); a 128k vocabulary to index
@pytest.mark.parametrize("where", ["one process", "2 stages", "llamacpp"])
def test_llama3_forced_call_is_its_json_and_parses(where):
    require_module("llguidance", "llguidance (a smolforge dependency)", "pip install -c constraints.txt llguidance==1.9.1")
    from smolforge.models.twins import twin_dir
    from smolforge.serve.api import Served, _prepare_chat
    from smolforge.serve.engine import Engine
    from smolforge.serve.model import ServedModel
    from smolforge.serve.stages import local_stages, staged_model
    from smolforge.serve.tools import chat_choice

    path = str(twin_dir("twin:llama-3.2-1b-instruct"))
    if where == "one process":
        model = ServedModel.load(path, name="tiny", device="cpu")
    elif where == "2 stages":  # `serve --stages 2`'s model, its stages in this process
        model = staged_model(path, local_stages(path, [0, 1, 2]), name="tiny")
    else:
        model = llamacpp_model(path)
    engine = Engine(model, max_batch=4).start()
    try:
        body = {"model": "tiny", "messages": QUESTION, "tools": TOOLS, "tool_choice": "required", "max_tokens": 40,
                "temperature": 0}
        job = _prepare_chat(json.dumps(body).encode(), Served(model, engine, "tiny", None))
        done = engine.generate(job.ids, job.params, timeout=240)
    finally:
        engine.stop()
        getattr(model, "close", lambda: None)()  # llama.cpp's context and weights
    assert done.text.startswith('{"name":"get_'), done.text  # Llama 3's JSON call, no <tool_call> block
    choice = chat_choice(done.text, done.finish_reason, job.tools)
    assert choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) == 1, choice


# -- a twin trained to call a tool (issue 44's done-when): the model chooses the call under `auto` -------------

WEATHER = [TOOLS[0]]  # get_weather(city: Paris | Oslo)
TRAIN_STEPS, TRAIN_LR = 100, 1e-2  # full fine-tune, constant lr: the call from step ~60 (loss 0.007), 20 steps: text


def weather_call(city: str) -> dict:
    """The assistant turn of a user's tool-use dataset (OpenAI's shape: `arguments` a JSON object's text)."""
    call = {"name": "get_weather", "arguments": json.dumps({"city": city})}
    return {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": call}]}


@pytest.fixture(scope="module")
def tool_trained(tmp_path_factory):
    """The Qwen2.5 twin fine-tuned by smolforge's own training path (`train`, as `smolforge train` runs it) on a
    chat JSONL whose assistant turn is a `get_weather` call (the record's `tools` rendered by the family's
    template, the call in the loss: data/chat_turns.py), then loaded as `serve --model <its output>` loads it.
    Returns (the trained model, the run's result)."""
    from helpers import write_jsonl

    from smolforge.config import DataSpec, PeftSpec, TrainConfig
    from smolforge.models.twins import twin_dir
    from smolforge.serve.model import ServedModel
    from smolforge.train.engine import train

    root = tmp_path_factory.mktemp("tool-trained")
    data = write_jsonl(root / "weather.jsonl", [{"tools": WEATHER, "messages": [*QUESTION, weather_call("Paris")]}])
    cfg = TrainConfig(model=str(twin_dir(TWIN)), data=DataSpec(path=str(data), max_length=512, eval_fraction=0),
                      peft=PeftSpec(method="none"), lr=TRAIN_LR, scheduler="constant", max_steps=TRAIN_STEPS,
                      batch_size=1, device="cpu", eval_accuracy=False, quiet=True, tensorboard=False,
                      output_dir=str(root / "out"))
    result = train(cfg)
    return ServedModel.load(result.adapter_dir, name="tiny", device="cpu"), result


def _ask_auto(live, messages) -> tuple:
    """The official client's answer under `tool_choice: "auto"`, whole and streamed (assembled)."""
    client = live.client()
    ask = dict(model="tiny", messages=messages, tools=WEATHER, tool_choice="auto", temperature=0, max_tokens=40)
    return client.chat.completions.create(**ask), _streamed_calls(client.chat.completions.create(stream=True, **ask))


@pytest.mark.soak  # 100 full fine-tuning steps of a 150k-vocabulary twin (a row of 415 tokens): minutes on a CPU
@pytest.mark.timeout(1500)  # the training in its fixture: 1 to 15 s a step at load 2 to 15
def test_a_twin_trained_to_call_a_tool_calls_it_under_auto_streamed_and_not(tool_trained, qwen_twin):
    """Untrained, the twin under `auto` answers text (no call: nothing forces one); trained a few steps on the
    user's tool-use JSONL, the same request gets `tool_calls` back (the model chose the call), streamed and
    not equal, finish_reason "tool_calls", arguments a JSON object; the follow-up with the `tool` answer is
    tokenized as transformers' `apply_chat_template(..., tools=)` tokenizes it."""
    model, result = tool_trained
    untrained = Live(qwen_twin)
    try:
        before, (before_streamed, _) = _ask_auto(untrained, QUESTION)
    finally:
        untrained.close()
    assert not before.choices[0].message.tool_calls and before_streamed == [], before  # the weights decide
    live = Live(model)
    try:
        whole, (streamed, reason) = _ask_auto(live, QUESTION)
        history = [*QUESTION, {"role": "assistant", "content": None,
                               "tool_calls": [c.model_dump() for c in whole.choices[0].message.tool_calls or []]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
        follow_up = live.client().chat.completions.create(model="tiny", messages=history, tools=WEATHER,
                                                          temperature=0, max_tokens=1)
    finally:
        live.close()
    print(f"trained {result.steps} steps on {result.data['train_tokens']} tokens, final loss {result.final_loss:.4f};",
          "answer:", whole.choices[0].message)
    got = _calls(whole.choices[0].message.tool_calls or [])
    assert (whole.choices[0].finish_reason, reason) == ("tool_calls", "tool_calls"), whole
    assert got == streamed == [("get_weather", {"city": "Paris"})], (got, streamed)
    reference = [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 C and sunny"}]
    text = model.tokenizer.apply_chat_template(reference, tools=WEATHER, add_generation_prompt=True, tokenize=False)
    assert follow_up.usage.prompt_tokens == len(model.tokenizer(text, add_special_tokens=False)["input_ids"])
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in text
