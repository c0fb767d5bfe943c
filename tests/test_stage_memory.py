"""A pipeline training stage's memory counts its micro-batches' activations (`models.stage_memory`), so the
stage planner keeps every training rank under its node's cap (issue 31). Fast: arithmetic, and one tiny
model's autograd graph."""

from __future__ import annotations

import pytest
import torch

from smolforge.errors import SmolforgeError
from smolforge.models.stage_costs import ModelInfo, NodeCapacity, plan_in_order
from smolforge.models.stage_memory import TrainShape, Workload, layer_elements_per_token, training_workload

MB = 10**6


def info8() -> ModelInfo:
    """8 layers of 100 MB, 50 MB embeddings, 50 MB head (untied)."""
    return ModelInfo(model_type="llama", layer_bytes=(100 * MB,) * 8, layer_flops=(5e7,) * 8, embed_bytes=50 * MB,
                     head_bytes=50 * MB, head_flops=1e7, hidden_size=1024, dtype_bytes=4)


def two_nodes(free: int) -> list[NodeCapacity]:
    return [NodeCapacity(n, 1e10, free, link_bytes_per_s=1e9, link_latency_s=0.0) for n in ("w1", "w2")]


def test_activations_move_a_layer_off_a_stage_that_weights_alone_fit():
    """Weights x 1.2 fit 4 + 4 layers in 670 MB each (540 MB a stage); the last stage's logits (150 MB a
    micro-batch) do not fit beside 4 layers, so a layer moves to the first stage (5 + 3: 660 / 570 MB)."""
    weights_only = plan_in_order(info8(), two_nodes(670 * MB), workload=Workload(training=True))
    assert weights_only.bounds == [0, 4, 8], weights_only.describe()
    work = Workload(training=True, activation_head_bytes=150 * MB, microbatches=4)
    plan = plan_in_order(info8(), two_nodes(670 * MB), workload=work)
    assert plan.bounds == [0, 5, 8], plan.describe()
    assert plan.stage_bytes == [660 * MB, 570 * MB], plan.stage_bytes
    assert "a stage needs weights x 1.2 headroom + activations of up to 4 micro-batches" in plan.describe()


def test_activations_refuse_a_plan_that_weights_alone_fit_and_say_so():
    work = Workload(training=True, activation_layer_bytes=25 * MB, microbatches=4)
    assert plan_in_order(info8(), two_nodes(600 * MB), workload=Workload(training=True)).bounds == [0, 4, 8]
    with pytest.raises(SmolforgeError, match="does not fit in 2 stages") as refused:
        plan_in_order(info8(), two_nodes(600 * MB), workload=work)
    assert "weights x 1.2 headroom + activations of up to 4 micro-batches" in str(refused.value), refused.value


def test_the_schedule_sets_how_many_micro_batches_a_stage_holds():
    """1F1B: stage j of k runs k - j forwards before its first backward; GPipe: every forward first."""
    one_f_one_b = Workload(training=True, activation_layer_bytes=1.0, microbatches=8)
    assert [one_f_one_b.held(j, 4) for j in range(4)] == [4, 3, 2, 1]
    gpipe = Workload(training=True, activation_layer_bytes=1.0, microbatches=8, holds_every_microbatch=True)
    assert [gpipe.held(j, 4) for j in range(4)] == [8] * 4
    assert Workload(activation_layer_bytes=1.0).activation_bytes(4, True) == 0.0  # serving keeps no activations


TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=352, num_attention_heads=4, num_key_value_heads=4)


def llama_config(layers: int):
    from transformers import AutoConfig

    return AutoConfig.for_model("llama", num_hidden_layers=layers, max_position_embeddings=64, **TINY)


def saved_bytes_per_layer(method: str, dropout: float, tokens: int = 16, autocast: bool = False) -> float:
    """What autograd keeps for the backward per decoder layer, counted: a 2-layer and a 4-layer Llama's
    saved tensors (each storage once, parameters left out), the difference over 2 layers."""
    from transformers import AutoModelForCausalLM

    from smolforge.config import PeftSpec
    from smolforge.models.peft_methods import apply_peft

    def saved(layers: int) -> int:
        torch.manual_seed(0)
        model = apply_peft(AutoModelForCausalLM.from_config(llama_config(layers)),
                           PeftSpec(method=method, dropout=dropout)).train()
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(input_ids=torch.randint(0, TINY["vocab_size"], (1, tokens)))
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        return sum(n for ptr, n in seen.items() if ptr not in params)

    return (saved(4) - saved(2)) / 2


@pytest.mark.parametrize("method,dropout", [("lora", 0.05), ("lora", 0.0), ("none", 0.0)])
def test_the_formula_is_what_autograd_keeps_per_layer(method, dropout):
    """Each storage autograd saves, summed, against `layer_elements_per_token` (fp32, 16 tokens)."""
    measured, cfg = saved_bytes_per_layer(method, dropout), llama_config(4)
    shape = TrainShape(rows=1, length=16, microbatches=1, method=method, dropout=dropout)
    estimate = layer_elements_per_token(cfg, shape) * 4 * 16
    assert estimate == pytest.approx(measured, rel=0.05), (estimate, measured)
    work = training_workload(cfg, 4, shape)
    assert work.activation_layer_bytes == estimate and work.training


def test_under_autocast_each_micro_batch_keeps_a_half_precision_copy_of_the_frozen_weights():
    """bf16 autocast on an fp32 LoRA model: per layer, 2 bytes per weight (the cast copy the backward
    multiplies by) plus the activations, which the formula counts at fp32 (an upper bound: most are bf16)."""
    measured, cfg = saved_bytes_per_layer("lora", 0.05, autocast=True), llama_config(4)
    layer_params = 4 * 128 * 128 + 3 * 128 * 352
    shape = TrainShape(rows=1, length=16, microbatches=2, method="lora", dropout=0.05, autocast_bytes=2)
    work = training_workload(cfg, 4, shape, layer_bytes=4 * layer_params)
    assert measured > 2 * layer_params  # the copy is there, whatever the length
    assert measured <= work.activation_layer_bytes <= 1.15 * measured, (work.activation_layer_bytes, measured)
    assert work.layer_bytes(0, 2) == 2 * work.activation_layer_bytes  # a copy per micro-batch in flight
    full = training_workload(cfg, 4, TrainShape(rows=1, length=16, microbatches=2, method="none", autocast_bytes=2),
                             layer_bytes=4 * layer_params)
    assert full.activation_layer_once_bytes == 2 * layer_params  # trained weights: autocast caches one copy a step


def test_autocast_copies_nothing_when_the_weights_are_already_in_its_dtype():
    """A bf16 model under bf16 autocast keeps no cast copies (the full-size bench's TinyLlama in bf16 was
    refused for 2.1 GB of copies that never exist); an fp32 model under bf16 autocast keeps them."""
    import torch
    from smolforge.parallel.strategies.pipeline import _cast_to

    assert _cast_to(torch.bfloat16, torch.bfloat16) is None
    assert _cast_to(None, torch.float32) is None
    assert _cast_to(torch.bfloat16, torch.float32) is torch.bfloat16
