"""Cutting a model into bottom / trunk / top keeps the full model's numbers (logits and gradients)."""

from __future__ import annotations

import pytest
import torch

from smolforge.config import PeftSpec
from smolforge.errors import SmolforgeError
from smolforge.models.loading import load_model
from smolforge.split.lora import apply_lora, lora_state, seeded_init
from smolforge.split.local import build, canonical
from smolforge.split.partition import arch_of, check_split_points, fingerprint, partition, positions_for

FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-gpt2"]


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 1000, (3, 12), generator=g)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 8:] = 0  # right padding, as collate makes it
    mask[2, 3:] = 0
    return ids, mask


def split_logits(parts, ids, mask):
    pos = positions_for(mask)
    h = parts.bottom(ids, mask, pos)
    h = parts.trunk(h, mask, pos)
    return parts.top(h, mask, pos)


@pytest.mark.parametrize("name", FAMILIES)
def test_split_forward_equals_full_model(name):
    model = load_model(name).eval()
    ids, mask = batch()
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
        n = model.config.num_hidden_layers
        for sp1, sp2 in [(1, 3), (0, 2), (0, n), (2, n), (n - 1, n)]:
            out = split_logits(partition(model, sp1, sp2), ids, mask)
            assert out.shape == ref.shape
            assert float((out - ref).abs().max()) <= 1e-5, (name, sp1, sp2)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_split_gradients_equal_full_model_with_lora(name):
    """Backprop across the cuts (as the server and client do it) gives peft's full-model gradients."""
    spec = PeftSpec(r=4, alpha=8, dropout=0.0)
    full = build(name, spec, seed=11)
    full.eval()  # GPT-2 dropout off on both sides
    ids, mask = batch(1)
    full(input_ids=ids, attention_mask=mask).logits.float().pow(2).mean().backward()
    want = {canonical(n): p.grad for n, p in full.named_parameters() if p.grad is not None}

    model = load_model(name).eval()
    parts = partition(model, 1, 3)
    for part in (parts.bottom, parts.trunk, parts.top):
        apply_lora(part, spec, 11, parts.arch.canonical)
    pos = positions_for(mask)
    h1 = parts.bottom(ids, mask, pos)
    x = h1.detach().requires_grad_(True)  # the wire: a leaf on the server
    h2 = parts.trunk(x, mask, pos)
    y = h2.detach().requires_grad_(True)  # and a leaf on the client again
    parts.top(y, mask, pos).float().pow(2).mean().backward()
    h2.backward(y.grad)
    h1.backward(x.grad)
    got = {parts.arch.canonical(n): p.grad for part in (parts.bottom, parts.trunk, parts.top)
           for n, p in part.named_parameters() if p.grad is not None}
    assert set(got) == set(want) and got
    for key in want:
        assert torch.allclose(got[key], want[key], rtol=1e-5, atol=1e-8), key


def test_names_map_to_the_full_model():
    model = load_model("tiny-llama")
    parts = partition(model, 1, 3)
    assert parts.arch.canonical("layers.2.self_attn.q_proj.lora_A.default.weight") == \
        "model.layers.2.self_attn.q_proj.lora_A.default.weight"
    gpt2 = arch_of(load_model("tiny-gpt2").config)
    assert gpt2.canonical("layers.0.attn.c_attn") == "transformer.h.0.attn.c_attn"
    assert parts.trunk.layer_ids == [1, 2] and parts.bottom.layer_ids == [0] and parts.top.layer_ids == [3]
    # LoRA goes only where a part has layers: a bottom of embeddings alone trains nothing.
    bottom_only_embed = partition(load_model("tiny-llama"), 0, 2, keep=("bottom",)).bottom
    assert apply_lora(bottom_only_embed, PeftSpec(r=2), 0, parts.arch.canonical) == []


def test_seeded_init_is_placement_independent():
    """A LoRA matrix depends on (seed, full-model name), not on which process builds which part."""
    spec = PeftSpec(r=4, alpha=8, dropout=0.0)
    a = partition(load_model("tiny-llama"), 1, 3, keep=("trunk",))
    apply_lora(a.trunk, spec, 5, a.arch.canonical)
    torch.manual_seed(123)  # the global RNG must not matter
    full = build("tiny-llama", spec, seed=5)
    full_state = {canonical(n): p.detach() for n, p in full.named_parameters() if "lora_" in n}
    trunk_state = lora_state(a.trunk, a.arch.canonical)
    assert trunk_state and all(torch.equal(v, full_state[k]) for k, v in trunk_state.items())
    other = build("tiny-llama", spec, seed=6)
    assert seeded_init(other, 6, canonical) > 0
    key = next(k for k in trunk_state if "lora_A" in k)
    assert not torch.equal(dict((canonical(n), p) for n, p in other.named_parameters())[key], trunk_state[key])


def test_bad_split_points_and_models_are_clear_errors():
    with pytest.raises(SmolforgeError, match="--split-point-1 < --split-point-2"):
        check_split_points(2, 2, 4)
    with pytest.raises(SmolforgeError, match="split points 1, 9"):
        partition(load_model("tiny-llama"), 1, 9)

    class Cfg:
        model_type = "t5"

    with pytest.raises(SmolforgeError, match="does not support model type 't5'"):
        arch_of(Cfg())


def test_fingerprint_tells_checkpoints_apart():
    a, b = load_model("tiny-llama"), load_model("tiny-llama")
    assert fingerprint(a) == fingerprint(b)
    with torch.no_grad():
        b.get_input_embeddings().weight[0].add_(1.0)
    assert fingerprint(a) != fingerprint(b)
    assert fingerprint(a) != fingerprint(load_model("tiny-qwen2"))
