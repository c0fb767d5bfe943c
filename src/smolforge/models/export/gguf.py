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
from pathlib import Path
from typing import TYPE_CHECKING

from smolforge.errors import SmolforgeError
from smolforge.models import families
from smolforge.models.families import Family
from smolforge.models.families.rope import llama3_rope_factors, rope_params, write_rope_scaling  # noqa: F401
from smolforge.models.export.gguf_vocab import pre_tokenizer_name, write_tokenizer  # noqa: F401 (re-export)
from smolforge.models.export.merge import MergedModel
from smolforge.models.export.targets import QUANTS  # the weight types' names, one place

if TYPE_CHECKING:
    import numpy as np
    import torch

# the rope helpers moved to the families (models/families/rope.py); these names stay for their tests
_rope = rope_params
_rope_scaling = write_rope_scaling


def family_of(cfg: dict) -> Family:
    """The model's family, checked for GGUF export (refused: a family without a GGUF architecture, or a
    model llama.cpp would run differently)."""
    family = families.family_of(cfg)
    family.check_gguf(cfg)
    return family


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
    return {"f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "f32": Q.F32}[quant]


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
    """Write `model` (merged) to the GGUF file `path`; returns what was written, for the report.

    Tensors are merged in fp32 and rounded once, to the GGUF's type."""
    import gguf
    import numpy as np
    import torch

    if quant not in QUANTS:
        raise SmolforgeError(f"unknown --quant {quant!r}", fix=f"use one of {', '.join(QUANTS)}")
    cfg = model.config
    family = family_of(cfg)
    arch = getattr(gguf.MODEL_ARCH, family.gguf_arch)
    shapes = model.shapes()
    n_blocks = cfg.get("num_hidden_layers") or cfg.get("n_layer")
    tmap = gguf.get_tensor_name_map(arch, n_blocks)
    plan: list[tuple[str, str | None, tuple[int, ...]]] = []  # (gguf name, hf name or None, shape after fixes)
    for hf_name, shape in shapes.items():
        gname = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise SmolforgeError(f"no GGUF name for tensor {hf_name} of a {cfg['model_type']} model",
                                 fix="export with --to hf and convert with llama.cpp's convert_hf_to_gguf.py")
        plan.append((gname, hf_name, family.gguf_shape(hf_name, shape)))
    embed = next((p for p in plan if p[0] == "token_embd.weight"), None)
    if family.gguf_untie and embed and not any(p[0] == "output.weight" for p in plan):
        plan.append(("output.weight", embed[1], embed[2]))
    extras = family.gguf_extra_tensors(cfg)
    plan += [(gname, None, tuple(t.shape)) for gname, t in extras.items()]

    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(name or Path(cfg.get("_name_or_path") or model.base_dir).name)
    family.gguf_hparams(writer, cfg)
    writer.add_file_type({"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "f32": gguf.LlamaFileType.ALL_F32}[quant])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocab_size = cfg["vocab_size"]
    tok = write_tokenizer(writer, model.tokenizer_dir, cfg, vocab_size, chat_template(model.tokenizer_dir),
                          source=model.base_dir)
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
        tensor = extras[gname] if hf_name is None else family.gguf_fix(hf_name, model.tensor(hf_name, torch.float32), cfg)
        writer.write_tensor_data(_pack(tensor, qtypes[gname]))
        del tensor
    writer.close()
    return {"file": path.name, "bytes": path.stat().st_size, "arch": gguf.MODEL_ARCH_NAMES[arch],
            "quant": quant, "tensors": len(plan), **tok}
