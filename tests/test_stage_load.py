"""A stage loads only its own tensors (issue 31, item 1): built on the meta device, read by key.

The proof is what the loader did, not a memory clock: the whole model is never constructed
(`from_pretrained` is forbidden while stages load), each stage read exactly the tensors it holds,
and the chained stages still compute the full model's logits, bit for bit, on the families whose
flags matter here (tied embeddings and qkv bias: Qwen2.5; llama3 rope scaling: Llama 3.2; learned
positions and Conv1D: GPT-2).
"""

from __future__ import annotations

import pytest
import torch

from smolforge.models.export.merge import MergedModel
from smolforge.models.export.run import model_dir
from smolforge.models.loading import load_model
from smolforge.models.partition import positions_for
from smolforge.models.stage_load import load_stage

MODELS = ["tiny-llama", "tiny-gpt2", "twin:qwen2.5-0.5b-instruct", "twin:llama-3.2-1b-instruct"]


def _checkpoint_elements(model: str) -> dict[str, int]:
    shapes = MergedModel(model_dir(model)).shapes()
    return {name: int(torch.Size(shape).numel()) for name, shape in shapes.items()}


@pytest.mark.parametrize("model", MODELS)
def test_stages_read_only_their_tensors_and_compute_the_full_model(model, monkeypatch):
    full = load_model(model).eval()
    n = full.config.num_hidden_layers
    bounds = [0, 1, n]
    ids = torch.randint(0, 200, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding on one row
    with torch.no_grad():
        expected = full(input_ids=ids, attention_mask=mask).logits
    sizes = _checkpoint_elements(model)

    def refuse(*args, **kwargs):
        raise AssertionError("a stage loaded the whole model")

    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    x, read_total = ids, 0
    for index in range(len(bounds) - 1):
        stage, read = load_stage(model, bounds, index)
        held = sum(p.numel() for p in stage.state_dict().values())  # a tied pair twice, as it is read twice
        assert read["elements"] == held and held < sum(sizes.values()), (index, read, held)
        assert all(not p.is_meta for p in stage.parameters())
        with torch.no_grad():
            x = stage(x, mask, positions_for(mask))
        read_total += read["elements"]
    assert torch.equal(x, expected)
    # every checkpoint tensor was read once, plus the embedding again for a tied head on the last stage
    tied = getattr(full.config, "tie_word_embeddings", False)
    embed = next(v for k, v in sizes.items() if k.endswith(("embed_tokens.weight", "wte.weight")))
    assert read_total == sum(sizes.values()) + (embed if tied else 0)


@pytest.mark.parametrize("model", MODELS)
def test_a_training_rank_fills_only_the_parameters_it_keeps(model, monkeypatch):
    """What a pipeline-training rank does (`Pipeline.load_model`): the whole model as a meta skeleton and
    only the kept parameters read from the checkpoint, the others left with no elements; kept all, it
    is `from_pretrained`'s model, to the bit (rotary buffers rebuilt, a tied pair still one matrix)."""
    from transformers import AutoModelForCausalLM

    from smolforge.models.partition import cut
    from smolforge.models.stage_load import materialize, skeleton

    full = load_model(model).eval()
    ids = torch.randint(0, 200, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # right padding on one row, as training pads
    with torch.no_grad():
        expected = full(input_ids=ids, attention_mask=mask).logits
    sizes = _checkpoint_elements(model)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded whole"))
    net, merged, dtype = skeleton(model)
    read = materialize(net, {id(p) for p in net.parameters()}, merged, "cpu", dtype)
    with torch.no_grad():
        assert torch.equal(net.eval()(input_ids=ids, attention_mask=mask).logits, expected)
    assert read["elements"] == sum(sizes.values()), (read, sum(sizes.values()))
    assert (net.get_output_embeddings().weight is net.get_input_embeddings().weight) == bool(
        getattr(full.config, "tie_word_embeddings", False))
    net, merged, dtype = skeleton(model)
    net.eval()  # no dropout (GPT-2 has some), as from_pretrained returns it
    stage = cut(net, [0, 1, full.config.num_hidden_layers])[1]  # the last stage: layers and the head
    keep = {id(p) for p in stage.parameters()}
    read = materialize(net, keep, merged, "cpu", dtype)
    assert read["elements"] == sum(p.numel() for p in stage.parameters()) < sum(sizes.values()), read
    assert all(p.numel() == 0 for p in net.parameters() if id(p) not in keep)
    with torch.no_grad():  # the kept stage runs on its own, as a pipeline rank runs it
        h = cut(full, [0, 1, full.config.num_hidden_layers])[0](ids, mask, positions_for(mask))
        assert torch.equal(stage(h, mask, positions_for(mask)), expected)


def test_the_serving_plan_sizes_stages_in_the_dtype_they_load():
    """The placement probe sizes a stage in the dtype `--dtype` loads it in, not the checkpoint's (the
    Qwen twin is stored in bf16: planning it as bf16 while the stages load fp32 halved every stage)."""
    from smolforge.cluster.workloads.serve.stages import probe_node

    def sized(model: str, dtype: str) -> dict:
        return probe_node(model, "here", 1, "cpu", True, dtype)["model"]

    for model in ("tiny-llama", "twin:qwen2.5-0.5b-instruct"):
        fp32, bf16 = sized(model, "fp32"), sized(model, "bf16")
        assert (fp32["dtype_bytes"], bf16["dtype_bytes"]) == (4, 2), model
        assert list(fp32["layer_bytes"]) == [2 * b for b in bf16["layer_bytes"]], model
