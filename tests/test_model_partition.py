"""Cutting a model into N stages keeps its numbers (logits, gradients, cached greedy decoding, state dict),
and placement sizes the stages from throughput and memory, keeping the model whole when a split does not pay."""

from __future__ import annotations

import pytest
import torch

from smolforge.errors import SmolforgeError
from smolforge.models.partition import cut, generation_positions, positions_for, run_stages, stage_state_to_hf, untie_head
from smolforge.cluster.control.stage_plan import plan_serving, plan_stages
from smolforge.models.stage_costs import (ModelInfo, NodeCapacity, Workload, measure_node, model_info,
                                          plan_in_order)

FAMILIES = ["llama", "qwen2", "gpt2"]
BOUNDS = [[0, 2, 4], [0, 1, 3, 4], [0, 0, 4, 4]]  # 2 stages, 3 stages, embeddings and head alone


def tiny(family: str, seed: int = 0):
    """A 4-layer fp32 model built from config (no download); Llama and GPT-2 tie the head, Qwen2 does not."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

    common = dict(vocab_size=128, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    rope = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1, **common)
    config = {
        "llama": lambda: LlamaConfig(tie_word_embeddings=True, **rope),
        "qwen2": lambda: Qwen2Config(tie_word_embeddings=False, **rope),
        "gpt2": lambda: GPT2Config(n_embd=32, n_layer=4, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                   attn_pdrop=0.0, initializer_range=0.1, **common),
    }[family]()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model.float().eval()


def right_padded(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (3, 10), generator=g)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, 7:] = 0
    mask[2, 3:] = 0
    return ids, mask


def loss_of(logits, ids, mask):
    """Next-token cross-entropy over real tokens: what training backpropagates."""
    target = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), target.reshape(-1))


def pipeline_backward(stages, ids, mask):
    """Forward stage by stage with the activations cut loose between stages (as across processes), then back."""
    pos = positions_for(mask)
    outs, ins = [], []
    x = ids
    for stage in stages:
        if outs:
            x = outs[-1].detach().requires_grad_(True)
            ins.append(x)
        outs.append(stage(x, mask, pos))
    logits = outs[-1]
    loss_of(logits, ids, mask).backward()
    for out, leaf in zip(reversed(outs[:-1]), reversed(ins)):
        out.backward(leaf.grad)
    return logits.detach()


def full_grads(model, ids, mask) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logits = model(input_ids=ids, attention_mask=mask).logits
    loss_of(logits, ids, mask).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


@pytest.mark.parametrize("family", FAMILIES)
def test_chained_stages_give_the_full_models_logits_and_gradients(family):
    model = tiny(family)
    ids, mask = right_padded()
    ref, want = full_grads(model, ids, mask)
    for bounds in BOUNDS:
        stages = cut(model, bounds)
        assert len(stages) == len(bounds) - 1
        logits = pipeline_backward(stages, ids, mask)
        assert float((logits - ref).abs().max()) <= 1e-5, (family, bounds)
        got = {s.hf_name(n): p.grad for s in stages for n, p in s.named_parameters()}
        assert set(got) <= set(want) and len(got) >= len(dict(model.named_parameters()))
        for name, grad in got.items():
            assert torch.allclose(grad, want[name], rtol=1e-4, atol=1e-6), (family, bounds, name)
        model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_an_untied_head_copy_needs_its_gradient_added_to_the_embeddings(family):
    """Stages in separate processes each hold the tied matrix: head grad + embedding grad = the HF grad."""
    model = tiny(family)
    ids, mask = right_padded(1)
    ref, want = full_grads(model, ids, mask)
    first, middle, last = cut(model, [0, 1, 3, 4])
    assert last.tied_head
    untie_head(last)
    assert not last.tied_head and last.lm_head.weight is not first.embed.weight
    logits = pipeline_backward([first, middle, last], ids, mask)
    assert float((logits - ref).abs().max()) <= 1e-5
    embed = first.hf_name("embed.weight")
    assert not torch.allclose(first.embed.weight.grad, want[embed], atol=1e-6)  # each copy sees only its part
    assert torch.allclose(first.embed.weight.grad + last.lm_head.weight.grad, want[embed], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decoding_with_a_cache_per_stage_matches_generate(family):
    model = tiny(family, seed=3)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, 128, (2, 6), generator=g)
    mask = torch.ones(2, 6, dtype=torch.long)
    ids[1, :2], mask[1, :2] = 0, 0  # left padding: prompts of 6 and 4 tokens
    new = 8
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                              pad_token_id=0)[:, ids.shape[1]:]
        for bounds in ([0, 2, 4], [0, 1, 3, 4]):
            stages = cut(model, bounds)
            caches = [stage.new_cache() for stage in stages]
            step_mask, pos, x, out = mask, generation_positions(mask), ids, []
            for _ in range(new):
                nxt = run_stages(stages, x, step_mask, pos, caches)[:, -1].argmax(-1, keepdim=True)
                out.append(nxt)
                step_mask = torch.cat([step_mask, torch.ones_like(nxt)], dim=1)
                pos, x = pos[:, -1:] + 1, nxt
            assert torch.equal(torch.cat(out, dim=1), want), (family, bounds)
            assert caches[-1].get_seq_length(bounds[-2]) == ids.shape[1] + new - 1


@pytest.mark.parametrize("family", FAMILIES)
def test_stage_states_assemble_into_the_hf_state_dict(family):
    model = tiny(family)
    want = model.state_dict()
    for bounds in BOUNDS:
        stages = cut(model, bounds)
        union: dict[str, torch.Tensor] = {}
        for stage in stages:
            for name, value in stage_state_to_hf(stage).items():
                assert name not in union or torch.equal(union[name], value), name
                union[name] = value
        assert set(union) == set(want), (family, bounds)
        assert all(torch.equal(union[k], want[k]) for k in want)
        # Stages hold the model's tensors, not copies.
        assert stages[0].embed.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    last = untie_head(cut(model, [0, 2, 4])[-1])
    assert torch.equal(stage_state_to_hf(last)["lm_head.weight"], want["lm_head.weight"])


def test_bad_bounds_are_clear_errors():
    model = tiny("llama")
    for bounds in ([0, 2, 2, 4], [0, 5], [1, 4], [0, 3, 2, 4], [0], [0, 2.0, 4]):
        with pytest.raises(SmolforgeError, match="do not cut a 4-layer model") as err:
            cut(model, bounds)
        assert "only the first and the last stage may hold no layers" in err.value.fix
    assert [s.layer_ids for s in cut(model, [0, 0, 4])] == [[], [0, 1, 2, 3]]
    assert [s.layer_ids for s in cut(model, [0, 4])] == [[0, 1, 2, 3]]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_model_info_counts_the_models_bytes(family):
    model = tiny(family)
    info = model_info(model)
    distinct = sum(p.numel() * 4 for p in model.parameters())  # parameters() counts a tied matrix once
    assert info.total_bytes == distinct and info.num_layers == 4
    assert info.tied_bytes == 128 * 32 * 4  # the head is the embedding matrix
    assert model_info(model.config) == info  # from the config alone (meta device), same numbers
    assert model_info(model.config, dtype=torch.bfloat16).total_bytes == distinct // 2
    kv_heads = 2 if family == "llama" else 4
    assert info.kv_bytes_per_token == 2 * kv_heads * 8 * 4
    # A plan's bounds cut the model, and its memory per stage is what the stage holds (x headroom).
    plan = plan_stages(info, [NodeCapacity("a", 1e9, 10**9), NodeCapacity("b", 1e9, info.total_bytes)], stages=2)
    for stage, need in zip(cut(model, plan.bounds), plan.stage_bytes):
        assert sum(p.numel() * 4 for p in stage.parameters()) * 1.2 == pytest.approx(need, abs=1)


# ------------------------------------------------------------------------------------------ placement

GB = 10**9
FAST_LINK = dict(link_bytes_per_s=1.25e9, link_latency_s=0.0)  # 10 Gbit/s


def info24() -> ModelInfo:
    """24 layers of 100 MB (25M fp32 params, 5e7 FLOPs per token), 50 MB embeddings, 50 MB head: 2.5 GB."""
    return ModelInfo(model_type="llama", layer_bytes=(100_000_000,) * 24, layer_flops=(5e7,) * 24,
                     embed_bytes=50_000_000, head_bytes=50_000_000, head_flops=1e7, hidden_size=1024,
                     dtype_bytes=4, kv_bytes_per_token=16_384)


def layers_on(plan, node: str) -> int:
    i = plan.nodes.index(node)
    return plan.bounds[i + 1] - plan.bounds[i]


def test_layers_follow_throughput():
    nodes = [NodeCapacity("slow", 1e10, 100 * GB, **FAST_LINK), NodeCapacity("fast", 2e10, 100 * GB, **FAST_LINK)]
    plan = plan_stages(info24(), nodes, stages=2)
    assert sorted(plan.nodes) == ["fast", "slow"] and plan.bounds[0] == 0 and plan.bounds[-1] == 24
    assert 1.6 <= layers_on(plan, "fast") / layers_on(plan, "slow") <= 2.5, plan.describe()
    assert plan.throughput_share[plan.nodes.index("fast")] == pytest.approx(2 / 3)
    # Three nodes at 4:2:1 share 24 layers about 4:2:1.
    three = [NodeCapacity("x4", 4e10, 100 * GB, **FAST_LINK), NodeCapacity("x2", 2e10, 100 * GB, **FAST_LINK),
             NodeCapacity("x1", 1e10, 100 * GB, **FAST_LINK)]
    plan = plan_stages(info24(), three, stages=3)
    counts = [layers_on(plan, n) for n in ("x4", "x2", "x1")]
    assert counts[0] > counts[1] > counts[2] >= 2, plan.describe()
    assert max(plan.stage_seconds) <= 1.35 * min(plan.stage_seconds)


def test_stages_already_placed_keep_their_order_and_get_layers_by_throughput():
    """A data-parallel group's ranks are placed before the cut: stage i runs on rank i's node, and only
    the ranges are chosen (the slow node first here: it still gets the fewer layers)."""
    nodes = [NodeCapacity("slow", 1e10, 100 * GB, **FAST_LINK), NodeCapacity("fast", 2e10, 100 * GB, **FAST_LINK)]
    plan = plan_in_order(info24(), nodes, workload=Workload(training=True))
    assert plan.nodes == ["slow", "fast"] and plan.bounds[0] == 0 and plan.bounds[-1] == 24
    assert 1.5 <= layers_on(plan, "fast") / layers_on(plan, "slow") <= 2.5, plan.describe()
    assert "as placed" in plan.describe()
    with pytest.raises(SmolforgeError, match="does not fit in 2 stages"):
        plan_in_order(info24(), [NodeCapacity("a", 1e10, 10**6), NodeCapacity("b", 1e10, 10**6)])


def test_a_node_measures_its_own_flops_and_free_memory():
    node = measure_node("here", seconds=0.05)
    assert node.name == "here" and node.throughput > 1e8 and node.free_memory_bytes > 10**8, node


def test_memory_caps_a_fast_nodes_share():
    nodes = [NodeCapacity("fast", 2e10, 800_000_000, **FAST_LINK), NodeCapacity("roomy", 1e10, 100 * GB, **FAST_LINK)]
    plan = plan_stages(info24(), nodes, stages=2)
    assert all(need <= free for need, free in zip(plan.stage_bytes, plan.free_bytes))
    assert 1 <= layers_on(plan, "fast") <= 6  # throughput alone would give it 16
    assert layers_on(plan, "roomy") >= 18


def test_keeps_the_model_on_one_node_when_the_link_is_slow():
    slow_link = [NodeCapacity("w1", 5e10, 8 * GB, link_bytes_per_s=125_000), NodeCapacity("w2", 5e10, 8 * GB)]
    plan = plan_stages(info24(), slow_link)
    assert plan.num_stages == 1 and plan.nodes == ["w1"] and plan.bounds == [0, 24] and plan.kept_on_one_node
    assert plan.reason.startswith("kept on w1: it fits (3.0 GB of 8.0 GB free) and splitting would be slower "
                                  "(est. 24.2 ms/token vs "), plan.reason
    assert "ms/token with 2 stages over 1 Mbit/s)" in plan.reason
    # A measured link between the two beats what w1's own link suggests.
    assert plan_stages(info24(), slow_link, links={("w2", "w1"): 1.25e9}).num_stages == 2
    text = plan.describe()
    assert "stage 0: layers 0-23 + embeddings + head on w1" in text and plan.reason in text
    # The same two nodes on a fast link: a full pipeline halves the time, so it splits evenly.
    fast = [NodeCapacity("w1", 5e10, 8 * GB, **FAST_LINK), NodeCapacity("w2", 5e10, 8 * GB, **FAST_LINK)]
    plan = plan_stages(info24(), fast)
    assert plan.num_stages == 2 and not plan.kept_on_one_node and plan.reason.startswith("split into 2 stages")
    assert abs(layers_on(plan, "w1") - layers_on(plan, "w2")) <= 1
    assert plan.per_token_s == pytest.approx(0.0122, rel=0.05)
    # One sequence at a time walks through both stages in turn: no faster, so it stays whole.
    alone = plan_stages(info24(), fast, workload=Workload(in_flight=1))
    assert alone.num_stages == 1 and alone.per_token_s == pytest.approx(0.0242)


def test_keeps_the_fastest_node_that_fits():
    nodes = [NodeCapacity("big-slow", 1e10, 64 * GB), NodeCapacity("fast-small", 5e10, 1 * GB),
             NodeCapacity("mid", 2e10, 8 * GB, link_bytes_per_s=50_000)]
    plan = plan_stages(info24(), nodes)
    # fast-small cannot hold it; mid is the fastest that can, and a split costs more than it saves.
    assert plan.nodes == ["mid"] and plan.kept_on_one_node, plan.describe()
    assert plan.per_token_s == pytest.approx(0.0605)
    # The best two stages, when asked for: slower, as the reason said.
    two = plan_stages(info24(), nodes, stages=2)
    assert two.num_stages == 2 and two.per_token_s > plan.per_token_s
    assert all(need <= free for need, free in zip(two.stage_bytes, two.free_bytes))


def test_uses_two_stages_when_no_node_holds_it():
    nodes = [NodeCapacity("a", 2e10, 2 * GB), NodeCapacity("b", 1e10, 2 * GB), NodeCapacity("c", 1e10, 2 * GB)]
    plan = plan_stages(info24(), nodes)
    assert plan.num_stages == 2 and "a" in plan.nodes, plan.describe()
    assert all(need <= free for need, free in zip(plan.stage_bytes, plan.free_bytes))
    assert "no node holds it alone (it needs 3.0 GB; the most free is 2.0 GB on a): 2 stages is the fewest" \
        in plan.reason
    text = plan.describe()
    assert "+ embeddings on" in text and "+ head on" in text and "Mbit/s to stage 1" in text


def test_nothing_fits_says_how_much_is_missing():
    nodes = [NodeCapacity("a", 2e10, 1 * GB), NodeCapacity("b", 1e10, 1 * GB)]
    with pytest.raises(SmolforgeError, match=r"needs 3\.0 GB .*the nodes have 2\.0 GB free: 1\.0 GB missing") as err:
        plan_stages(info24(), nodes)
    assert "bf16" in err.value.fix and "worker join" in err.value.fix
    # Enough memory in all, but the embeddings piece fits nowhere.
    big_embed = ModelInfo(model_type="llama", layer_bytes=(10_000_000,) * 4, layer_flops=(1e6,) * 4,
                          embed_bytes=3 * GB, head_bytes=1_000_000, head_flops=1e5, hidden_size=64, dtype_bytes=4)
    with pytest.raises(SmolforgeError, match="the embeddings alone need 3.6 GB, the most free on one node is "
                                             "2.0 GB: 1.6 GB missing there"):
        plan_stages(big_embed, [NodeCapacity(n, 1e10, 2 * GB) for n in "abc"])
    # Enough in all (6 GB for 4.8 GB) and every piece fits somewhere, but each node holds one layer of four.
    lumpy = ModelInfo(model_type="llama", layer_bytes=(GB,) * 4, layer_flops=(1e6,) * 4, embed_bytes=1_000_000,
                      head_bytes=1_000_000, head_flops=1e5, hidden_size=64, dtype_bytes=4)
    with pytest.raises(SmolforgeError, match="whole layers do not pack"):
        plan_stages(lumpy, [NodeCapacity(n, 1e10, 2 * GB) for n in "abc"])
    with pytest.raises(SmolforgeError, match="cannot place 3 stages on 2 node"):
        plan_stages(info24(), nodes, stages=3)


def test_serving_reserves_the_kv_cache():
    nodes = [NodeCapacity("w1", 2e10, 4 * GB), NodeCapacity("w2", 1e10, 4 * GB)]
    one_user = Workload(in_flight=1)
    assert plan_stages(info24(), nodes, workload=one_user).num_stages == 1  # 3.0 GB fits on w1
    serving = Workload(in_flight=1, kv_tokens=4096)  # 4096 tokens x 16 KB x 24 layers = 1.6 GB of cache
    plan = plan_stages(info24(), nodes, workload=serving)
    assert plan.num_stages == 2 and all(n <= f for n, f in zip(plan.stage_bytes, plan.free_bytes))


def test_serving_auto_keeps_one_node_and_asked_stages_say_it_would_be_faster():
    """`serve --stages auto` plans for one stream (a batch walks the stages in turn): two equal nodes
    on a fast link still keep the model whole. Asked for 2 stages, it splits by throughput and the
    reason says one node would be faster."""
    fast = [NodeCapacity("w1", 5e10, 8 * GB, **FAST_LINK), NodeCapacity("w2", 5e10, 8 * GB, **FAST_LINK)]
    auto, hosts = plan_serving(info24(), fast)
    assert auto.kept_on_one_node and auto.num_stages == 1 and hosts == auto.nodes and len(hosts) == 1
    assert "splitting would be slower" in auto.reason
    two, hosts = plan_serving(info24(), fast, stages=2)
    assert two.num_stages == 2 and sorted(hosts) == ["w1", "w2"] and abs(layers_on(two, "w1") - 12) <= 1
    assert "note: kept on w1" in two.reason and "--stages auto keeps it there" in two.reason
    # A model no node holds alone: auto splits it, and the split is the plan asked for as well.
    small = [NodeCapacity("a", 5e10, 2 * GB, **FAST_LINK), NodeCapacity("b", 5e10, 2 * GB, **FAST_LINK)]
    auto, _ = plan_serving(info24(), small)
    assert auto.num_stages == 2 and not auto.kept_on_one_node and "no node holds it alone" in auto.reason
    assert "note:" not in plan_serving(info24(), small, stages=2)[0].reason


def test_serving_more_stages_than_nodes_share_them_in_turn():
    one = [NodeCapacity("laptop", 5e10, 12 * GB)]
    plan, hosts = plan_serving(info24(), one, stages=3)
    assert hosts == ["laptop"] * 3 and plan.nodes == ["laptop#1", "laptop#2", "laptop#3"]
    assert plan.bounds[0] == 0 and plan.bounds[-1] == 24 and plan.bounds == sorted(plan.bounds)
    assert all(free == 4 * GB for free in plan.free_bytes) and "stages share nodes" in plan.reason
    two = [NodeCapacity("a", 5e10, 12 * GB), NodeCapacity("b", 5e10, 12 * GB)]
    assert plan_serving(info24(), two, stages=3)[1] == ["a", "b", "a"]
    with pytest.raises(SmolforgeError, match="does not fit"):  # three slots of 1 GB cannot hold 2.5 GB
        plan_serving(info24(), [NodeCapacity("tiny", 5e10, 3 * GB)], stages=3)


def test_stages_asked_for_each_hold_a_layer():
    """Two stages asked for on a fast roomy node and a slow one: the full-pipeline optimum would leave
    the slow node only the embeddings (it was once planned so, a stage with layers [0, 0] on a cluster's
    coordinator); asked for by number, each stage computes. Where nothing else fits, an end stage may
    still hold only the embeddings."""
    nodes = [NodeCapacity("fast", 1e12, 100 * GB, **FAST_LINK), NodeCapacity("slow", 1e9, 100 * GB, **FAST_LINK)]
    plan = plan_stages(info24(), nodes, stages=2)
    assert all(hi > lo for lo, hi in zip(plan.bounds, plan.bounds[1:])), plan.describe()
    assert layers_on(plan, "slow") == 1 and layers_on(plan, "fast") == 23, plan.describe()
    # "tiny" can hold the 50 MB embeddings but no 100 MB layer: the only plan leaves it none
    tight = [NodeCapacity("tiny", 1e10, 70_000_000, **FAST_LINK), NodeCapacity("big", 1e10, 100 * GB, **FAST_LINK)]
    plan = plan_stages(info24(), tight, stages=2)
    assert layers_on(plan, "tiny") == 0 and layers_on(plan, "big") == 24, plan.describe()
