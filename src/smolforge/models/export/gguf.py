"""`--to gguf`: a merged Llama, Qwen2 or GPT-2 model as one GGUF file for llama.cpp and Ollama.

The `gguf` package (llama.cpp's own writer) does the format, the tensor names (TensorNameMap) and
the q8_0/bf16 packing; this module is the glue no library ships as an importable function
(llama.cpp's `convert_hf_to_gguf.py` is a script, not in the package):
- hyper-parameters per family, and the tensor layout fixes llama.cpp expects: Llama's q/k rows
  permuted from HF's rotate-half rope to llama.cpp's interleaved (NORM) rope, Qwen2's left as
  they are (NEOX rope), GPT-2's Conv1D weights transposed, tied embeddings (GPT-2 gets an explicit
  output tensor; Llama and Qwen2 fall back to the embedding in llama.cpp);
- the byte-level BPE tokenizer: tokens, token types, merges, special ids, chat template, and the
  pre-tokenizer name read from what tokenizer.json actually does (not from a hash table).

Written streaming: every tensor's info first (shapes come from the safetensors headers), then one
merged, converted tensor at a time, so the peak is one tensor above the adapters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from smolforge.errors import SmolforgeError
from smolforge.models.export.merge import MergedModel

if TYPE_CHECKING:
    import numpy as np
    import torch

QUANTS = ("f16", "bf16", "q8_0")
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


def _rope_theta(cfg: dict) -> float:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", None):
        raise SmolforgeError(f"rope scaling {kind!r} is not supported by GGUF export yet",
                             fix="export a model with plain rope (no rope_scaling), or convert with llama.cpp's "
                                 "convert_hf_to_gguf.py")
    return float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _llama_like_hparams(w, cfg: dict) -> None:
    heads = cfg["num_attention_heads"]
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    w.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    w.add_rope_freq_base(_rope_theta(cfg))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])


def _llama_fix(name: str, t: "torch.Tensor", cfg: dict) -> "torch.Tensor":
    heads = cfg["num_attention_heads"]
    if name.endswith("q_proj.weight"):
        return _permute(t, heads)
    if name.endswith("k_proj.weight"):
        return _permute(t, cfg.get("num_key_value_heads") or heads)
    return t


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

def _pre_step(step: dict) -> tuple:
    """What matters of one pre-tokenizer step for the split it makes."""
    kind = step.get("type")
    if kind == "ByteLevel":
        return (kind, step.get("use_regex", True), step.get("add_prefix_space", False))
    if kind == "Digits":
        return (kind, step.get("individual_digits", False))
    return (kind,)


def pre_tokenizer_name(tokenizer_json: dict) -> str:
    """The llama.cpp pre-tokenizer that splits text exactly as tokenizer.json's pre_tokenizer does.

    Read from the pre-tokenizer itself: ByteLevel with its GPT-2 regex is llama.cpp's `gpt2`;
    single digits split first, then ByteLevel's regex, is `starcoder` (its regexes are `\\p{N}` and
    then GPT-2's). Anything else is refused rather than guessed: a wrong name tokenizes differently.
    """
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    shape = [_pre_step(s) for s in steps]
    if shape == [("ByteLevel", True, False)]:
        return "gpt2"
    if shape == [("Digits", True), ("ByteLevel", True, False)]:
        return "starcoder"
    raise SmolforgeError(f"the tokenizer's pre-tokenizer {json.dumps(pre)[:200]} has no known llama.cpp equivalent",
                         fix="export with --to hf and convert with llama.cpp's convert_hf_to_gguf.py, which knows "
                             "the pre-tokenizers of published models")


def _token_id(tokenizer_json: dict, token: str | dict | None) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    if not token:
        return None
    vocab = tokenizer_json["model"]["vocab"]
    if token in vocab:
        return vocab[token]
    return next((a["id"] for a in tokenizer_json.get("added_tokens", []) if a["content"] == token), None)


def write_tokenizer(w, tok_dir: Path, cfg: dict, vocab_size: int) -> dict:
    """The tokenizer keys; returns {eos, bos, pad, pre} for the report."""
    import gguf

    tj = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    if tj.get("model", {}).get("type") != "BPE":
        raise SmolforgeError(f"{tok_dir}/tokenizer.json is not a BPE tokenizer", fix="export with --to hf")
    tc_path = tok_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text(encoding="utf-8")) if tc_path.is_file() else {}
    pre = pre_tokenizer_name(tj)
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for text, i in tj["model"]["vocab"].items():
        if i < vocab_size:
            tokens[i], types[i] = text, gguf.TokenType.NORMAL
    for added in tj.get("added_tokens", []):
        if added["id"] < vocab_size:
            tokens[added["id"]] = added["content"]
            types[added["id"]] = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"].get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    eos = _token_id(tj, tc.get("eos_token")) if tc.get("eos_token") else cfg.get("eos_token_id")
    bos = _token_id(tj, tc.get("bos_token")) if tc.get("bos_token") else cfg.get("bos_token_id")
    pad = _token_id(tj, tc.get("pad_token")) if tc.get("pad_token") else cfg.get("pad_token_id")
    for add, value in ((w.add_eos_token_id, eos), (w.add_bos_token_id, bos), (w.add_pad_token_id, pad)):
        if isinstance(value, int):
            add(value)
    # Our byte-level tokenizers add no BOS (tokenizer_config bos_token null): llama.cpp must not either.
    w.add_add_bos_token(bool(tc.get("add_bos_token", False)) and bool(tc.get("bos_token")))
    template = chat_template(tok_dir)
    if template:
        w.add_chat_template(template)
    return {"pre_tokenizer": pre, "eos_token_id": eos, "bos_token_id": bos, "pad_token_id": pad}


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
    plan: list[tuple[str, str, tuple[int, ...]]] = []  # (gguf name, hf name, shape in HF order after fixes)
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

    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(name or Path(cfg.get("_name_or_path") or model.base_dir).name)
    family.hparams(writer, cfg)
    writer.add_file_type({"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[quant])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocab_size = cfg["vocab_size"]
    tok = write_tokenizer(writer, model.tokenizer_dir, cfg, vocab_size)
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
        tensor = family.fix(hf_name, model.tensor(hf_name), cfg)
        writer.write_tensor_data(_pack(tensor, qtypes[gname]))
        del tensor
    writer.close()
    return {"file": path.name, "bytes": path.stat().st_size, "arch": gguf.MODEL_ARCH_NAMES[arch],
            "quant": quant, "tensors": len(plan), **tok}
