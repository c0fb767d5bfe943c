"""The `pipeline` strategy without a cluster: spawned gloo ranks, one stage each, against one process.

Pipeline training with batch_size B and grad_accum A on N stages takes N x A micro-batches of B rows a
step, which is one process's step with batch_size B and grad_accum N x A: the weights must be that
process's (fp32, dropout 0). Checked on 2 stages (LoRA with GPipe, paused and resumed; full fine-tuning
with 1F1B, tied embeddings trained) and on 3 (LoRA with 1F1B, explicit bounds, two rows a micro-batch;
then a first stage that only embeds, with the step's rows regrouped into fewer, larger micro-batches),
with evaluation and generation in the middle of the runs (through the stages). The results are ordinary
HF/PEFT directories, and a pipeline checkpoint resumes in one process. No rank loads the whole model
(`_rank` forbids `from_pretrained`): each reads its stage's tensors and, at every forward of a run, holds
its stage's parameters only.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import queue as queues
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import tiny_train_cfg
from smolforge.models.tiny import preset_dir

pytestmark = [pytest.mark.timeout(300),  # peft reads transformers' deprecated name when it loads an adapter
              pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")]

STEPS = 6


def _cfg(root: Path, out: str, **kw) -> dict:
    return tiny_train_cfg(root, out, STEPS, **kw)


FULL = dict(peft={"method": "none"}, max_steps=3, eval_every=0, eval_accuracy=False)
THREE = dict(batch_size=2, grad_accum=1, max_steps=4, eval_every=2)  # a micro-batch of two rows per stage
# the step's 12 rows regrouped into 3 micro-batches of 4; the first stage only embeds (nothing to train there)
REGROUPED = dict(batch_size=2, grad_accum=2, max_steps=3, eval_every=0, eval_accuracy=False)


def _train(cfg: dict, strategy=None, stop_after: int = 0):
    """engine.train; with `stop_after`, rank 0 asks for a pause once that step is done."""
    from smolforge.config import TrainConfig
    from smolforge.train.engine import TrainHooks, train

    norms: list[float] = []

    def should_stop():
        return "pause" if stop_after and len(norms) >= stop_after else None

    hooks = TrainHooks(on_step=lambda info: norms.append(info.grad_norm), should_stop=should_stop)
    return train(TrainConfig.model_validate(cfg), hooks, strategy=strategy), norms


def _two(rank: int, root: Path, out: mp.Queue) -> None:
    """Two stages: LoRA with GPipe whole, and paused at step 3 and resumed; full fine-tuning with 1F1B."""
    import torch.distributed as dist

    from smolforge.parallel.strategies import make_strategy

    gpipe = {"schedule": "gpipe"}
    planned = make_strategy("pipeline", gpipe)  # no bounds: each rank measures its node, the plan sizes the stages
    with _stored_at_every_forward(planned) as stored:  # training, evaluation and its greedy decoding
        whole, norms = _train(_cfg(root, "pp-lora"), planned)
    plan = [n for n in planned.notes if n.get("event") == "pipeline_plan"]
    paused, _ = _train(_cfg(root, "pp-paused"), make_strategy("pipeline", gpipe), stop_after=3)
    if rank == 0:  # the paused run's checkpoint, for one process to resume
        shutil.copytree(root / "pp-paused", root / "pp-paused-single")
    dist.barrier()
    resumed, _ = _train({**_cfg(root, "pp-paused"), "resume": True}, make_strategy("pipeline", gpipe))
    # bounds given: the memory check below needs the layers split (a measured plan may give a tiny
    # model's layers all to one stage: its cost model counts the hidden states' trip over the cut)
    full_strategy = make_strategy("pipeline", {"schedule": "1f1b", "bounds": [0, 2, 4]})
    full, full_norms = _train(_cfg(root, "pp-full", **FULL), full_strategy)
    out.put((rank, {"whole": whole.to_dict(), "norms": norms, "paused": paused.to_dict(), "plan": plan,
                    "resumed": resumed.to_dict(), "full": full.to_dict(), "full_norms": full_norms,
                    "held": _held(full_strategy), "stored": sorted(stored), "planned": _held(planned),
                    "greedy": _greedy(full_strategy).tolist()}))


PROMPTS = torch.tensor([[3, 3, 5, 17, 42], [9, 8, 7, 6, 5]])  # left-padded (3 is the pad), as generate takes them


def _greedy(strategy) -> torch.Tensor:
    """The stages' greedy tokens for PROMPTS (every rank gets them), with the weights training ended on."""
    from smolforge.parallel.strategies.pipeline_eval import StageEval

    runner = StageEval(strategy.runner.stage, strategy.rank, strategy.world, torch.device("cpu"),
                       strategy.hidden_size, strategy.hidden_dtype)
    with torch.no_grad():
        return runner.greedy(PROMPTS, (PROMPTS != 3).long(), 8, stops={2}, pad_id=3)


@contextmanager
def _stored_at_every_forward(strategy):
    """The distinct sets of parameter names with storage on this rank, seen each time a stage runs."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    from smolforge.models.partition import Stage

    seen: set[tuple[str, ...]] = set()

    def look(module, args):
        if isinstance(module, Stage) and strategy.layout is not None:
            seen.add(tuple(sorted(n for n, p in zip(strategy.layout.names, strategy.layout.params) if p.numel())))

    handle = register_module_forward_pre_hook(look)
    try:
        yield seen
    finally:
        handle.remove()


def _held(strategy) -> dict[str, list[str]]:
    """The parameters with storage on this rank, and those its stage uses (a tied matrix: both end stages)."""
    lay = strategy.layout
    return {"stored": sorted(n for n, p in zip(lay.names, lay.params) if p.numel()),
            "stage": sorted(n for i, n in enumerate(lay.names) if strategy.rank in lay.owners[i])}


def _three(rank: int, root: Path, out: mp.Queue) -> None:
    """Three stages, LoRA, 1F1B, the layers cut where the test says; then regrouped micro-batches."""
    from smolforge.parallel.strategies import make_strategy

    result, norms = _train(_cfg(root, "pp3", **THREE), make_strategy("pipeline", {"bounds": [0, 1, 3, 4]}))
    regrouped, _ = _train(_cfg(root, "pp3-regrouped", **REGROUPED),
                          make_strategy("pipeline", {"bounds": [0, 0, 3, 4], "microbatches": 3}))
    out.put((rank, {"result": result.to_dict(), "norms": norms, "regrouped": regrouped.to_dict()}))


def _rank(job, rank: int, world: int, port: int, root: str, out: mp.Queue) -> None:
    from smolforge.parallel.rendezvous import init_group, leave_group

    from transformers import AutoModelForCausalLM

    def whole_model(*args, **kwargs):
        raise AssertionError("a pipeline rank loaded the whole model (AutoModelForCausalLM.from_pretrained)")

    AutoModelForCausalLM.from_pretrained = whole_model  # a rank reads its stage's tensors only (stage_load)
    torch.set_num_threads(1)
    init_group("gloo", "127.0.0.1", port, rank, world, 120, secret="test")
    try:
        job(rank, Path(root), out)
    finally:
        leave_group()


def _spawn(job, world: int, root: Path, reference) -> tuple[dict[int, dict], object]:
    """`world` ranks running `job`, while this process computes `reference()`; (results by rank, reference)."""
    from smolforge.cluster.nodes.statedir import free_port

    ctx, port = mp.get_context("spawn"), free_port()
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(job, r, world, port, str(root), out)) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, dict] = {}
    try:
        ref = reference()
        while len(got) < world:
            try:
                rank, res = out.get(timeout=2)
                got[rank] = res
            except queues.Empty:  # a rank that died has nothing to send
                assert all(p.is_alive() or p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    finally:
        for p in procs:
            p.join(60)
    assert [p.exitcode for p in procs] == [0] * world
    return got, ref


@pytest.fixture
def data(tmp_path: Path) -> Path:
    from smolforge.data.synthetic import generate
    from smolforge.models.tiny import preset_dir

    preset_dir("tiny-llama")  # built here, not by several ranks at once
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in generate(60, seed=7)))
    return tmp_path


def _weights(result: dict, name: str = "adapter_model.safetensors") -> dict[str, torch.Tensor]:
    return load_file(str(Path(result["adapter_dir"]) / name))


def _same(a: dict, b: dict, atol: float = 1e-5) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=lambda m: f"{k}: {m}")


def test_two_stages_equal_one_process_lora_and_full_and_resume_exactly(data):
    def reference():  # one process, the pipeline's step: 2 stages x 2 micro-batches of 1 row
        lora, norms = _train(_cfg(data, "one", grad_accum=4))
        full, full_norms = _train(_cfg(data, "one-full", grad_accum=4, **FULL))
        return lora, norms, full, full_norms

    got, (one, one_norms, one_full, one_full_norms) = _spawn(_two, 2, data, reference)
    r0, r1 = got[0], got[1]
    reference_adapter = _weights(one.to_dict())
    # (a) LoRA, GPipe: the adapter, the clipped global norms and the evaluations are one process's
    _same(_weights(r0["whole"]), reference_adapter)
    # ... to the bit: each micro-batch ran at its own width, so the kernels were one process's (padded to
    # the step's width, a micro-batch without padding takes SDPA's masked path, not its causal one: 4e-9 apart)
    _same(_weights(r0["whole"]), reference_adapter, atol=0)
    torch.testing.assert_close(torch.tensor(r0["norms"]), torch.tensor(one_norms), rtol=1e-5, atol=0)
    assert r0["norms"] == r1["norms"]
    assert abs(r0["whole"]["eval"]["eval_loss"] - one.eval["eval_loss"]) < 1e-5
    assert r0["whole"]["eval"].get("accuracy") == one.eval.get("accuracy")
    assert abs(r0["whole"]["final_loss"] - one.final_loss) < 1e-5
    assert r1["whole"]["final_loss"] == r0["whole"]["final_loss"]  # every rank reports the step's loss
    assert r0["whole"]["samples"] == one.samples and r0["whole"]["comm_bytes_sent"] > 0
    # its stages were sized from both ranks' measured nodes; rank 0 stated the plan (the job's event)
    (plan,) = r0["plan"]
    assert not r1["plan"] and len(plan["bounds"]) == 3 and plan["bounds"][0] == 0 and plan["bounds"][-1] == 4, plan
    assert plan["nodes"] == ["rank 0", "rank 1"] and "stage 1:" in plan["message"], plan
    # (c) paused after step 3 and resumed: the uninterrupted run's weights
    assert r0["paused"]["stopped"] == "pause" and r0["paused"]["steps"] == 3
    assert r0["resumed"]["data"]["resumed_from"].endswith("step-3") and r0["resumed"]["steps"] == STEPS
    _same(_weights(r0["resumed"]), _weights(r0["whole"]), atol=1e-6)
    # ... and its checkpoint holds the whole state, keyed as one process keys it: one process resumes it
    single, _ = _train({**_cfg(data, "pp-paused-single", grad_accum=4), "resume": True})
    _same(_weights(single.to_dict()), reference_adapter)
    # (b) full fine-tuning, 1F1B, the tied embedding trained on both end stages
    whole = _weights(r0["full"], "model.safetensors")
    _same(whole, _weights(one_full.to_dict(), "model.safetensors"))
    torch.testing.assert_close(torch.tensor(r0["full_norms"]), torch.tensor(one_full_norms), rtol=1e-5, atol=0)
    # each rank's optimizer held its stage's parameters only
    held = [r0["full"]["optimizer_state_bytes"], r1["full"]["optimizer_state_bytes"]]
    assert max(held) < 0.8 * one_full.optimizer_state_bytes, (held, one_full.optimizer_state_bytes)
    # no rank loaded the whole model (`_rank` forbids from_pretrained); each read its stage's tensors only,
    # the tied embedding on both end stages, and holds its stage's parameters only
    reads = [r["full"]["strategy_metrics"]["stage_read_bytes"] for r in (r0, r1)]
    ckpt = load_file(str(Path(preset_dir("tiny-llama")) / "model.safetensors"))
    whole_bytes = sum(t.numel() * t.element_size() for t in ckpt.values())
    embed_bytes = ckpt["model.embed_tokens.weight"].numel() * ckpt["model.embed_tokens.weight"].element_size()
    assert sum(reads) == whole_bytes + embed_bytes and max(reads) < whole_bytes, (reads, whole_bytes, embed_bytes)
    for r in (r0, r1):
        assert r["held"]["stored"] == r["held"]["stage"], r["held"]
    assert set(r0["held"]["stored"]) & set(r1["held"]["stored"]) == {"model.embed_tokens.weight"}
    # ... at every forward of a run (training, evaluation, its greedy decoding: through the stages)
    for r in (r0, r1):
        stage = r["planned"]["stage"]
        assert [list(s) for s in r["stored"]] == [stage], [sorted(set(s) ^ set(stage)) for s in r["stored"]]
    # the stages' greedy decoding is HF generate's on the same weights (left padding, pad after the end)
    _generates_as_hf(Path(r0["full"]["adapter_dir"]), r0["greedy"])
    assert r1["greedy"] == r0["greedy"]
    # (d) ordinary HF and PEFT directories
    _loads_as_hf(Path(r0["full"]["adapter_dir"]), whole)
    _loads_as_peft(Path(r0["whole"]["adapter_dir"]), Path(one.adapter_dir))


def test_three_stages_lora_1f1b_equal_one_process(data):
    def reference():
        one, norms = _train(_cfg(data, "one3", **{**THREE, "grad_accum": 3}))  # 3 stages x 1 micro-batch of 2 rows
        regrouped, _ = _train(_cfg(data, "one3-regrouped", **{**REGROUPED, "batch_size": 4, "grad_accum": 3}))
        return one, norms, regrouped

    got, (one, one_norms, one_regrouped) = _spawn(_three, 3, data, reference)
    r0 = got[0]
    _same(_weights(r0["result"]), _weights(one.to_dict()))
    torch.testing.assert_close(torch.tensor(r0["norms"]), torch.tensor(one_norms), rtol=1e-5, atol=0)
    assert abs(r0["result"]["eval"]["eval_loss"] - one.eval["eval_loss"]) < 1e-5
    assert [got[r]["result"]["strategy_metrics"]["stage_layers"] for r in range(3)] == [1.0, 2.0, 1.0]
    _same(_weights(r0["regrouped"]), _weights(one_regrouped.to_dict()))
    assert [got[r]["regrouped"]["optimizer_state_bytes"] for r in range(3)][0] == 0  # the first stage trains nothing


def test_a_rank_without_the_model_plans_on_the_config_part_then_reads_only_its_stage_s_part(tmp_path, monkeypatch):
    """A pipeline rank on a node that lacks the model (issue 31): it builds the model on the meta device from
    the config part (config and tokenizer, no tensor), plans its cut from the measured nodes, and only then
    asks `model_part` (the rank glue's fetch) for its stage's part, with the planned bounds and its rank;
    that part's one safetensors file is all it reads, and its stage's tensors are the checkpoint's."""
    import safetensors
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from smolforge.models.partition import cut
    from smolforge.models.stage_costs import NodeCapacity
    from smolforge.models.stage_load import stage_keys, write_stage_part
    from smolforge.models.tiny import preset_dir
    from smolforge.parallel.strategies.pipeline import Pipeline

    whole = Path(preset_dir("tiny-llama"))
    config = write_stage_part(whole, [], None, tmp_path / "config")  # what the runner sent the node
    opened: list[Path] = []
    asked: list[tuple[list[int], int]] = []
    holder = [False]  # the holder's side of the fetch (it writes the part from the whole model) is not the rank's
    real_open = safetensors.safe_open

    def watched(path, *args, **kwargs):
        if not holder[0]:
            opened.append(Path(path))
        return real_open(path, *args, **kwargs)

    def model_part(bounds: list[int], index: int) -> str:  # `stage_parts.PartFetch`, without the network
        asked.append((list(bounds), index))
        holder[0] = True
        try:
            return str(write_stage_part(whole, bounds, index, tmp_path / "part"))
        finally:
            holder[0] = False

    class SecondRank(Pipeline):  # rank 1 of 2, over a group of one: loading has no collective with bounds planned here
        rank, world = 1, 2

        def _measure_nodes(self) -> list[NodeCapacity]:
            return [NodeCapacity(f"w{i}", throughput=1e9, free_memory_bytes=8 << 30) for i in (1, 2)]

    monkeypatch.setattr(safetensors, "safe_open", watched)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded whole"))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        rank = SecondRank()
        rank.model_part = model_part
        net = rank.load_model(str(config), device=torch.device("cpu"), dtype="fp32")
    finally:
        dist.destroy_process_group()
    planned = rank.planned
    assert len(planned) == 3 and planned[0] == 0 and planned[-1] == 4 and asked == [(planned, 1)], (planned, asked)
    part = tmp_path / "part" / "model.safetensors"
    assert part in opened and set(opened) <= {part, config / "model.safetensors"}, opened
    ckpt = load_file(str(whole / "model.safetensors"))
    stored = {n: p for n, p in net.named_parameters() if p.numel()}
    tied = {"lm_head.weight": "model.embed_tokens.weight"}
    assert {tied.get(n, n) for n in stored} == set(stage_keys(whole, planned, 1)), sorted(stored)
    for name, p in stored.items():
        assert torch.equal(p, ckpt[tied.get(name, name)]), name
    assert {id(p) for p in cut(net, planned)[1].parameters()} == {id(p) for p in stored.values()}
    assert rank.read["bytes"] == sum(ckpt[tied.get(n, n)].numel() * 4 for n in stored) <= part.stat().st_size


def _loads_as_hf(directory: Path, weights: dict[str, torch.Tensor]) -> None:
    from transformers import AutoModelForCausalLM

    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"], config
    model = AutoModelForCausalLM.from_pretrained(str(directory))
    state = model.state_dict()
    for name, value in weights.items():
        torch.testing.assert_close(state[name], value, atol=0, rtol=0)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied


def _generates_as_hf(directory: Path, tokens: list[list[int]]) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    with torch.no_grad():
        gen = model.generate(input_ids=PROMPTS, attention_mask=(PROMPTS != 3).long(), max_new_tokens=8,
                             do_sample=False, pad_token_id=3, eos_token_id=2)
    assert gen[:, PROMPTS.shape[1]:].tolist() == tokens


def _loads_as_peft(pipeline_dir: Path, single_dir: Path) -> None:
    """The pipeline's adapter loads with peft onto the base and predicts what one process's does."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from smolforge.models.tiny import preset_dir

    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    logits = []
    for directory in (pipeline_dir, single_dir):
        base = AutoModelForCausalLM.from_pretrained(str(preset_dir("tiny-llama")))
        model = PeftModel.from_pretrained(base, str(directory)).eval()
        with torch.no_grad():
            logits.append(model(input_ids=ids).logits)
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=0)
