"""Model names: presets, local dirs, HF ids, Ollama names, and clear errors when offline."""

from __future__ import annotations

import pytest
import torch

from smolforge.errors import SmolforgeError
from smolforge.models import load_model, load_tokenizer, ollama_to_hf, resolve_model
from smolforge.models.registry import OLLAMA_TO_HF
from smolforge.models.tiny import PRESETS, preset_dir


@pytest.mark.parametrize("name,hf", [
    ("qwen2.5:0.5b", "Qwen/Qwen2.5-0.5B-Instruct"), ("qwen2.5:1.5b", "Qwen/Qwen2.5-1.5B-Instruct"),
    ("qwen2.5:3b", "Qwen/Qwen2.5-3B-Instruct"), ("qwen2.5:7b", "Qwen/Qwen2.5-7B-Instruct"),
    ("llama3.2:1b", "meta-llama/Llama-3.2-1B-Instruct"), ("llama3.2:3b", "meta-llama/Llama-3.2-3B-Instruct"),
    ("tinyllama", "TinyLlama/TinyLlama-1.1B-Chat-v1.0"), ("TinyLlama:latest", "TinyLlama/TinyLlama-1.1B-Chat-v1.0"),
])
def test_ollama_table(name, hf):
    assert ollama_to_hf(name) == hf
    assert resolve_model(name) == hf


def test_user_aliases_extend_the_table(tmp_path, monkeypatch):
    table = tmp_path / "aliases.yaml"
    table.write_text("mymodel:1b: ./somewhere/mymodel\nqwen2.5:0.5b: my-org/override\n")
    monkeypatch.setenv("SMOLFORGE_MODEL_ALIASES", str(table))
    assert ollama_to_hf("mymodel:1b") == "./somewhere/mymodel"
    assert ollama_to_hf("qwen2.5:0.5b") == "my-org/override"
    assert ollama_to_hf("other:1b", extra={"other:1b": "x/y"}) == "x/y"
    assert "qwen2.5:0.5b" in OLLAMA_TO_HF


def test_unknown_ollama_name_is_a_clear_error():
    with pytest.raises(SmolforgeError, match="unknown Ollama model name") as err:
        resolve_model("nosuch:13b")
    assert "alias" in err.value.fix


def test_uncached_hub_model_offline_names_the_model_and_fix(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SmolforgeError) as err:
        load_model("qwen2.5:0.5b")
    assert "Qwen/Qwen2.5-0.5B-Instruct" in str(err.value)
    assert "HF_HUB_OFFLINE" in err.value.fix


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-qwen2"])
def test_presets_are_ordinary_hf_dirs(name, tmp_path):
    path = preset_dir(name)
    assert (path / "config.json").exists() and (path / "tokenizer.json").exists()
    model, tok = load_model(str(path)), load_tokenizer(str(path))
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    ids = tok("What is 12 + 3?", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape[-1] >= len(tok)
    # Saved and reloaded from a local dir, it is the same model.
    model.save_pretrained(tmp_path / "copy")
    tok.save_pretrained(tmp_path / "copy")
    again = load_model(str(tmp_path / "copy"))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, logits)


def test_preset_sizes():
    assert set(PRESETS) >= {"tiny-gpt2", "tiny-llama", "tiny-qwen2", "llama-100m"}
    from transformers import AutoConfig, AutoModelForCausalLM

    family, kw = PRESETS["llama-100m"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **kw))
    n = sum(p.numel() for p in model.parameters())
    assert 80e6 < n < 130e6


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(SmolforgeError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_building_a_preset_leaves_the_callers_rng_alone(tmp_path, monkeypatch):
    """`train` seeds, then loads its model; a preset built right then (its first use) must not reset
    that seeded stream, or the first run of a preset trains other weights than every later run."""
    import torch

    from smolforge.models.tiny import preset_dir

    monkeypatch.setenv("SMOLFORGE_HOME", str(tmp_path))  # nothing built yet
    torch.manual_seed(5)
    preset_dir("tiny-gpt2")
    after_build = torch.rand(4)
    torch.manual_seed(5)
    assert torch.equal(after_build, torch.rand(4))
