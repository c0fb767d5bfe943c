"""Rope as llama.cpp's converter (convert_hf_to_gguf.py) carries it into a GGUF: the parameters, the
scaling keys, and Llama 3's per-frequency factors. Shared by the families' `gguf_hparams`."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from smolforge.errors import SmolforgeError

if TYPE_CHECKING:
    import torch


def rope_params(cfg: dict) -> dict:
    """The rope parameters (transformers 5 keeps them in rope_parameters, 4 in rope_scaling)."""
    rope = dict(cfg.get("rope_scaling") or {})
    rope.update(cfg.get("rope_parameters") or {})
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope["kind"] = rope.get("rope_type", rope.get("type")) or "default"
    return rope


YARN_DEFAULTS = {"attention_factor": None, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": None,
                 "mscale_all_dim": None}  # what llama.cpp assumes (it derives the attention factor itself)


def write_rope_scaling(w, cfg: dict, arch: str, llama3_as_tensor: bool = False) -> None:
    """Rope scaling keys as llama.cpp's convert_hf_to_gguf.py writes them; a kind llama.cpp would
    run differently is refused, since a wrong rope only shows as a worse model. `llama3_as_tensor`: the
    family carries Llama 3's scaling as a `rope_freqs` tensor (`gguf_extra_tensors`), so no key is written;
    `arch` names the architecture in the refusal."""
    import gguf

    rope = rope_params(cfg)
    kind = rope["kind"]
    if kind == "default":
        return
    if kind == "llama3" and llama3_as_tensor:
        return  # carried by the rope_freqs tensor; llama.cpp reads it per layer
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
        return
    if kind == "yarn" and all(rope.get(k, v) in (v, None) for k, v in YARN_DEFAULTS.items()):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rope.get("original_max_position_embeddings")
                                            or cfg["max_position_embeddings"]))
        return
    raise SmolforgeError(f"rope scaling {kind!r} ({json.dumps({k: v for k, v in rope.items() if k != 'kind'})}) on a "
                         f"{arch.lower()} model has no llama.cpp equivalent smolforge writes",
                         fix="export with --to hf and convert with llama.cpp's convert_hf_to_gguf.py; GGUF export "
                             "carries default, linear, yarn (default betas) and llama3 (Llama) rope")


def llama3_rope_factors(cfg: dict) -> "torch.Tensor":
    """Llama 3's per-frequency rope divisors, as convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors
    computes them (llama.cpp divides each rope frequency by its factor), from the rope parameters
    HF itself uses (transformers' _compute_llama3_parameters reads original_max_position_embeddings
    from the rope parameters, so that is where it is read here too)."""
    import math

    import torch

    rope = rope_params(cfg)
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (float(rope["rope_theta"]) ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = float(rope.get("factor", 8.0)), float(rope.get("low_freq_factor", 1.0)), \
        float(rope.get("high_freq_factor", 4.0))
    old_ctx = float(rope.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)
