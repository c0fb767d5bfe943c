"""Cut a decoder-only model into bottom, trunk and top: the three stages split learning uses.

    bottom = embeddings (+ learned positions for GPT-2) + layers [0, sp1)
    trunk  = layers [sp1, sp2)
    top    = layers [sp2, n) + final norm + LM head   (the loss is computed next to it, on the client)

The parts are `smolforge.models.partition.Stage`s (see there for how a stage keeps the unsplit
model's numerics); this module adds the split vocabulary, the split-point check with its CLI
flags, and the model-loading helpers the client and server share.

Each side loads only its parts (`load_parts`): the model is built on the meta device, cut, and only
the kept parts' tensors are read from the checkpoint (`models/stage_load.py`); the client's peak
memory is its bottom and top, the server's its trunk, never the whole model.

Layers keep their original index as their name (`layers.5...`), so LoRA weights trained in a
part map one-to-one onto the full model's module names (`model.layers.5...`, `transformer.h.5...`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from smolforge.errors import SmolforgeError
from smolforge.models.loading import load_model, load_tokenizer
from smolforge.models.partition import (Arch, Stage, arch_of, decoder_layers, fingerprint,
                                        positions_for)

__all__ = ["Arch", "Bottom", "Parts", "Top", "Trunk", "arch_of", "check_split_points", "fingerprint",
           "load_full_model", "load_parts", "load_tokenizer_locked", "partition", "positions_for"]

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


class Bottom(Stage):
    """Token (and, for GPT-2, position) embeddings, then layers [0, sp1)."""

    def __init__(self, model, sp1: int):
        super().__init__(model, 0, sp1, embeddings=True, head=False)


class Trunk(Stage):
    """Layers [sp1, sp2): the part the server runs."""

    def __init__(self, model, sp1: int, sp2: int):
        super().__init__(model, sp1, sp2, embeddings=False, head=False)


class Top(Stage):
    """Layers [sp2, n), the final norm and the LM head; returns logits (the loss stays with the labels)."""

    def __init__(self, model, sp2: int):
        super().__init__(model, sp2, len(decoder_layers(model)), embeddings=False, head=True)


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


@dataclass
class LoadedParts:
    """What `load_parts` gives: the parts, the whole model's fingerprint and parameter count, its
    generation config (its eos ids), and what was read from the checkpoint ({"tensors", "elements",
    "bytes"}, bytes as stored: only the parts' tensors)."""

    parts: Parts
    fingerprint: str
    total_params: int
    generation_config: Any = None
    read: dict[str, int] = field(default_factory=dict)


def load_parts(name: str, sp1: int, sp2: int, keep: tuple[str, ...], device="cpu") -> LoadedParts:
    """The parts in `keep` of model `name` cut at sp1/sp2, in fp32 on `device` (as `load_full_model`
    loads it), holding only their own tensors.

    The whole model is a skeleton on the meta device (`stage_load.skeleton`); the parts are cut from
    it and only their parameters are read from the safetensors (`stage_load.materialize`: a tied
    head stays the embedding's one matrix, as the model built it; rotary buffers are rebuilt). The
    fingerprint is the whole model's, its embedding rows read from the checkpoint
    (`stage_load.checkpoint_fingerprint`), so a trunk that never loads the embeddings computes the
    client's. Errors: a model that is not found or whose family cannot be cut (SmolforgeError), split
    points out of range (`check_split_points`)."""
    from smolforge.models.stage_load import checkpoint_fingerprint, materialize, skeleton

    with _LOAD_LOCK:  # the meta-device build, as `from_pretrained`, is not for two threads at once
        net, merged, dtype = skeleton(name, device=device, dtype="fp32")
        net.eval()  # as from_pretrained returns it (each side sets its parts' mode)
        total = sum(p.numel() for p in net.parameters())  # the whole model's, before the rest is emptied
        parts = partition(net, sp1, sp2, keep)
        held = {id(p) for part in (parts.bottom, parts.trunk, parts.top) if part is not None
                for p in part.parameters()}
        read = materialize(net, held, merged, device, dtype)
        loaded = LoadedParts(parts, checkpoint_fingerprint(net, merged, dtype), total, net.generation_config, read)
    del net  # the parameters no part holds never had storage
    return loaded

