"""The `zero1` strategy without a cluster: two gloo ranks (spawned processes) against one process and ddp.

ZeRO-1 is DDP's gradients with AdamW's state split among the ranks: each rank steps the parameters it
owns and broadcasts them. AdamW is elementwise, so the weights are one process's with the global
batch; what changes is memory (each moment held by exactly one rank) and traffic (DDP's all-reduce
plus each rank's broadcast of its own parameters), both counted, not estimated, and checked here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import adapter_weights, assert_same_weights, run_gloo_ranks, tiny_train_cfg, train_dict

pytestmark = pytest.mark.timeout(300)

STEPS = 6
CONTROL = 1024  # bytes of a run's small collectives besides the gradients: a few scalars per step and per eval


def _rank(rank: int, root: Path) -> dict:
    """zero1, then ddp, on the same rows: both runs' summaries."""
    from smolforge.parallel.strategies import make_strategy

    zero1, _ = train_dict(tiny_train_cfg(root, "zero1", STEPS), make_strategy("zero1"))
    ddp, _ = train_dict(tiny_train_cfg(root, "ddp", STEPS), make_strategy("ddp"))
    return {"zero1": zero1.to_dict(), "ddp": ddp.to_dict()}


def _optimizer_tensors(result: dict) -> dict[str, torch.Tensor]:
    """The optimizer state of a run's final checkpoint, flattened to {"index.key": tensor}."""
    path = Path(result["checkpoint_dir"]) / "optim.pt"
    state = torch.load(path, map_location="cpu", weights_only=True)["optimizer"]["state"]
    return {f"{i}.{k}": v for i, s in state.items() for k, v in s.items()}


def test_two_zero1_ranks_equal_one_process_with_half_of_adamw_each(tmp_path):
    from smolforge.data.synthetic import generate
    from smolforge.models.tiny import preset_dir

    preset_dir("tiny-llama")  # built here, not by two ranks at once inside their group
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in generate(60, seed=7)))
    # one process with the group's global batch (2 ranks x 1 row x 2 micro-batches), while the ranks run
    got, (one, _) = run_gloo_ranks(_rank, 2, tmp_path,
                                   meanwhile=lambda: train_dict(tiny_train_cfg(tmp_path, "one", STEPS, batch_size=2)))
    zero1, ddp = [got[r]["zero1"] for r in (0, 1)], [got[r]["ddp"] for r in (0, 1)]
    assert zero1[0]["strategy"] == "zero1" and zero1[0]["steps"] == STEPS
    # the weights: one process's with the global batch, and DDP's
    reference = adapter_weights(one)
    assert_same_weights(adapter_weights(zero1[0]), reference, atol=1e-5)
    assert_same_weights(adapter_weights(zero1[0]), adapter_weights(ddp[0]), atol=1e-6)
    assert abs(zero1[0]["eval"]["eval_loss"] - one.eval["eval_loss"]) < 1e-5
    # memory: DDP holds the whole AdamW state on every rank; zero1 splits it, each moment held exactly once
    full = one.optimizer_state_bytes
    assert [r["optimizer_state_bytes"] for r in ddp] == [full, full] and full > 0
    held = [r["optimizer_state_bytes"] for r in zero1]
    assert sum(held) == full and all(0 < b <= 0.6 * full for b in held), (held, full)
    # ... and a checkpoint still holds the whole state (gathered onto rank 0), the one DDP saves
    assert_same_weights(_optimizer_tensors(zero1[0]), _optimizer_tensors(ddp[0]), atol=1e-6)
    # traffic, counted: DDP all-reduces every LoRA gradient once a step (grad_accum 2: the first
    # micro-batch does not sync), plus a few scalars; zero1 sends exactly that, plus each rank its own
    # parameters once a step, and between them every trainable parameter once a step
    grads = one.trainable_params * 4  # fp32
    for r in ddp:
        assert 0 <= r["comm_bytes_sent"] - STEPS * grads < CONTROL, (r["comm_bytes_sent"], STEPS * grads)
    extra = [z["comm_bytes_sent"] - d["comm_bytes_sent"] for z, d in zip(zero1, ddp)]
    assert sum(extra) == STEPS * grads and all(e > 0 for e in extra), (extra, STEPS * grads)
    assert all(z["checkpoint_bytes_sent"] > 0 for z in zero1)  # its optimizer part and RNG, to rank 0
