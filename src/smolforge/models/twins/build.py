"""Write a twin directory: published config files, random weights in the published dtype, the tokenizer.

Why the JSON is written by us and not by `save_pretrained`: transformers 5 rewrites configs on save
(`torch_dtype` becomes `dtype`, rope keys move into `rope_parameters`), and a twin must carry the file
users download, so the loader meets the published spelling.
"""

from __future__ import annotations

import json
from pathlib import Path

from smolforge.models.twins import FAMILIES, published, twin_config


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def tokenizer_config(family: str) -> dict:
    """The published tokenizer_config.json: its keys, the added tokens it lists, and the chat template."""
    from smolforge.models.chat_templates import TEMPLATES

    header = published(family, "tokenizer_header.json")
    config = published(family, "tokenizer_config.json")
    decoder = {str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
               for t in header["added_tokens"]}
    config = {"added_tokens_decoder": decoder, **config}
    key = FAMILIES[family].template
    if key is not None:
        if key not in TEMPLATES:
            raise RuntimeError(f"chat_templates.TEMPLATES has no {key!r} template for twin {family}")
        config["chat_template"] = TEMPLATES[key]
    return dict(sorted(config.items()))


def write_tokenizer(family: str, out: Path) -> None:
    from smolforge.models.twins.tokenizer import tokenizer_json

    header = published(family, "tokenizer_header.json")
    (out / "tokenizer.json").write_text(json.dumps(tokenizer_json(header), ensure_ascii=False), encoding="utf-8")
    _write_json(out / "tokenizer_config.json", tokenizer_config(family))


def write_weights(out: Path, seed: int) -> None:
    """Random weights for the config already in `out`, saved in the published torch_dtype."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(out)
    dtype = getattr(torch, json.loads((out / "config.json").read_text()).get("torch_dtype", "float32"))
    # Its own RNG stream, as tiny.build_preset: building on first use must not reseed the caller.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # Built in the published dtype: a full Phi-3 twin in fp32 first would need 15 GB.
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out)


def build_twin(family: str, full: bool, out: str | Path, seed: int = 0) -> Path:
    """Write the twin of `family` at `out` (deterministic for a seed)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", twin_config(family, full))
    write_weights(out, seed)
    # save_pretrained rewrote both files in transformers 5 spelling: put the published ones back.
    _write_json(out / "config.json", twin_config(family, full))
    _write_json(out / "generation_config.json", published(family, "generation_config.json"))
    write_tokenizer(family, out)
    return out
