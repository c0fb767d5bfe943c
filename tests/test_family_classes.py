"""The family classes (models/families): each published kind answers from its class, every path asks
`family_of`, and a model type no class knows gets the generic class, whose answers come from its own
config and template (issue 41, item 1)."""

from __future__ import annotations

import pytest

from smolforge.errors import SmolforgeError
from smolforge.models import families
from smolforge.models.families import Generic, abilities, family_of, stop_ids
from smolforge.models.twins import FAMILIES

# twin -> (family class name, stages, GGUF arch, tied head, template: system role, tools, reads the clock,
# end-of-turn token)
EXPECTED = {
    "qwen2.5-0.5b-instruct": ("qwen2", True, "QWEN2", True, (True, True, False, "<|im_end|>")),
    "llama-3.2-1b-instruct": ("llama", True, "LLAMA", True, (True, True, True, "<|eot_id|>")),
    "tinyllama-1.1b-chat-v1.0": ("llama", True, "LLAMA", False, (True, False, False, "</s>")),
    "smollm2-360m-instruct": ("llama", True, "LLAMA", True, (True, False, False, "<|im_end|>")),
    "phi-3-mini-4k-instruct": ("phi3", True, "PHI3", False, (False, False, False, "<|end|>")),
    "gpt2": ("gpt2", True, "GPT2", True, (False, False, False, None)),
}


def test_every_twin_has_an_expected_row():
    assert set(EXPECTED) == set(FAMILIES)


@pytest.mark.parametrize("twin", sorted(EXPECTED))
def test_a_twin_s_family_answers_from_its_class(twin):
    import json
    from pathlib import Path

    from smolforge.models.loading import load_tokenizer, resolve_model

    name, stages, arch, tied, chat = EXPECTED[twin]
    path = Path(resolve_model(f"twin:{twin}"))
    config = json.loads((path / "config.json").read_text())
    fam = family_of(config)
    assert (fam.name, fam.stages, fam.gguf_arch, fam.tied(config)) == (name, stages, arch, tied)
    tok = load_tokenizer(f"twin:{twin}")
    got = abilities(tok)
    assert (got.system, got.tools, got.uses_time, got.end_of_turn) == chat
    stops = stop_ids(tok, path)
    if got.end_of_turn:  # the end of turn always stops a generation, listed in the generation config or not
        assert tok.convert_tokens_to_ids(got.end_of_turn) in stops
    assert tok.eos_token_id in stops


def test_an_unknown_type_gets_the_generic_class_and_its_refusals_name_the_known_families():
    fam = family_of({"model_type": "mamba", "tie_word_embeddings": True})
    assert isinstance(fam, Generic) and fam.model_type == "mamba" and fam.tied({"tie_word_embeddings": True})
    with pytest.raises(SmolforgeError, match="stages does not support model type 'mamba'") as err:
        fam.check_stages()
    assert "gpt2, llama, phi3, qwen2" in err.value.fix
    with pytest.raises(SmolforgeError, match="GGUF export supports the gpt2, llama, phi3, qwen2 families"):
        fam.check_gguf({"model_type": "mamba"})


def test_family_of_reads_a_type_a_dict_a_config_and_a_model():
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("qwen2")
    assert family_of("qwen2").name == family_of({"model_type": "qwen2"}).name == family_of(cfg).name == "qwen2"

    class Holder:
        config = cfg

    assert family_of(Holder()).name == "qwen2"


def test_a_model_type_registers_once():
    with pytest.raises(ValueError, match="registered twice"):
        @families.register
        class Again(families.Family):
            model_types = ("llama",)


def test_gpt2_refuses_an_activation_llama_cpp_does_not_compute():
    with pytest.raises(SmolforgeError, match="activation 'relu'"):
        family_of("gpt2").check_gguf({"model_type": "gpt2", "activation_function": "relu"})
    family_of("gpt2").check_gguf({"model_type": "gpt2"})


def test_a_template_without_a_system_role_and_one_that_raises_both_say_no_system():
    from smolforge.models.loading import load_tokenizer

    tok = load_tokenizer("twin:qwen2.5-0.5b-instruct")
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                         "{{ raise_exception('System role not supported') }}{% endif %}"
                         "<{{ m['role'] }}>{{ m['content'] }}<|im_end|>{% endfor %}")
    got = abilities(tok)
    assert not got.system and got.end_of_turn == "<|im_end|>"


def test_the_template_s_end_of_turn_stops_a_model_whose_generation_config_does_not_list_it():
    """A community fine-tune that trained on ChatML turns over a base whose generation config names only
    `<|endoftext|>`: its answers end with `<|im_end|>`, which must stop every path all the same."""
    from smolforge.models.loading import load_tokenizer

    tok = load_tokenizer("twin:qwen2.5-0.5b-instruct")
    tok.eos_token = "<|endoftext|>"
    stops = stop_ids(tok, {"eos_token_id": tok.convert_tokens_to_ids("<|endoftext|>")})
    assert stops == {tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")}


CHAT_TWINS = sorted(t for t in EXPECTED if EXPECTED[t][4][3] is not None)


@pytest.mark.parametrize("twin", CHAT_TWINS)
def test_a_system_prompt_reaches_training_and_the_prompt_in_every_family(twin):
    """The system-prompt cell of the family matrix (issue 41, item 7): whatever the template does with a
    system turn, its text reaches the training row (native or folded into the first user turn, once) and the
    prompt a teacher or the server renders, in that order, and the loss covers only the answer."""
    from smolforge.data.encode import IGNORE, encode_rendered
    from smolforge.data.formats import Example
    from smolforge.models.loading import load_tokenizer
    from smolforge.train.rendering import render_prompt, system_role

    tok = load_tokenizer(f"twin:{twin}")
    messages = [{"role": "system", "content": "answer in one word"}, {"role": "user", "content": "capital of France"},
                {"role": "assistant", "content": "Paris"}]
    row = encode_rendered(tok, Example("cell:1", messages=messages), system_role=system_role(tok))
    assert row.folded == (not EXPECTED[twin][4][0])
    assert row.text.count("answer in one word") == 1 and row.text.index("answer in one word") < row.text.index("capital")
    trained = tok.decode([i for i, lab in zip(row.input_ids, row.labels) if lab != IGNORE])
    assert "Paris" in trained and "answer in one word" not in trained and "capital" not in trained
    prompt = render_prompt(tok, messages[:2])
    assert "answer in one word" in prompt and prompt.index("answer in one word") < prompt.index("capital")
