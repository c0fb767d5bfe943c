"""Cut a decoder-only model into bottom, trunk and top, keeping the unsplit model's numerics.

    bottom = embeddings (+ learned positions for GPT-2) + layers [0, sp1)
    trunk  = layers [sp1, sp2)
    top    = layers [sp2, n) + final norm + LM head   (the loss is computed next to it, on the client)

Each part is an `nn.Module` whose forward takes (hidden or input ids, attention mask, positions).
It rebuilds what the HF model computes once at the top of its forward: the causal/padding mask
(from the 2-D attention mask, with transformers' own `create_causal_mask`) and, for Llama and
Qwen2, the rotary position embeddings (from the positions that travel with every call). The
layers themselves are the HF modules, called exactly as the HF model calls them, so the split
forward equals the full model's logits and gradients.

Layers keep their original index as their name (`layers.5...`), so LoRA weights trained in a
part map one-to-one onto the full model's module names (`model.layers.5...`, `transformer.h.5...`).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass

import torch
from torch import nn

from smolforge.errors import SmolforgeError
from smolforge.models.loading import load_model, load_tokenizer

# model_type -> (path of the decoder layer list in the *ForCausalLM model, family)
SUPPORTED: dict[str, tuple[str, str]] = {
    "llama": ("model.layers", "rope"),
    "qwen2": ("model.layers", "rope"),
    "gpt2": ("transformer.h", "gpt2"),
}


@dataclass(frozen=True)
class Arch:
    """What both sides must agree on about a model, plus where its layers live."""

    model_type: str
    num_layers: int
    hidden_size: int
    layers_prefix: str
    family: str

    def canonical(self, local_name: str) -> str:
        """`layers.5.self_attn.q_proj` (a part's name) -> `model.layers.5.self_attn.q_proj` (HF's)."""
        m = re.match(r"^(?:.*\.)?layers\.(\d+)\.(.*)$", local_name)
        if not m:
            return local_name
        return f"{self.layers_prefix}.{m.group(1)}.{m.group(2)}"


def arch_of(config) -> Arch:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        raise SmolforgeError(
            f"split learning does not support model type {model_type!r}",
            fix=f"use a model of the {', '.join(sorted(SUPPORTED))} families (e.g. the tiny-llama preset)",
        )
    prefix, family = SUPPORTED[model_type]
    return Arch(model_type=model_type, num_layers=int(config.num_hidden_layers), hidden_size=int(config.hidden_size),
                layers_prefix=prefix, family=family)


_LOAD_LOCK = threading.Lock()


def load_full_model(name: str, device="cpu"):
    """`load_model` (and the tokenizer) under a process-wide lock.

    transformers' `from_pretrained` switches process-global state (meta-device init), so two
    threads loading at once can get a model with tensors left on the meta device. Several
    clients, or a client and a server, may live in one process (tests, the cluster layer).
    """

    with _LOAD_LOCK:
        return load_model(name, device=device)


def load_tokenizer_locked(name: str):
    with _LOAD_LOCK:
        return load_tokenizer(name)


def check_split_points(sp1: int, sp2: int, num_layers: int) -> None:
    """0 <= sp1 < sp2 <= n: the trunk holds at least one layer; bottom and top may hold none."""
    if not (0 <= sp1 < sp2 <= num_layers):
        raise SmolforgeError(
            f"split points {sp1}, {sp2} do not cut a {num_layers}-layer model into bottom [0, sp1), "
            f"trunk [sp1, sp2), top [sp2, {num_layers})",
            fix=f"choose 0 <= --split-point-1 < --split-point-2 <= {num_layers}, "
            f"e.g. --split-point-1 1 --split-point-2 {max(2, num_layers - 1)}",
        )


def _decoder_layers(model) -> nn.ModuleList:
    arch = arch_of(model.config)
    obj = model
    for attr in arch.layers_prefix.split("."):
        obj = getattr(obj, attr)
    return obj


def _embedding(model) -> nn.Embedding:
    return model.get_input_embeddings()


def fingerprint(model) -> str:
    """A short hash of the architecture and a sample of the token embeddings.

    Both sides compute it from the full model before cutting it, so a client and a server that
    loaded different checkpoints of the same architecture disagree and the session is refused.
    """
    cfg = model.config
    keys = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads",
            "num_key_value_heads", "intermediate_size", "n_inner", "max_position_embeddings", "rope_theta")
    h = hashlib.sha256(json.dumps({k: getattr(cfg, k, None) for k in keys}, sort_keys=True, default=str).encode())
    weight = _embedding(model).weight.detach()
    step = max(1, weight.shape[0] // 64)
    h.update(weight[::step].float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class _Part(nn.Module):
    """Some decoder layers plus what is needed to call them (config, rotary embeddings)."""

    def __init__(self, config, layers: dict[int, nn.Module], rotary: nn.Module | None):
        super().__init__()
        self.config = config
        self.arch = arch_of(config)
        self.layer_ids = sorted(layers)
        self.layers = nn.ModuleDict({str(i): layers[i] for i in self.layer_ids})
        self.rotary_emb = rotary

    def _masks(self, h: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor):
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        kwargs = dict(config=self.config, inputs_embeds=h, attention_mask=attention_mask,
                      past_key_values=None, position_ids=position_ids)
        masks = {"full_attention": create_causal_mask(**kwargs)}
        if "sliding_attention" in (getattr(self.config, "layer_types", None) or []):
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
        return masks

    def run_layers(self, h: torch.Tensor, attention_mask: torch.Tensor | None,
                   position_ids: torch.Tensor) -> torch.Tensor:
        if not self.layer_ids:
            return h
        if attention_mask is not None and attention_mask.ndim < 4:
            attention_mask = attention_mask.view(h.shape[0], -1)
        masks = self._masks(h, attention_mask, position_ids)
        if self.arch.family == "gpt2":
            for i in self.layer_ids:
                h = self.layers[str(i)](h, None, masks["full_attention"], None, encoder_attention_mask=None,
                                        use_cache=False, position_ids=position_ids)
            return h
        position_embeddings = self.rotary_emb(h, position_ids=position_ids)
        layer_types = getattr(self.config, "layer_types", None)
        for i in self.layer_ids:
            kind = layer_types[i] if layer_types else "full_attention"
            h = self.layers[str(i)](h, attention_mask=masks[kind], position_embeddings=position_embeddings,
                                    position_ids=position_ids, past_key_values=None, use_cache=False)
        return h


class Bottom(_Part):
    """Token (and, for GPT-2, position) embeddings, then layers [0, sp1)."""

    def __init__(self, model, sp1: int):
        layers = _decoder_layers(model)
        super().__init__(model.config, {i: layers[i] for i in range(sp1)}, _rotary(model))
        self.embed = _embedding(model)
        if self.arch.family == "gpt2":
            self.wpe = model.transformer.wpe
            self.drop = model.transformer.drop

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        if self.arch.family == "gpt2":
            h = self.drop(h + self.wpe(position_ids).to(h.device))
        return self.run_layers(h, attention_mask, position_ids)


class Trunk(_Part):
    """Layers [sp1, sp2): the part the server runs."""

    def __init__(self, model, sp1: int, sp2: int):
        layers = _decoder_layers(model)
        super().__init__(model.config, {i: layers[i] for i in range(sp1, sp2)}, _rotary(model))

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor) -> torch.Tensor:
        return self.run_layers(hidden, attention_mask, position_ids)


class Top(_Part):
    """Layers [sp2, n), the final norm and the LM head; returns logits (the loss stays with the labels)."""

    def __init__(self, model, sp2: int):
        layers = _decoder_layers(model)
        super().__init__(model.config, {i: layers[i] for i in range(sp2, len(layers))}, _rotary(model))
        self.norm = model.transformer.ln_f if self.arch.family == "gpt2" else model.model.norm
        self.lm_head = model.get_output_embeddings()

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor) -> torch.Tensor:
        h = self.run_layers(hidden, attention_mask, position_ids)
        return self.lm_head(self.norm(h))


def _rotary(model) -> nn.Module | None:
    return None if arch_of(model.config).family == "gpt2" else model.model.rotary_emb


@dataclass
class Parts:
    bottom: Bottom | None
    trunk: Trunk | None
    top: Top | None
    arch: Arch


def partition(model, sp1: int, sp2: int, keep: tuple[str, ...] = ("bottom", "trunk", "top")) -> Parts:
    """Cut `model` (an HF *ForCausalLM) at sp1/sp2. Parts share the model's modules (no copies).

    `keep` picks the parts to build: the client keeps bottom and top, the server the trunk. Drop
    the reference to `model` afterwards and the layers no part holds are freed.
    """
    arch = arch_of(model.config)
    check_split_points(sp1, sp2, arch.num_layers)
    return Parts(
        bottom=Bottom(model, sp1) if "bottom" in keep else None,
        trunk=Trunk(model, sp1, sp2) if "trunk" in keep else None,
        top=Top(model, sp2) if "top" in keep else None,
        arch=arch,
    )


def positions_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids as the HF model builds them for right-padded batches: 0..T-1 on every row."""
    b, t = attention_mask.shape
    return torch.arange(t, device=attention_mask.device).unsqueeze(0).expand(b, t)
