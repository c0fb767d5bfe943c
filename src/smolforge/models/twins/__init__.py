"""Config-exact twins of published model families: their config, random weights, no download.

Why: every other proof in the suite runs on our own presets (`tiny.py`), whose flags we chose. Users run
published families, whose configs carry flags the presets never set (llama3 rope scaling, qkv bias, an
explicit head_dim, a list of eos ids, an embedding wider than the tokenizer, fused Phi-3 projections,
ids of special tokens far from zero). A twin is a checkpoint directory whose `config.json` and
`generation_config.json` are the published files, whose tokenizer is of the published kind (same
tokenizers model type, normalizer, pre-tokenizer regex, post-processor, decoder) with the published
special and added tokens at the published ids, and whose `tokenizer_config.json` carries the published
chat template and special tokens; only the weights are random and the merges are trained locally.

Names: `twin:<family>` is the reduced twin (2 layers, narrow width, same flags and vocabulary: the CI
tier), `twin:<family>@full` the published shapes (benchmarks only; never built by CI-tier tests). The
`@` suffix keeps the family part equal to the HF repo name, lowercased, so `twin:qwen2.5-0.5b-instruct`
reads as the model it mimics. A twin is built on first use under `$SMOLFORGE_HOME/twins/<family>[@full]`
(race-safe, like presets) and is deterministic for a seed.

Sources. The published Hugging Face repositories are not in the stored sources this project can read
(find_files on Qwen/Qwen2.5-0.5B-Instruct, meta-llama/Llama-3.2-1B-Instruct,
TinyLlama/TinyLlama-1.1B-Chat-v1.0, HuggingFaceTB/SmolLM2-360M-Instruct, openai-community/gpt2 and
microsoft/Phi-3-mini-4k-instruct finds nothing), so `twin_configs/<family>/config.json` reproduces each
published file key for key, checked against verbatim copies in public GitHub code:
- qwen2.5-0.5b-instruct: Qwen/Qwen2.5-0.5B-Instruct config.json; the same 25 keys appear verbatim in
  DongfuJiang's Qwen2.5 chunking README and a Rust config test ("matches exactly what Qwen2.5-0.5B-Instruct ships").
- llama-3.2-1b-instruct: meta-llama/Llama-3.2-1B-Instruct config.json; copies in
  ansuehu/LLaMA-Omni Llama-3.2-1B-Instruct/config.json (re-typed by that project) and the speculators docs.
- tinyllama-1.1b-chat-v1.0: TinyLlama/TinyLlama-1.1B-Chat-v1.0 config.json; a re-saved copy in
  swayam8624/nanoquant-private TinyLlama-1.1B-Chat-v1.0/config.json (its `dtype`/4.56.0 keys are the
  re-save; the published file has torch_dtype bfloat16 and transformers_version 4.35.0).
- smollm2-360m-instruct: HuggingFaceTB/SmolLM2-360M-Instruct config.json; only its shape is corroborated
  (SmolVLM2 `text_config` copies: 960 hidden, 15/5 heads, rope_theta 100000, pad 2; 361,821,120
  parameters), the other keys (is_llama_config, rope_interleaved, transformers.js_config) are as published
  to our knowledge but unverified here.
- gpt2: openai-community/gpt2 config.json; re-saved copy in Shubham2376G/FAQ_generator gpt2/config.json
  (its _name_or_path/torch_dtype/n_inner/reorder... keys are the re-save; the published file lacks them).
- phi-3-mini-4k-instruct: microsoft/Phi-3-mini-4k-instruct config.json (version with sliding_window 2047,
  transformers 4.40.2); verbatim copies in TensorRT-LLM's PHI3_MINI_4K_CONFIG test constant.
`generation_config.json`, `tokenizer_config.json` (less its chat template, which comes from
`chat_templates.TEMPLATES`) and `tokenizer_header.json` (tokenizer.json less vocab and merges, as
tokenizers 0.23 serialises it) reproduce the same repositories' files but could not be checked byte for
byte against them; the pre-tokenizer regexes were checked against llama.cpp's per-family regex table
(llama-vocab.cpp) and the Qwen2/Llama-3 constants in several tokenizer ports.

Why Phi-3-mini-4k-instruct and not Gemma-2-2B-it: Phi-3 is native in transformers (`phi3`), not
gated, and brings what no other twin has (fused qkv_proj / gate_up_proj, so LoRA target discovery and
GGUF tensor naming meet another layout; no GQA; an embedding of 32,064 rows over a 32,011-token
tokenizer; a list of eos ids in generation_config). Gemma-2 is gated, its tokenizer (256k, its own
normalizer) cannot be trained of the same kind in seconds, and its soft-capping would need its own
eager-attention handling.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from smolforge.errors import SmolforgeError
from smolforge.models import tiny
from smolforge.paths import home

PREFIX = "twin:"
FULL = "@full"


@dataclass(frozen=True)
class Family:
    """What a twin needs beyond its published files: where it comes from and how it is reduced."""

    hf_id: str
    template: str | None  # key in chat_templates.TEMPLATES; None: the family publishes no chat template
    reduced: dict = field(default_factory=dict)  # config keys the reduced twin changes (sizes only)
    published_params: int = 0  # parameter count of the published checkpoint (model card / safetensors)


# Reductions keep every head count (so the GQA ratio and the q/kv shapes stay the published kind) and
# shrink head_dim instead; layers go to 2.
FAMILIES: dict[str, Family] = {
    "qwen2.5-0.5b-instruct": Family(
        "Qwen/Qwen2.5-0.5B-Instruct", "qwen2.5",
        {"hidden_size": 112, "intermediate_size": 224, "num_hidden_layers": 2}, 494_032_768),
    "llama-3.2-1b-instruct": Family(
        "meta-llama/Llama-3.2-1B-Instruct", "llama-3.2",
        {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "head_dim": 4}, 1_235_814_400),
    "tinyllama-1.1b-chat-v1.0": Family(
        "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "tinyllama-chat",
        {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2}, 1_100_048_384),
    "smollm2-360m-instruct": Family(
        "HuggingFaceTB/SmolLM2-360M-Instruct", "smollm2",
        {"hidden_size": 120, "intermediate_size": 240, "num_hidden_layers": 2}, 361_821_120),
    "gpt2": Family("openai-community/gpt2", None, {"n_embd": 96, "n_layer": 2}, 124_439_808),
    "phi-3-mini-4k-instruct": Family(
        "microsoft/Phi-3-mini-4k-instruct", "phi-3",
        {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2}, 3_821_079_552),
}


def is_twin(name: str) -> bool:
    return name.startswith(PREFIX)


def parse(name: str) -> tuple[str, bool]:
    """(family, full) for a twin name; anything else is one SmolforgeError listing the known twins."""
    body = name[len(PREFIX):] if is_twin(name) else name
    full = body.endswith(FULL)
    family = body[: -len(FULL)] if full else body
    if family not in FAMILIES:
        raise SmolforgeError(
            f"unknown twin {name!r}",
            fix=f"use one of {', '.join(f'{PREFIX}{f}' for f in FAMILIES)} (add {FULL} for the published size)",
        )
    return family, full


def published(family: str, filename: str) -> dict:
    """A published file of `family` as stored in twin_configs (package data)."""
    text = resources.files("smolforge.models").joinpath("twin_configs", family, filename).read_text("utf-8")
    return json.loads(text)


def twin_config(family: str, full: bool) -> dict:
    """The config.json the twin writes: the published one, with the size keys reduced unless `full`."""
    config = published(family, "config.json")
    return config if full else {**config, **FAMILIES[family].reduced}


def twin_dir(name: str) -> Path:
    """The twin's directory, built with seed 0 on first use (race-safe, like `tiny.preset_dir`);
    `build.build_twin` writes one for another seed wherever you like."""
    from smolforge.models.twins.build import build_twin  # torch and transformers load only to build

    family, full = parse(name)
    final = home() / "twins" / (family + (FULL if full else ""))
    return tiny.atomic_build(final, lambda tmp: build_twin(family, full, tmp), tiny._complete, f"twin {name}")
