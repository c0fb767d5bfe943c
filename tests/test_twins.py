"""Twins of published families: the published config and tokenizer kind, random weights, no download.

Each reduced twin is built once (module fixture) through the same `twin:` name users type; the
published files it is compared with are the package data in models/twin_configs.
"""

from __future__ import annotations

import hashlib
import json

import jinja2.ext
import pytest
import torch
from jinja2.sandbox import ImmutableSandboxedEnvironment

from smolforge.errors import SmolforgeError
from smolforge.models import load_model, load_tokenizer, resolve_model
from smolforge.models.chat_templates import TEMPLATES
from smolforge.models.names import check_local_model
from smolforge.models.twins import FAMILIES, parse, published, twin_config, twin_dir
from smolforge.models.twins.build import build_twin
from smolforge.models.twins.tokenizer import FILLER

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "42."},
    {"role": "user", "content": "And reversed, in code?"},
]
TEXTS = [
    "What is 12345 + 678? 13023.",
    # No leading space: transformers 5 loads Llama-2-style tokenizers (TinyLlama) with a Metaspace
    # pre-tokenizer that does not prepend `▁` to a text that starts with one, so "  x" decodes as " x".
    "double  spaces,   triple, trailing \n",
    "Größe café naïve — Ελληνικά, русский, 日本語, 中文, 🙂👍",
    "def f(x):\n\treturn {'a': [1, 2.5e-3]}  # comment\r\n",
]
PIPELINE = ("normalizer", "pre_tokenizer", "post_processor", "decoder")
# Written out here, not read from the package data, so a wrong data file cannot agree with itself.
REDUCED_KEYS = {
    "qwen2.5-0.5b-instruct": {"hidden_size", "intermediate_size", "num_hidden_layers"},
    "llama-3.2-1b-instruct": {"hidden_size", "intermediate_size", "num_hidden_layers", "head_dim"},
    "tinyllama-1.1b-chat-v1.0": {"hidden_size", "intermediate_size", "num_hidden_layers"},
    "smollm2-360m-instruct": {"hidden_size", "intermediate_size", "num_hidden_layers"},
    "gpt2": {"n_embd", "n_layer"},
    "phi-3-mini-4k-instruct": {"hidden_size", "intermediate_size", "num_hidden_layers"},
}
PUBLISHED_IDS = {  # (token, id) pairs from each model card / tokenizer.json
    "qwen2.5-0.5b-instruct": {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                              "<|file_sep|>": 151664},
    "llama-3.2-1b-instruct": {"<|begin_of_text|>": 128000, "<|eot_id|>": 128009, "<|start_header_id|>": 128006,
                              "<|reserved_special_token_247|>": 128255},
    "tinyllama-1.1b-chat-v1.0": {"<unk>": 0, "<s>": 1, "</s>": 2, "<0x00>": 3, "<0xFF>": 258},
    "smollm2-360m-instruct": {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<empty_output>": 16},
    "gpt2": {"<|endoftext|>": 50256},
    "phi-3-mini-4k-instruct": {"<unk>": 0, "<s>": 1, "<|endoftext|>": 32000, "<|assistant|>": 32001,
                               "<|end|>": 32007, "<|user|>": 32010, "<0x0A>": 13},
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def twin(request):
    family = request.param
    return family, twin_dir(f"twin:{family}")


def _as_list(ids) -> list[int]:
    return ids if isinstance(ids, list) else [ids]


def test_config_is_the_published_one_but_for_the_reduced_sizes(twin):
    family, path = twin
    written, pub = json.loads((path / "config.json").read_text()), published(family, "config.json")
    differ = {k for k in written.keys() | pub.keys() if written.get(k) != pub.get(k)}
    assert differ == REDUCED_KEYS[family], f"{family}: keys that differ from the published config"
    assert all(written[k] < pub[k] for k in differ)
    assert json.loads((path / "generation_config.json").read_text()) == published(family, "generation_config.json")


def test_tokenizer_file_is_the_published_kind_with_published_ids(twin):
    family, path = twin
    file, header = json.loads((path / "tokenizer.json").read_text()), published(family, "tokenizer_header.json")
    for key in PIPELINE:
        assert file[key] == header[key], f"{family}: tokenizer.json {key} differs from the published one"
    assert {k: file["model"][k] for k in header["model"]} == header["model"]
    assert file["added_tokens"] == header["added_tokens"]
    tok = load_tokenizer(f"twin:{family}")
    expected = {**{t["content"]: t["id"] for t in header["added_tokens"]}, **PUBLISHED_IDS[family]}
    for token, i in expected.items():
        assert tok.convert_tokens_to_ids(token) == i, f"{family}: {token} is not at its published id {i}"
    config = published(family, "config.json")
    assert len(tok) == max(header["model_vocab_size"], 1 + max(t["id"] for t in header["added_tokens"]))
    assert len(tok) <= config["vocab_size"]
    assert tok.eos_token_id in _as_list(config["eos_token_id"])
    assert tok.model_max_length == published(family, "tokenizer_config.json")["model_max_length"]


def test_tokenizer_round_trips_varied_text(twin):
    family, _ = twin
    tok = load_tokenizer(f"twin:{family}")
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text, f"{family}: {text!r}"
        assert not any(t.startswith(FILLER[:1]) for t in tok.convert_ids_to_tokens(ids)), "a filler was reached"
    bos = published(family, "config.json").get("bos_token_id")
    adds_bos = family in ("llama-3.2-1b-instruct", "tinyllama-1.1b-chat-v1.0")
    assert (tok("hi")["input_ids"][0] == bos) == adds_bos, f"{family}: BOS added by the tokenizer?"


def _render_published(template: str, tok, **extra) -> str:
    """The template rendered by jinja2 itself, the way the HF docs say chat templates are run."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=CONVERSATION, add_generation_prompt=True,
                                            bos_token=tok.bos_token, eos_token=tok.eos_token, **extra)


def test_chat_template_renders_as_the_published_template(twin):
    family, _ = twin
    tok = load_tokenizer(f"twin:{family}")
    key = FAMILIES[family].template
    if key is None:  # GPT-2 publishes no chat template, and the twin must not invent one
        assert tok.chat_template is None
        return
    extra = {"date_string": "26 Jul 2024"}  # Llama 3.2 would read today's date otherwise
    ours = tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True, **extra)
    assert ours == _render_published(TEMPLATES[key], tok, **extra)
    ids = tok(ours, add_special_tokens=False)["input_ids"]
    used = [t for t in published(family, "tokenizer_header.json")["added_tokens"] if t["content"] in ours]
    assert used, f"{family}: the rendered prompt has no special token"
    for added in used:  # each special token in the prompt encodes as its one published id
        assert added["id"] in ids, f"{family}: {added['content']} is not id {added['id']} in the prompt"


def test_model_loads_by_name_with_the_published_vocab_width(twin):
    family, _ = twin
    config = published(family, "config.json")
    model = load_model(f"twin:{family}")
    tok = load_tokenizer(f"twin:{family}")
    ids = tok(CONVERSATION[1]["content"], return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], config["vocab_size"])
    tied = config.get("tie_word_embeddings", True)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    if family == "qwen2.5-0.5b-instruct":
        assert model.model.layers[0].self_attn.q_proj.bias is not None  # qkv bias
    if family == "llama-3.2-1b-instruct":
        assert model.config.rope_parameters["rope_type"] == "llama3"


def test_a_twin_is_deterministic_for_a_seed(tmp_path):
    a, b, c = (build_twin("gpt2", False, tmp_path / n, seed=s) for n, s in (("a", 0), ("b", 0), ("c", 1)))

    def digest(path):
        return hashlib.sha256(path.read_bytes()).hexdigest()

    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert digest(a / name) == digest(b / name), f"{name} differs between two builds with seed 0"
    assert digest(a / "model.safetensors") != digest(c / "model.safetensors"), "seeds 0 and 1 gave equal weights"


@pytest.mark.parametrize("name", ["twin:nope", "twin:qwen2.5-0.5b-instruct@huge", "twin:"])
def test_a_bad_twin_name_is_one_clear_error_listing_the_twins(name):
    for check in (check_local_model, resolve_model):
        with pytest.raises(SmolforgeError, match="unknown twin") as err:
            check(name)
        assert all(f"twin:{f}" in err.value.fix for f in FAMILIES) and "@full" in err.value.fix


def test_full_names_parse_to_the_published_shapes_without_building():
    assert parse("twin:gpt2@full") == ("gpt2", True) and parse("twin:gpt2") == ("gpt2", False)
    assert twin_config("gpt2", True) == published("gpt2", "config.json")


@pytest.mark.bench
@pytest.mark.parametrize("family", list(FAMILIES))
def test_full_twin_has_the_published_parameter_count(family, tmp_path):
    """Meta-device construction: the published shapes, no allocation, no weights written."""
    from transformers import AutoConfig, AutoModelForCausalLM

    (tmp_path / "config.json").write_text(json.dumps(twin_config(family, True)))
    config = AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == FAMILIES[family].published_params


def test_placement_counts_a_twin_as_held_by_every_node_like_a_preset():
    """A twin is built from code on whichever node loads it: no node has to advertise it (a cluster
    job on a twin once waited for a node holding `twin:…`)."""
    from smolforge.cluster.workloads.distill.state import is_local_model
    from smolforge.cluster.control.placement import holds_anywhere

    for name in ("twin:gpt2", "twin:qwen2.5-0.5b-instruct@full", "tiny-llama"):
        assert holds_anywhere(name, embedded=False) and is_local_model(name), name
    assert not holds_anywhere("Qwen/Qwen2.5-0.5B-Instruct", embedded=False)
