"""Tied embeddings: does an adapter change the matrix a model uses at both ends, and what is untied then.

A model with `tie_word_embeddings` (SmolLM2, the tiny presets, GPT-2) holds one matrix as its input
embedding and as its output head. A LoRA (or IA3) on `lm_head` of such a model is trained by peft as
a change of the head only: the unmerged model's head is base + delta while the input embedding stays
the base matrix. A LoRA on the input embedding is the reverse: peft adds its delta at the lookup, and
the head keeps reading the base matrix. Folding such a delta into the one shared matrix changes both
ends (peft issue 2018; serve answered with other tokens at every position). So every merge unties:
the head gets its own matrix (base + the head's delta), the embedding keeps its own (base + the
embedding's delta, if any), and the written config says `tie_word_embeddings: false` (an HF
directory then holds `lm_head.weight`, a GGUF an explicit `output.weight`).

One answer for every path that merges: `untie_plan` decides from the config and the weight names the
adapters change (the tensor-by-tensor merge of export and the serve stages, `export/merge.py`);
`untie_for_merge` asks it for a peft model in memory and unties it before `merge_and_unload` (serve's
one-process model, `split merge`, export's reference model); `train` says the same line once.
Whether a model ties them is its family's answer (`models/families`, `Family.tied`); which two
tensors are tied is the model class's own (transformers' `_tied_weights_keys`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from torch import nn


@dataclass(frozen=True)
class Untie:
    """The tied pair an adapter changes: both weight names (HF checkpoint names) and which of them changed."""

    embed: str  # the input embedding's weight, e.g. model.embed_tokens.weight
    head: str  # the output head's weight, e.g. lm_head.weight
    changed: tuple[str, ...]  # the names of the pair the adapters change (one or both)

    def message(self) -> str:
        """The one line `train`, serve and export say about it."""
        what = " and ".join(n[: -len(".weight")] for n in self.changed)
        return (f"{self.head} is tied to {self.embed} and the adapter changes {what}: merging unties them "
                "(the head gets its own matrix, tie_word_embeddings: false)")


def _config_object(config: Any) -> Any:
    """A transformers config from a config object or a config.json dict."""
    if not isinstance(config, Mapping):
        return config
    from transformers import AutoConfig

    values = {k: v for k, v in config.items() if k != "model_type"}
    return AutoConfig.for_model(config["model_type"], **values)


def tied_pair(config: Any) -> tuple[str, str] | None:
    """(input embedding weight, output head weight) when `config` ties them, else None.

    `config`: a transformers config or a config.json dict. Whether they are tied is the family's answer
    (`Family.tied`: the config's flag, else the family's default); the names are the model class's own
    (`_tied_weights_keys`, e.g. {"lm_head.weight": "model.embed_tokens.weight"}); None too when the
    class declares no such plain pair."""
    from smolforge.models.families import family_of

    return embedding_pair(config) if family_of(config).tied(config) else None


def embedding_pair(config: Any) -> tuple[str, str] | None:
    """(input embedding weight, output head weight) the model class can tie, whether or not `config`
    ties them; None when the class declares no such plain pair."""
    from transformers import AutoModelForCausalLM

    try:  # a model type transformers does not know (the generic family) has no class to ask
        cls = AutoModelForCausalLM._model_mapping[type(_config_object(config))]
    except (KeyError, ValueError):
        return None
    keys = getattr(cls, "_tied_weights_keys", None)
    if not isinstance(keys, Mapping):
        return None
    plain = [(src, dst) for dst, src in keys.items() if _plain(src) and _plain(dst)]
    return plain[0] if len(plain) == 1 else None


def _plain(name: str) -> bool:
    return name.endswith(".weight") and all(c.isalnum() or c in "._" for c in name)


def untie_plan(config: Any, changed: Iterable[str]) -> Untie | None:
    """The untie a merge must do: None unless `config` ties its embedding and head and `changed` (the
    weight names the adapters change, e.g. "lm_head.weight") holds one of the two."""
    pair = tied_pair(config)
    if pair is None:
        return None
    hits = tuple(name for name in pair if name in set(changed))
    return Untie(embed=pair[0], head=pair[1], changed=hits) if hits else None


def adapted_weights(model: nn.Module) -> set[str]:
    """The weight names (the base model's) whose modules carry a peft tuner layer (LoRA, IA3)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {f"{name}.weight" for name, module in base.named_modules() if isinstance(module, BaseTunerLayer)}


def tied_change(model: nn.Module) -> Untie | None:
    """What a peft model in memory (training or loaded) changes of a tied pair; None when nothing."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return untie_plan(base.config, adapted_weights(model)) if hasattr(base, "config") else None


def untie_for_merge(model: nn.Module) -> Untie | None:
    """Untie a peft model in memory before its adapter is folded in, when the adapter changes a tied module.

    The head gets its own Parameter (a copy of the shared matrix) and the config stops tying, so
    `merge_and_unload` folds the head's delta into the head and the embedding's into the embedding,
    and `save_pretrained` writes both. Returns what was untied (None: nothing to do)."""
    plan = tied_change(model)
    if plan is None:
        return None
    base = model.get_base_model()
    head, embed = base.get_output_embeddings(), base.get_input_embeddings()
    if head is None or embed is None or head.weight is not embed.weight:
        return None
    layer = head.get_base_layer() if hasattr(head, "get_base_layer") else head
    shared = layer.weight
    layer.weight = nn.Parameter(shared.detach().clone(), requires_grad=shared.requires_grad)
    _stop_tying(base)
    return plan


def _stop_tying(model: nn.Module) -> None:
    """The config (and transformers' cached tie map) no longer tie: nothing re-ties the pair later."""
    model.config.tie_word_embeddings = False
    text = getattr(model.config, "get_text_config", lambda: None)()
    if text is not None:
        text.tie_word_embeddings = False
    if isinstance(getattr(model, "all_tied_weights_keys", None), dict):
        model.all_tied_weights_keys = {}
