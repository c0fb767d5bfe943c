"""The `fsdp` strategy without a cluster: two gloo ranks (spawned processes) against one process.

What the cluster tests cannot reach cheaply: gradient accumulation, evaluation in the middle of a run
with ranks making different numbers of forwards (uneven eval shards, generation), full fine-tuning
with the unclipped global gradient norm, and an fsdp checkpoint resumed under fsdp, under ddp and by
one process: a checkpoint holds the whole state, keyed as every strategy keys it, and a resuming rank
reads only its shards of it.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from helpers import tiny_train_cfg

STEPS = 6


def _cfg(root: Path, out: str, **kw) -> dict:
    return tiny_train_cfg(root, out, STEPS, **kw)


def _train(cfg: dict, strategy=None, stop_after: int = 0):
    """engine.train; with `stop_after`, rank 0 asks for a pause once that step is done."""
    from smolforge.config import TrainConfig
    from smolforge.train.engine import TrainHooks, train

    norms: list[float] = []

    def should_stop():
        return "pause" if stop_after and len(norms) >= stop_after else None

    hooks = TrainHooks(on_step=lambda info: norms.append(info.grad_norm), should_stop=should_stop)
    return train(TrainConfig.model_validate(cfg), hooks, strategy=strategy), norms


def _rank(rank: int, port: int, root: str, out: mp.Queue) -> None:
    """One of two gloo ranks: fsdp LoRA paused at step 3 and resumed under fsdp and under ddp; full FT."""
    import torch.distributed as dist

    from smolforge.parallel.rendezvous import init_group, leave_group
    from smolforge.parallel.strategies import make_strategy

    torch.set_num_threads(1)
    root_p = Path(root)
    init_group("gloo", "127.0.0.1", port, rank, 2, 120, secret="test")
    try:
        lora = _cfg(root_p, "fsdp")
        paused, _ = _train(lora, make_strategy("fsdp"), stop_after=3)
        if rank == 0:  # the same checkpoint, for ddp and for one process to resume
            for name in ("ddp", "single"):
                shutil.copytree(root_p / "fsdp", root_p / f"from-fsdp-{name}")
        dist.barrier()
        resumed, _ = _train({**lora, "resume": True}, make_strategy("fsdp"))
        by_ddp, _ = _train({**_cfg(root_p, "from-fsdp-ddp"), "resume": True}, make_strategy("ddp"))
        full_ft = dict(peft={"method": "none"}, max_steps=3, max_grad_norm=None, eval_every=0)
        _, norms = _train(_cfg(root_p, "full", **full_ft), make_strategy("fsdp"), stop_after=2)
        dist.barrier()  # rank 0's checkpoint of step 2 is written: both resume from it, each its shards
        full, last = _train({**_cfg(root_p, "full", **full_ft), "resume": True}, make_strategy("fsdp"))
        norms += last
        full_ddp, _ = _train(_cfg(root_p, "full-ddp", **full_ft), make_strategy("ddp"))
        out.put((rank, {"paused": paused.to_dict(), "resumed": resumed.to_dict(), "by_ddp": by_ddp.to_dict(),
                        "full": full.to_dict(), "full_norms": norms, "full_ddp": full_ddp.to_dict()}))
    finally:
        leave_group()


def _adapter(result: dict, name: str = "adapter_model.safetensors") -> dict[str, torch.Tensor]:
    return load_file(str(Path(result["adapter_dir"]) / name))


def _tensor_bytes(path: Path) -> int:
    return sum(t.numel() * t.element_size() for t in load_file(str(path)).values())


def _same(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=lambda m: f"{k}: {m}")


def test_two_fsdp_ranks_equal_one_process_and_their_checkpoints_resume_anywhere(tmp_path):
    import queue as queues

    from smolforge.cluster.nodes.statedir import free_port
    from smolforge.data.synthetic import generate
    from smolforge.models.tiny import preset_dir

    preset_dir("tiny-llama")  # built here, not by two ranks at once inside their group
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in generate(60, seed=7)))
    ctx, port = mp.get_context("spawn"), free_port()
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path), queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:  # one process, the group's global batch (2 ranks x 1 row x 2 micro-batches), while they run
        one, _ = _train(_cfg(tmp_path, "one", batch_size=2))
        full_one, full_norms = _train(_cfg(tmp_path, "full-one", batch_size=2, peft={"method": "none"}, max_steps=3,
                                           max_grad_norm=None, eval_every=0))
        got: dict[int, dict] = {}
        while len(got) < len(procs):
            try:
                rank, res = queue.get(timeout=2)
                got[rank] = res
            except queues.Empty:  # a rank that died has nothing to send
                assert all(p.is_alive() or p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    finally:
        for p in procs:
            p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    r0, r1 = got[0], got[1]
    assert r0["paused"]["stopped"] == "pause" and r0["paused"]["steps"] == 3
    assert r0["resumed"]["data"]["resumed_from"].endswith("step-3") and r0["resumed"]["steps"] == STEPS
    reference = load_file(str(Path(one.adapter_dir) / "adapter_model.safetensors"))
    _same(_adapter(r0["resumed"]), reference, atol=1e-5)  # fsdp, paused and resumed
    _same(_adapter(r0["by_ddp"]), reference, atol=1e-5)  # its checkpoint, resumed by ddp
    single, _ = _train({**_cfg(tmp_path, "from-fsdp-single", batch_size=2), "resume": True})
    _same(load_file(str(Path(single.adapter_dir) / "adapter_model.safetensors")), reference, atol=1e-5)
    # the evaluations ran on whole weights, each rank on its shard of the rows (3 and 2: uneven forwards)
    assert abs(r0["resumed"]["eval"]["eval_loss"] - one.eval["eval_loss"]) < 1e-5
    # each rank holds half of AdamW's state (plus its own step counters)
    for r in (r0, r1):
        assert r["resumed"]["optimizer_state_bytes"] <= 0.6 * one.optimizer_state_bytes
        assert r["resumed"]["comm_bytes_sent"] > 0 and r["resumed"]["checkpoint_bytes_sent"] > 0
    # full fine-tuning: the whole model comes out as one HF directory, DDP's weights; the unclipped norm
    # is global. (Against one process AdamW's first steps amplify summation-order noise in a few
    # elements whose gradient is near zero, for DDP as for FSDP: there the tolerance is looser. Even where
    # tensors lie in memory moves that order: fsdp's ranks hand blocks of 1 MiB and more back to the
    # system (mmap, page-aligned); one element then differed by 2.4e-5.)
    whole = _adapter(r0["full"], "model.safetensors")  # streamed from the shards, tensor by tensor
    config = json.loads((Path(r0["full"]["adapter_dir"]) / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"], config  # not FSDP's class
    _same(whole, _adapter(r0["full_ddp"], "model.safetensors"), atol=1e-6)
    for k, v in load_file(str(Path(full_one.adapter_dir) / "model.safetensors")).items():
        torch.testing.assert_close(whole[k], v, atol=1e-4, rtol=1e-3, msg=lambda m: f"{k}: {m}")
    assert r0["full"]["optimizer_state_bytes"] <= 0.6 * full_one.optimizer_state_bytes
    # Resumed from step 2, each rank read its shards of the checkpoint, not the whole of it (weights and
    # AdamW's moments: every tensor of both files but the step counters, in halves).
    assert r0["full"]["data"]["resumed_from"].endswith("step-2")
    ckpt = tmp_path / "full" / "checkpoints" / "step-2"
    whole = sum(_tensor_bytes(ckpt / name) for name in ("trainable.safetensors", "optim_state.safetensors"))
    for r in (r0, r1):
        assert 0.4 * whole <= r["full"]["checkpoint_bytes_read"] <= 0.6 * whole, (r["full"]["checkpoint_bytes_read"], whole)
    assert r0["full_norms"] == r1["full_norms"] and len(full_norms) == 3
    torch.testing.assert_close(torch.tensor(r0["full_norms"]), torch.tensor(full_norms), rtol=1e-4, atol=0)
