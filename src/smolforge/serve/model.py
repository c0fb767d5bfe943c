"""The model a server holds: base weights, an optional adapter, the tokenizer, and a batched forward.

Why `forward` takes explicit positions and a cache: a static batch left-pads prompts of different
lengths, and each row must see the positions it would have alone (RoPE) or its greedy tokens
would differ from plain `generate`. A multi-stage server splits exactly this call across stage
actors, each holding its layers and its slice of the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from smolforge.models.families import stop_ids

# Prefix and prompt tuning put virtual tokens in front of the cache: not servable with our positions.


@dataclass
class ServedModel:
    """A causal LM ready to generate: eval mode, no gradients, its context length known."""

    name: str
    model: Any
    tokenizer: Any
    device: torch.device
    max_positions: int
    eos_ids: frozenset[int]

    @classmethod
    def load(cls, model: str, adapter: str | None = None, *, name: str | None = None,
             device: str = "cpu", merge: bool = True, dtype: str = "fp32") -> "ServedModel":
        """Load with the project's loaders, in `dtype` (a --dtype choice). A LoRA/IA3 adapter is merged
        into the weights (one matmul per layer instead of two) unless `merge=False`; a Houlsby adapter
        stays applied."""
        from smolforge.models.loading import load_model, load_tokenizer, pick_device

        dev = pick_device(device)
        if adapter:
            _check_servable(adapter, model=model)  # before the weights load
        tokenizer = load_tokenizer(model)
        net = load_model(model, device=dev, dtype=dtype)
        if adapter:
            net = _with_adapter(net, adapter, merge=merge).to(dev)
        return cls.wrap(net, tokenizer, name=name or model, device=dev)

    @classmethod
    def wrap(cls, net: Any, tokenizer: Any, *, name: str, device: torch.device | str | None = None) -> "ServedModel":
        """An already loaded model (tests, or a trainer handing over its model)."""
        net.eval()
        for p in net.parameters():
            p.requires_grad_(False)
        max_positions = max_positions_of(net.config)
        eos = stop_ids(tokenizer, net)  # every token that ends a generation (the family's one answer)
        dev = torch.device(device) if device is not None else next(net.parameters()).device
        return cls(name=name, model=net, tokenizer=tokenizer, device=dev, max_positions=max_positions,
                   eos_ids=eos)

    @property
    def model_type(self) -> str | None:
        """The config's model type: the family's answers (its tool-call format) for the HTTP side."""
        return getattr(getattr(self.model, "config", None), "model_type", None)

    @property
    def pad_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return int(pad if pad is not None else next(iter(self.eos_ids), 0))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                cache: Any, keep: int = 1) -> torch.Tensor:
        """Logits of the last position of each row, [batch, vocab]; `cache` grows by the new tokens.
        With `keep` > 1, of the last `keep` positions, [batch, keep, vocab] (a prompt's own
        log-probabilities: echo).

        `attention_mask` covers the cache and the new tokens (0 on left padding). Without padding it is
        left out, as `generate` does: transformers then skips checking and slicing it at every step."""
        if bool(attention_mask.all()):
            attention_mask = None
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True, logits_to_keep=keep)
        return out.logits[:, -1, :] if keep == 1 else out.logits[:, -keep:, :]

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def select_rows(self, cache: Any, rows: torch.Tensor, trim: int) -> bool:
        return select_cache_rows(cache, rows, trim)

    @property
    def joins(self) -> bool:
        """True when a running batch can take new rows: every layer's cache is a plain K/V (a sliding
        window's ring of columns cannot be padded on the left); else batches run statically."""
        return plain_layers(self.new_cache())

    def join_caches(self, cache: Any, other: Any, pad: int, other_pad: int) -> Any:
        """`cache`'s rows then `other`'s in one `DynamicCache` (`JoiningModel.join_caches`, `join_cache_rows`)."""
        return join_cache_rows(cache, other, pad, other_pad)

    def snapshot(self, cache: Any, row: int, length: int) -> tuple[Any, int]:
        """Row `row`'s K/V for its last `length` columns, per layer ([1, heads, length, head_dim] each), and
        their bytes (`SnapshotModel.snapshot`, `snapshot_row`)."""
        return snapshot_row(cache, row, length)

    def restore(self, snapshot: Any, length: int) -> Any:
        """A one-row `DynamicCache` with the snapshot's first `length` positions (`restore_rows`)."""
        return restore_rows(self.new_cache(), snapshot, length)

    def release(self, cache: Any) -> None:
        """A local cache goes with its last reference."""

    def stage_infos(self) -> list[dict[str, Any] | None]:
        """No stages: the whole model is in this process (`BatchModel.stage_infos`)."""
        return []


def select_cache_rows(cache: Any, rows: torch.Tensor, trim: int) -> bool:
    """Keep `rows` of a `DynamicCache`; drop its first `trim` columns when every layer is a plain K/V
    layer (a sliding-window layer keeps its own window). True when the columns were dropped.

    A stage's cache fills only its own layers' slots: the empty ones are left alone."""
    cache.batch_select_indices(rows)
    if trim and plain_layers(cache):
        for layer in cache.layers:
            if layer.keys is not None and layer.keys.numel():
                layer.keys, layer.values = layer.keys[:, :, trim:], layer.values[:, :, trim:]
        return True
    return False


def join_cache_rows(cache: Any, other: Any, pad: int, other_pad: int) -> Any:
    """`cache`'s rows then `other`'s, per layer of two `DynamicCache`s: zero K/V columns on the left of the
    narrower side (its mask is 0 there), concatenated on the batch axis. A stage's cache fills only its
    own layers' slots: the empty ones are left alone."""
    import torch.nn.functional as F

    for mine, theirs in zip(cache.layers, other.layers):
        if mine.keys is None or not mine.keys.numel():
            continue
        mine.keys = torch.cat([F.pad(mine.keys, (0, 0, pad, 0)), F.pad(theirs.keys, (0, 0, other_pad, 0))])
        mine.values = torch.cat([F.pad(mine.values, (0, 0, pad, 0)), F.pad(theirs.values, (0, 0, other_pad, 0))])
    return cache


def snapshot_row(cache: Any, row: int, length: int) -> tuple[list[Any], int]:
    """Row `row`'s K/V of a `DynamicCache` for its last `length` columns: per layer a pair of copies
    [1, kv_heads, length, head_dim], or None for a layer slot the cache does not fill (a stage's cache
    fills only its own layers'), and their bytes."""
    kept = [None if layer.keys is None or not layer.keys.numel() else
            (layer.keys[row:row + 1, :, -length:].clone(), layer.values[row:row + 1, :, -length:].clone())
            for layer in cache.layers]
    return kept, sum(k.numel() * k.element_size() * 2 for k, _ in filter(None, kept))


def restore_rows(cache: Any, snapshot: list[Any], length: int) -> Any:
    """`cache` (new, empty) holding a `snapshot_row` snapshot's first `length` positions, in the same layer
    slots. Views: `update` copies on the cache's next growth, so the snapshot is never written."""
    for index, pair in enumerate(snapshot):
        if pair is not None:
            cache.update(pair[0][:, :, :length], pair[1][:, :, :length], index)
    return cache


def plain_layers(cache: Any) -> bool:
    """True when every layer of a `DynamicCache` is a plain `DynamicLayer` (no sliding window)."""
    return all(type(layer).__name__ == "DynamicLayer" for layer in cache.layers)


def max_positions_of(config: Any) -> int:
    return int(getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 2048)


def _check_servable(adapter: str, engine: str = "torch", model: str = "BASE"):
    """The adapter's directory, when `engine` (`peft.ENGINES`) can run its method (the method's class says);
    else the class's refusal, naming the commands that run it on `model` (the base as the user named it)."""
    from smolforge.models.names import check_adapter_dir
    from smolforge.models.peft import accepts, peft_method
    from smolforge.models.peft_methods import adapter_method

    path = check_adapter_dir(adapter)
    kind = peft_method(adapter_method(path))
    if not accepts(kind, f"serve:{engine}"):
        raise kind.refusal(f"serve:{engine}", where=str(path), adapter=str(path), base=model)
    return path


def _with_adapter(net: Any, adapter: str, *, merge: bool, model: str = "BASE", engine: str = "torch") -> Any:
    from smolforge.models.peft_methods import load_adapter, merge_adapter

    path = _check_servable(adapter, engine, model)
    net = load_adapter(net, path)
    return merge_adapter(net, plain=False) if merge else net
