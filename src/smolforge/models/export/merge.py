"""Fold adapters into a base model one tensor at a time: the merge behind every export.

peft's `merge_and_unload` needs the whole model in memory, and a merged directory written with
`save_pretrained` needs a second copy while it serialises (LlamaForge's merge ran out of memory on
exactly that). Here the base's safetensors are read tensor by tensor with `safe_open` and each
adapter's delta is applied to that one tensor, so the peak is one model's worth of adapters (small)
plus the largest single tensor. The writers (`hf.py`, `gguf.py`) consume the stream.

What merges: LoRA (W += B @ A * alpha / r, alpha / sqrt(r) with rsLoRA), (IA)^3 (rows or, for
feed-forward modules, columns of W scaled by the learned vector) and full fine-tuning (its
directory is the new base). Houlsby adapters and prefix/prompt tuning add layers or virtual tokens
that no plain HF (or GGUF) architecture has: they are refused with what to do instead.

An adapter on a tied head or input embedding (LoRA on `lm_head` of a SmolLM2-kind model) merges into
an untied model (`models/tied.py`): `shapes()` and `tensors()` then hold the head as its own tensor
(the shared matrix plus the head's delta), and `config` says `tie_word_embeddings: false`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from smolforge.errors import SmolforgeError
from smolforge.models.peft import PeftMethodClass, peft_method
from smolforge.models.peft_methods import BASE_FILE, BASE_KEYS, adapter_method
from smolforge.models.tied import embedding_pair, untie_plan

if TYPE_CHECKING:
    import torch

PEFT_PREFIX = "base_model.model."
# peft's copy of a targeted embedding/head's base matrix (save_embedding_layers): checked, not merged
BASE_COPY = "base_layer.weight"


@dataclass
class Adapter:
    """One adapter directory, read into memory (adapters are small: their tensors by target weight)."""

    path: Path
    method: str
    config: dict
    kind: PeftMethodClass  # the method's class: how its tensors fold
    # target weight name in the base (e.g. model.layers.0.self_attn.q_proj.weight) -> the tensors it needs
    targets: dict[str, dict[str, "torch.Tensor"]] = field(default_factory=dict)


def _weights_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    files = [f for f in files if f.name != "adapter_model.safetensors"]
    if not files:
        raise SmolforgeError(f"{model_dir} holds no safetensors weights",
                             fix="export a model saved with save_pretrained (safetensors), or re-save it: "
                                 "AutoModelForCausalLM.from_pretrained(d).save_pretrained(d)")
    return files


def read_adapter(path: str | Path, model: str = "BASE") -> Adapter:
    """An adapter directory ready to merge; unmergeable methods are refused here, before any work, with
    the commands that run the adapter on `model` (the base's name as the user gave it)."""
    from safetensors.torch import load_file

    path = Path(path)
    method = adapter_method(path)
    kind = peft_method(method)
    if not kind.merges:
        refused = kind.refusal("export", adapter=str(path), base=model)
        raise SmolforgeError(f"{refused.what} ({path})", fix=refused.fix)
    if kind.full_model:
        return Adapter(path, method, json.loads((path / "config.json").read_text(encoding="utf-8")), kind)
    config = json.loads((path / "adapter_config.json").read_text(encoding="utf-8"))
    for key in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(key):
            raise SmolforgeError(f"{path}: adapters with {key} are not supported by export",
                                 fix="retrain without it (smolforge's own LoRA and IA3 never set it)")
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        raise SmolforgeError(f"{weights} is missing", fix="point --adapter at a complete adapter directory")
    adapter = Adapter(path, method, config, kind)
    for key, tensor in load_file(str(weights)).items():
        if not key.startswith(PEFT_PREFIX):
            raise SmolforgeError(f"{weights}: unexpected tensor {key}", fix="re-save the adapter with peft")
        module, part = _split_key(key[len(PEFT_PREFIX):])
        if part != BASE_COPY:
            adapter.kind.check_tensor(key, part, weights)
        adapter.targets.setdefault(module + ".weight", {})[part] = tensor.float()
    return adapter


def _split_key(name: str) -> tuple[str, str]:
    """An adapter tensor's (module, part): `lm_head.lora_A.weight` -> ("lm_head", "A.weight"),
    `model.layers.0.self_attn.k_proj.ia3_l` -> (..., "ia3_l"), `lm_head.base_layer.weight` ->
    ("lm_head", BASE_COPY): peft saves a targeted embedding or head's base matrix with the adapter."""
    if name.endswith("." + BASE_COPY):
        return name[: -len(BASE_COPY) - 1], BASE_COPY
    module, _, part = name.rpartition(".lora_") if ".lora_" in name else name.rpartition(".")
    return module, part


def check_base(adapter: Adapter, config: dict) -> None:
    """The adapter was trained on a base of this shape (the same check as loading it for inference)."""
    recorded = adapter.path / BASE_FILE
    if not recorded.is_file():
        return
    trained = json.loads(recorded.read_text(encoding="utf-8"))
    diff = [f"{k} {trained.get(k)} vs {config.get(k)}" for k in BASE_KEYS
            if trained.get(k) is not None and config.get(k) is not None and trained[k] != config[k]]
    if diff:
        raise SmolforgeError(f"{adapter.path} was trained on another base model ({trained.get('name_or_path')}): "
                             f"{', '.join(diff)}", fix="pass that base as --model")


def _apply(name: str, tensor: "torch.Tensor", adapter: Adapter, plain: bool = False) -> "torch.Tensor":
    """`tensor` (the base weight or bias `name`) with `adapter` folded in; float32 arithmetic.

    `plain`: the weight is an embedding or output head, never stored fan-in x fan-out (peft keeps
    `fan_in_fan_out` for GPT-2's Conv1D blocks only)."""
    fan_in_fan_out = bool(adapter.config.get("fan_in_fan_out")) and not plain
    if name.endswith(".bias"):
        # (IA)^3 scales the bias of the modules it scales row-wise (peft's merge does the same).
        weight = name[: -len(".bias")] + ".weight"
        return adapter.kind.fold_bias(tensor, adapter.targets.get(weight), weight, adapter.config)
    parts = adapter.targets.get(name)
    if not parts:
        return tensor
    w = tensor.float()
    _check_base_copy(name, w, parts, adapter)
    parts = {k: v for k, v in parts.items() if k != BASE_COPY}
    if not parts:
        return tensor
    w = w.T if fan_in_fan_out else w  # (out, in) from here on
    w = adapter.kind.fold(w, parts, adapter.config)
    w = w.T if fan_in_fan_out else w
    return w.contiguous().to(tensor.dtype)


def _check_base_copy(name: str, w: "torch.Tensor", parts: dict, adapter: Adapter) -> None:
    """The base matrix peft saved with the adapter is the one it is merged into (peft would load its
    copy over the base: a resized vocabulary, or another base, would give other outputs)."""
    import torch

    copy = parts.get(BASE_COPY)
    if copy is not None and (copy.shape != w.shape or not torch.equal(copy, w)):
        raise SmolforgeError(f"{adapter.path} carries its own {name} (peft's saved embedding layer), and it differs "
                             "from the base model's", fix="export with the base model the adapter was trained on "
                             "(--model), the one whose vocabulary it has")


class MergedModel:
    """A base directory plus adapters, seen as one model: its config, tensor shapes and merged tensors.

    Nothing is loaded up front; `tensors()` streams (name, merged tensor) pairs in file order.
    """

    def __init__(self, base_dir: str | Path, adapters: list[str | Path] = (), model: str | None = None):
        read = [read_adapter(a, model or str(base_dir)) for a in adapters]  # model: the name for messages
        full = [a for a in read if a.kind.full_model]
        if len(full) > 1 or (full and not read[0].kind.full_model):
            raise SmolforgeError("a full fine-tune can only be the first --adapter (it replaces the base)",
                                 fix="give the full model first, then the LoRA/IA3 adapters trained on it")
        self.base_dir = Path(full[0].path if full else base_dir)
        self.tokenizer_dir = Path(base_dir) if not (self.base_dir / "tokenizer.json").exists() else self.base_dir
        self.adapters = [a for a in read if not a.kind.full_model]
        self.config = json.loads((self.base_dir / "config.json").read_text(encoding="utf-8"))
        for adapter in self.adapters:
            check_base(adapter, self.config)
        self.files = _weights_files(self.base_dir)
        self._where: dict[str, Path] | None = None
        self._plain = set(embedding_pair(self.config) or ())  # never fan-in x fan-out
        # an adapter on a tied head or embedding: the merged model is untied (models/tied.py)
        self.untie = untie_plan(self.config, {t for a in self.adapters for t in a.targets})
        if self.untie is not None:
            self.config = {**self.config, "tie_word_embeddings": False}
        self._check_targets()

    def _check_targets(self) -> None:
        names = set(self.shapes())
        for adapter in self.adapters:
            missing = sorted(set(adapter.targets) - names)
            if missing:
                raise SmolforgeError(f"{adapter.path} changes {missing[0]}, which the base model {self.base_dir} "
                                     "does not have", fix="pass the base model the adapter was trained on as --model")

    def _stored_shapes(self) -> dict[str, tuple[int, ...]]:
        from safetensors import safe_open

        out: dict[str, tuple[int, ...]] = {}
        for path in self.files:
            with safe_open(str(path), "pt") as f:
                for key in f.keys():
                    out[key] = tuple(f.get_slice(key).get_shape())
        return out

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's name and shape, from the safetensors headers (no data read); an untied head
        that the checkpoint stores only as the embedding comes last, with the embedding's shape."""
        out = self._stored_shapes()
        if self.untie is not None and self.untie.head not in out and self.untie.embed in out:
            out[self.untie.head] = out[self.untie.embed]
        return out

    def dtype(self) -> "torch.dtype":
        from safetensors import safe_open

        with safe_open(str(self.files[0]), "pt") as f:
            return f.get_tensor(next(iter(f.keys()))).dtype

    def _merged(self, key: str, tensor: "torch.Tensor") -> "torch.Tensor":
        for adapter in self.adapters:
            tensor = _apply(key, tensor, adapter, plain=key in self._plain)
        return tensor

    def tensors(self, dtype: "torch.dtype | None" = None) -> Iterator[tuple[str, "torch.Tensor"]]:
        """(name, merged tensor) for every tensor, in file order; `dtype` as `tensor` takes it."""
        for name in self.shapes():
            yield name, self.tensor(name, dtype)

    def tensor(self, name: str, dtype: "torch.dtype | None" = None, count: dict | None = None) -> "torch.Tensor":
        """One merged tensor by name (the GGUF writer's order is not the files' order).

        `dtype`: a floating tensor is returned in it, the stored one cast before the adapters fold in
        (in fp32), so the merge is rounded once, to `dtype` (a bf16 checkpoint served in fp32 keeps its
        adapter's delta whole); None: in the stored dtype. `count` ({"tensors", "elements", "bytes"}),
        when given, adds what was read from the checkpoint (bytes as stored).

        The file is opened for this one tensor: safe_open maps the whole file, and pages read through
        a mapping count as the process's memory until it is closed (a file kept open while every
        tensor is read costs the whole checkpoint's size in RSS)."""
        from safetensors import safe_open

        if self._where is None:
            self._where = {}
            for path in self.files:
                with safe_open(str(path), "pt") as f:
                    self._where.update({key: path for key in f.keys()})
        stored = name
        if self.untie is not None and name == self.untie.head and name not in self._where:
            stored = self.untie.embed  # the untied head starts from the shared matrix, then gets its own delta
        with safe_open(str(self._where[stored]), "pt") as f:
            raw = f.get_tensor(stored)
        if count is not None:
            count.update(tensors=count["tensors"] + 1, elements=count["elements"] + raw.numel(),
                         bytes=count["bytes"] + raw.numel() * raw.element_size())
        if dtype is not None and raw.is_floating_point():
            raw = raw.to(dtype)
        return self._merged(name, raw)
