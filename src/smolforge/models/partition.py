"""Cut a decoder-only HF model into N pipeline stages by layer ranges, and choose where the cuts go.

    stage 0     = token embeddings (+ learned positions and dropout for GPT-2) + layers [b0, b1)
    stage i     = layers [b_i, b_{i+1})
    stage N-1   = layers [b_{N-1}, n) + final norm + LM head

Each stage is an `nn.Module` whose forward takes (input ids or hidden states, 2-D attention mask,
position ids, optional KV cache). It rebuilds what the HF model computes once at the top of its
forward: the causal/padding mask (transformers' own `create_causal_mask`, sized from the stage's
own cache layers) and, for Llama and Qwen2, the rotary embeddings (from the positions that travel
with every call). The layers are the HF modules, called as the HF model calls them and keeping
their global `layer_idx`, so the chained stages give the full model's logits, gradients and, with
one `DynamicCache` per stage, its greedy decoding.

Stages share the model's modules (no copies), and their parameter names keep the layer index
(`layers.5.self_attn.q_proj.weight`), so `stage_state_to_hf` maps a stage's state onto the full
model's names and per-stage checkpoints assemble into an ordinary HF state dict.

Tied embeddings (the tiny presets, GPT-2): the last stage's `lm_head` is the model's own module,
whose weight *is* the first stage's embedding matrix. In one process that is exact: both uses
feed one parameter and its gradient sums them, as in the HF model. Stages that end up in separate
processes each hold their own copy (`untie_head` makes one in-process); then the gradient of the
embedding is the sum of the first stage's embedding gradient and the last stage's head gradient,
and a pipeline trainer must add them (and keep the copies equal) itself.

`cluster.control.stage_plan.plan_stages` chooses the layer ranges and the node for each stage.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from smolforge.errors import SmolforgeError
from smolforge.models.families import Family, family_of

@dataclass(frozen=True)
class Arch:
    """What every holder of a piece must agree on about a model, plus where its layers live."""

    model_type: str
    num_layers: int
    hidden_size: int
    layers_prefix: str
    family: Family  # what the stage code asks (models/families)

    def canonical(self, local_name: str) -> str:
        """`layers.5.self_attn.q_proj` (a stage's name) -> `model.layers.5.self_attn.q_proj` (HF's)."""
        m = re.match(r"^(?:.*\.)?layers\.(\d+)\.(.*)$", local_name)
        if not m:
            return local_name
        return f"{self.layers_prefix}.{m.group(1)}.{m.group(2)}"


def arch_of(config) -> Arch:
    """The model's stage-relevant shape; refused (SmolforgeError) for a family that cannot be cut."""
    family = family_of(config)
    family.check_stages()
    return Arch(model_type=family.model_type, num_layers=int(config.num_hidden_layers),
                hidden_size=int(config.hidden_size), layers_prefix=str(family.layers_prefix), family=family)


def decoder_layers(model) -> nn.ModuleList:
    obj = model
    for attr in arch_of(model.config).layers_prefix.split("."):
        obj = getattr(obj, attr)
    return obj


def final_norm(model) -> nn.Module:
    return arch_of(model.config).family.final_norm(model)


def rotary_of(model) -> nn.Module | None:
    return arch_of(model.config).family.rotary(model)


def fingerprint(model) -> str:
    """A short hash of the architecture and a sample of the token embeddings.

    Every holder of a piece computes it from the full model before cutting it, so two processes
    that loaded different checkpoints of the same architecture disagree and can refuse to pair up.
    A holder that never loads the embeddings hashes the same rows read from the checkpoint
    (`fingerprint_of` with `fingerprint_rows`: models/stage_load.py `checkpoint_fingerprint`).
    """
    weight = model.get_input_embeddings().weight.detach()
    return fingerprint_of(model.config, weight[fingerprint_rows(weight.shape[0])])


def fingerprint_rows(vocab_size: int) -> slice:
    """The embedding rows the fingerprint samples: about 64, evenly spaced."""
    return slice(None, None, max(1, vocab_size // 64))


def fingerprint_of(config, rows: torch.Tensor) -> str:
    """The fingerprint of a model with `config` whose embedding rows `fingerprint_rows` are `rows`
    ([about 64, hidden], in the dtype the model is loaded in): 16 hex digits."""
    keys = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads",
            "num_key_value_heads", "intermediate_size", "n_inner", "max_position_embeddings", "rope_theta")
    h = hashlib.sha256(json.dumps({k: getattr(config, k, None) for k in keys}, sort_keys=True, default=str).encode())
    h.update(rows.float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def positions_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids as the HF model builds them for right-padded batches: 0..T-1 on every row."""
    b, t = attention_mask.shape
    return torch.arange(t, device=attention_mask.device).unsqueeze(0).expand(b, t)


def generation_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids as HF `generate` builds them for left-padded prompts: count real tokens, pads get 0.

    Slice the last column(s) for a decoding step: the mask then covers past and new tokens.
    """
    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)


# --------------------------------------------------------------------------------------------- stages


class Stage(nn.Module):
    """Layers [lo, hi) of a model; the first stage also embeds, the last also normalises and projects.

    Built by `cut`. The modules are the model's own (no copies); the HF name of each lives in
    `hf_name`, so a stage's state maps onto the full model's state dict.
    """

    def __init__(self, model, lo: int, hi: int, *, embeddings: bool, head: bool):
        super().__init__()
        self.config = model.config
        self.generation_config = getattr(model, "generation_config", None)  # its eos ids: families.stop_ids
        self.arch = arch_of(model.config)
        self.lo, self.hi = lo, hi
        self.has_embeddings, self.has_head = embeddings, head
        self.layer_ids = list(range(lo, hi))
        layers = decoder_layers(model)
        self.layers = nn.ModuleDict({str(i): layers[i] for i in self.layer_ids})
        self.rotary_emb = rotary_of(model) if self.layer_ids else None
        if embeddings:
            self.embed = model.get_input_embeddings()
            for name, module in self.arch.family.extra_embeddings(model).items():
                setattr(self, name, module)
        if head:
            self.norm = final_norm(model)
            self.lm_head = model.get_output_embeddings()
        # True when this stage's head weight is the model's input embedding matrix (see the module doc).
        self.tied_head = head and self.lm_head.weight is model.get_input_embeddings().weight
        owner = {id(m): name for name, m in model.named_modules()}
        self._hf_prefix = {f"layers.{i}": owner[id(layers[i])] for i in self.layer_ids}
        self._hf_prefix.update({name: owner[id(m)] for name, m in self.named_children() if name != "layers"})

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
                cache=None) -> torch.Tensor:
        """Input ids (first stage) or hidden states -> hidden states, or logits on the last stage.

        With `cache` (a `DynamicCache`), x holds only the new tokens, the mask covers past and new
        tokens, and the layers append their keys/values to the cache under their global index.
        """
        h = self._embed(x, position_ids) if self.has_embeddings else x
        h = self.run_layers(h, attention_mask, position_ids, cache)
        return self.lm_head(self.norm(h)) if self.has_head else h

    def _embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.arch.family.embed(self, input_ids, position_ids)

    def run_layers(self, h: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
                   cache=None) -> torch.Tensor:
        if not self.layer_ids:
            return h
        if attention_mask is not None and attention_mask.ndim < 4:
            attention_mask = attention_mask.view(h.shape[0], -1)
        masks = self._masks(h, attention_mask, position_ids, cache)
        return self.arch.family.run_layers(self, h, masks, position_ids, cache)

    def layer_type(self, i: int) -> str:
        layer_types = getattr(self.config, "layer_types", None)
        return layer_types[i] if layer_types else "full_attention"

    def _masks(self, h: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
               cache) -> dict[str, torch.Tensor | None]:
        """One mask per attention kind, sized from this stage's first layer of that kind.

        HF sizes the mask from the cache's first full-attention layer (layer 0); a later stage's
        cache never fills layer 0, so the mask must be sized from a layer this stage runs.
        """
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        builders = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        masks: dict[str, torch.Tensor | None] = {}
        for i in self.layer_ids:
            kind = self.layer_type(i)
            if kind not in masks:
                masks[kind] = builders[kind](config=self.config, inputs_embeds=h, attention_mask=attention_mask,
                                             past_key_values=cache, position_ids=position_ids, layer_idx=i)
        return masks

    def new_cache(self):
        """An empty KV cache for this stage: layers fill only their own (global) slots."""
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    def hf_name(self, local_name: str) -> str:
        """`layers.5.mlp.up_proj.weight` -> `model.layers.5.mlp.up_proj.weight`; `embed.weight` -> HF's name."""
        top, _, rest = local_name.partition(".")
        if top == "layers":
            index, _, rest = rest.partition(".")
            top = f"layers.{index}"
        prefix = self._hf_prefix[top]
        return f"{prefix}.{rest}" if rest else prefix


def check_bounds(bounds: Sequence[int], num_layers: int) -> None:
    """N+1 non-decreasing ints from 0 to n; only the first and the last stage may hold no layers."""
    ok = (len(bounds) >= 2 and all(isinstance(b, int) for b in bounds)
          and bounds[0] == 0 and bounds[-1] == num_layers
          and all(lo <= hi for lo, hi in zip(bounds, bounds[1:]))
          and all(bounds[i] < bounds[i + 1] for i in range(1, len(bounds) - 2)))
    if not ok:
        raise SmolforgeError(
            f"stage bounds {list(bounds)} do not cut a {num_layers}-layer model into stages",
            fix=f"give N+1 increasing layer indices from 0 to {num_layers}, e.g. [0, {num_layers // 2}, "
            f"{num_layers}]; only the first and the last stage may hold no layers",
        )


def cut(model, bounds: Sequence[int]) -> list[Stage]:
    """Stage i holds layers [bounds[i], bounds[i+1]); the stages share the model's modules."""
    arch = arch_of(model.config)
    check_bounds(bounds, arch.num_layers)
    last = len(bounds) - 2
    return [Stage(model, lo, hi, embeddings=i == 0, head=i == last)
            for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]


def run_stages(stages: Sequence[Stage], input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
               position_ids: torch.Tensor, caches: Sequence | None = None) -> torch.Tensor:
    """The stages one after another in this process: what a pipeline does across nodes."""
    x = input_ids
    for i, stage in enumerate(stages):
        x = stage(x, attention_mask, position_ids, caches[i] if caches is not None else None)
    return x


def stage_state_to_hf(stage: Stage) -> dict[str, torch.Tensor]:
    """The stage's state dict under the full model's names; the union over all stages is the model's."""
    return {stage.hf_name(name): value for name, value in stage.state_dict().items()}


def untie_head(stage: Stage) -> Stage:
    """Give a last stage its own copy of a head tied to the embeddings, as a separate process would have.

    Only the stage changes (the model keeps its tie). Training must then add the head's gradient
    to the embedding's and keep the two copies equal.
    """
    if stage.tied_head:
        stage.lm_head = copy.deepcopy(stage.lm_head)
        stage.tied_head = False
    return stage
