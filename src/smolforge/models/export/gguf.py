"""`--to gguf`: a merged Llama, Qwen2, Phi-3 or GPT-2 model as one GGUF file for llama.cpp and Ollama.

The `gguf` package (llama.cpp's own writer) does the format, the tensor names (TensorNameMap) and
the q8_0/bf16 packing; this module is the glue no library ships as an importable function
(llama.cpp's `convert_hf_to_gguf.py` is a script, not in the package):
- hyper-parameters per family, and the tensor layout fixes llama.cpp expects: Llama's q/k rows
  permuted from HF's rotate-half rope to llama.cpp's interleaved (NORM) rope, Qwen2's left as
  they are (NEOX rope), Phi-3's fused qkv/gate_up kept fused (NEOX too), GPT-2's Conv1D weights transposed, tied embeddings (GPT-2 gets an explicit
  output tensor; Llama and Qwen2 fall back to the embedding in llama.cpp; an adapter on the tied head
  or embedding merges untied, `models/tied.py`, and the head is written as its own output.weight);
- the tokenizer (gguf_vocab.py): byte-level BPE with the pre-tokenizer name read from what
  tokenizer.json actually does (not from a hash table), or SentencePiece-style byte-fallback BPE;
- rope scaling as llama.cpp's converter carries it: Llama 3's as a `rope_freqs` tensor, linear
  and YaRN as keys.

Written streaming: every tensor's info first (shapes come from the safetensors headers), then one
merged, converted tensor at a time, so the peak is one tensor above the adapters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from smolforge.errors import SmolforgeError
from smolforge.models.export.gguf_vocab import pre_tokenizer_name, write_tokenizer  # noqa: F401 (re-export)
from smolforge.models.export.merge import MergedModel
from smolforge.models.export.targets import QUANTS  # the weight types' names, one place

if TYPE_CHECKING:
    import numpy as np
    import torch

GPT2_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")


def _permute(w: "torch.Tensor", n_head: int) -> "torch.Tensor":
    """HF rotate-half rope rows -> llama.cpp's interleaved pairs (convert_hf_to_gguf's LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class Family:
    arch: str  # gguf.MODEL_ARCH member name
    hparams: Callable[[object, dict], None]  # (writer, config) -> writes the architecture's keys
    fix: Callable[[str, "torch.Tensor", dict], "torch.Tensor"]  # (hf name, tensor, config) -> llama.cpp layout
    untie: bool  # write output.weight from the embedding when the head is tied


def _rope(cfg: dict) -> dict:
    """The rope parameters (transformers 5 keeps them in rope_parameters, 4 in rope_scaling)."""
    rope = dict(cfg.get("rope_scaling") or {})
    rope.update(cfg.get("rope_parameters") or {})
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope["kind"] = rope.get("rope_type", rope.get("type")) or "default"
    return rope


YARN_DEFAULTS = {"attention_factor": None, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": None,
                 "mscale_all_dim": None}  # what llama.cpp assumes (it derives the attention factor itself)


def _rope_scaling(w, cfg: dict, arch: str) -> None:
    """Rope scaling keys as llama.cpp's convert_hf_to_gguf.py writes them; a kind llama.cpp would
    run differently is refused, since a wrong rope only shows as a worse model."""
    import gguf

    rope = _rope(cfg)
    kind = rope["kind"]
    if kind == "default":
        return
    if kind == "llama3" and arch == "LLAMA":
        return  # carried by the rope_freqs tensor (_extra_tensors); llama.cpp reads it per layer
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

    rope = _rope(cfg)
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


def _extra_tensors(cfg: dict, arch: str) -> dict[str, "torch.Tensor"]:
    """Tensors llama.cpp needs that the checkpoint does not hold (GGUF name -> tensor)."""
    if arch == "LLAMA" and _rope(cfg)["kind"] == "llama3":
        return {"rope_freqs.weight": llama3_rope_factors(cfg)}
    return {}


def _llama_like_hparams(w, cfg: dict) -> None:
    heads = cfg["num_attention_heads"]
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    w.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    w.add_rope_freq_base(float(_rope(cfg)["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    _rope_scaling(w, cfg, "QWEN2" if cfg.get("model_type") == "qwen2" else "LLAMA")


def _llama_fix(name: str, t: "torch.Tensor", cfg: dict) -> "torch.Tensor":
    heads = cfg["num_attention_heads"]
    if name.endswith("q_proj.weight"):
        return _permute(t, heads)
    if name.endswith("k_proj.weight"):
        return _permute(t, cfg.get("num_key_value_heads") or heads)
    return t


def _phi3_hparams(w, cfg: dict) -> None:
    """Phi-3 as convert_hf_to_gguf.py's Phi3MiniModel writes it: Llama's keys plus the original context
    length and the sliding window (0: none). Its fused qkv_proj and gate_up_proj keep their layout
    (llama.cpp's `attn_qkv` and `ffn_up` of twice the width); its rope is NEOX, so no permutation.
    Long-context rope (`longrope`, the 128k models) is refused by `_rope_scaling`."""
    heads = cfg["num_attention_heads"]
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_rope_scaling_orig_ctx_len(int(cfg.get("original_max_position_embeddings") or cfg["max_position_embeddings"]))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(int(cfg.get("partial_rotary_factor", 1.0) * cfg["hidden_size"]) // heads)
    w.add_rope_freq_base(float(_rope(cfg)["rope_theta"]))
    w.add_sliding_window(int(cfg.get("sliding_window") or 0))
    _rope_scaling(w, cfg, "PHI3")


def _gpt2_hparams(w, cfg: dict) -> None:
    w.add_context_length(cfg["n_positions"])
    w.add_embedding_length(cfg["n_embd"])
    w.add_block_count(cfg["n_layer"])
    w.add_feed_forward_length(cfg.get("n_inner") or 4 * cfg["n_embd"])
    w.add_head_count(cfg["n_head"])
    w.add_layer_norm_eps(cfg["layer_norm_epsilon"])


def _gpt2_fix(name: str, t: "torch.Tensor", cfg: dict) -> "torch.Tensor":
    return t.T.contiguous() if name.endswith(GPT2_CONV1D) else t


FAMILIES: dict[str, Family] = {
    "llama": Family("LLAMA", _llama_like_hparams, _llama_fix, untie=False),
    "qwen2": Family("QWEN2", _llama_like_hparams, lambda name, t, cfg: t, untie=False),
    "gpt2": Family("GPT2", _gpt2_hparams, _gpt2_fix, untie=True),
    "phi3": Family("PHI3", _phi3_hparams, lambda name, t, cfg: t, untie=False),
}


def family_of(cfg: dict) -> Family:
    kind = cfg.get("model_type")
    if kind not in FAMILIES:
        raise SmolforgeError(f"GGUF export supports the {', '.join(FAMILIES)} families, not {kind!r}",
                             fix="export with --to hf and convert that directory with llama.cpp's convert_hf_to_gguf.py")
    if kind == "gpt2" and cfg.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise SmolforgeError(f"GPT-2 with activation {cfg['activation_function']!r} has no llama.cpp equivalent",
                             fix="export with --to hf")
    return FAMILIES[kind]


# --------------------------------------------------------------------------- tokenizer

def chat_template(tok_dir: Path) -> str | None:
    """The tokenizer's chat template (transformers 5 keeps it in chat_template.jinja)."""
    jinja = tok_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    tc = tok_dir / "tokenizer_config.json"
    if tc.is_file():
        value = json.loads(tc.read_text(encoding="utf-8")).get("chat_template")
        return value if isinstance(value, str) else None
    return None


# --------------------------------------------------------------------------- tensors

def _qtype(name: str, shape: tuple[int, ...], quant: str):
    """How one tensor is stored: norms, biases and position embeddings in F32 (as convert_hf_to_gguf)."""
    import gguf

    Q = gguf.GGMLQuantizationType
    if len(shape) == 1 or name.startswith("position_embd"):
        return Q.F32
    if quant == "q8_0" and shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0] != 0:
        return Q.F16  # q8_0 packs rows in blocks of 32
    return {"f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}[quant]


def _pack(t: "torch.Tensor", qtype) -> "np.ndarray":
    import gguf
    import numpy as np

    Q = gguf.GGMLQuantizationType
    data = t.float().numpy()
    if qtype == Q.F32:
        return data.astype(np.float32)
    if qtype == Q.F16:
        return data.astype(np.float16)
    return gguf.quants.quantize(data, qtype)


def write_gguf(model: MergedModel, path: Path, quant: str = "f16", name: str | None = None) -> dict:
    """Write `model` (merged) to the GGUF file `path`; returns what was written, for the report."""
    import gguf
    import numpy as np

    if quant not in QUANTS:
        raise SmolforgeError(f"unknown --quant {quant!r}", fix=f"use one of {', '.join(QUANTS)}")
    cfg = model.config
    family = family_of(cfg)
    arch = getattr(gguf.MODEL_ARCH, family.arch)
    shapes = model.shapes()
    n_blocks = cfg.get("num_hidden_layers") or cfg.get("n_layer")
    tmap = gguf.get_tensor_name_map(arch, n_blocks)
    plan: list[tuple[str, str | None, tuple[int, ...]]] = []  # (gguf name, hf name or None, shape after fixes)
    for hf_name, shape in shapes.items():
        gname = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise SmolforgeError(f"no GGUF name for tensor {hf_name} of a {cfg['model_type']} model",
                                 fix="export with --to hf and convert with llama.cpp's convert_hf_to_gguf.py")
        if family.fix is _gpt2_fix and hf_name.endswith(GPT2_CONV1D):
            shape = shape[::-1]
        plan.append((gname, hf_name, shape))
    embed = next((p for p in plan if p[0] == "token_embd.weight"), None)
    if family.untie and embed and not any(p[0] == "output.weight" for p in plan):
        plan.append(("output.weight", embed[1], embed[2]))
    extras = _extra_tensors(cfg, family.arch)
    plan += [(gname, None, tuple(t.shape)) for gname, t in extras.items()]

    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(name or Path(cfg.get("_name_or_path") or model.base_dir).name)
    family.hparams(writer, cfg)
    writer.add_file_type({"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[quant])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocab_size = cfg["vocab_size"]
    tok = write_tokenizer(writer, model.tokenizer_dir, cfg, vocab_size, chat_template(model.tokenizer_dir))
    qtypes = {}
    for gname, _, shape in plan:
        qtype = qtypes[gname] = _qtype(gname, shape, quant)
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            dtype = np.float32 if qtype == gguf.GGMLQuantizationType.F32 else np.float16
            writer.add_tensor_info(gname, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
        else:
            byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, qtype)
            writer.add_tensor_info(gname, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for gname, hf_name, _ in plan:
        tensor = extras[gname] if hf_name is None else family.fix(hf_name, model.tensor(hf_name), cfg)
        writer.write_tensor_data(_pack(tensor, qtypes[gname]))
        del tensor
    writer.close()
    return {"file": path.name, "bytes": path.stat().st_size, "arch": gguf.MODEL_ARCH_NAMES[arch],
            "quant": quant, "tensors": len(plan), **tok}
