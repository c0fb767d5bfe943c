"""Exact resume of `diloco` with a lossy codec (issue 45 item 6): each rank's error-feedback buffer is in the
checkpoint, so ranks resumed from a pause end bitwise equal to the undisturbed run, for int8 and for sparse.

Two gloo ranks (spawned processes, as tests/test_diloco_strategy.py) train tiny-llama's LoRA for three
outer steps of H = 2; the paused run stops after the outer step at 4 and is resumed by a fresh strategy,
model and optimizer (nothing kept in memory). Without the buffers in the checkpoint the resumed run's
next message lacks what the earlier ones could not carry, and its weights differ from the undisturbed run's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import adapter_weights, run_gloo_ranks, tiny_train_cfg, train_dict

pytestmark = pytest.mark.timeout(400)

H, STEPS = 2, 6
CODECS = {"int8": {"codec": "int8", "outer_lr": 1.0, "outer_momentum": 0.5},
          "sparse": {"codec": "sparse", "outer_lr": 1.0, "chunk": 1024, "topk": 16}}  # sparse: no momentum


def _cfg(root: Path, out: str) -> dict:
    return tiny_train_cfg(root, out, STEPS, eval_every=0, eval_accuracy=False, save_every=0)


def _runs(rank: int, root: Path) -> dict:
    """Per codec: the undisturbed run, the run paused after step 3 (it lands on the outer step at 4), and its resume."""
    from smolforge.parallel.strategies import make_strategy

    out = {}
    for name, settings in CODECS.items():
        out[name], _ = train_dict(_cfg(root, name), make_strategy("diloco", {"inner_steps": H, **settings}))
        out[name + "_paused"], _ = train_dict(_cfg(root, name + "_p"), make_strategy("diloco", {"inner_steps": H, **settings}),
                                              pause_after=3)
        out[name + "_resumed"], _ = train_dict({**_cfg(root, name + "_p"), "resume": True},
                                               make_strategy("diloco", {"inner_steps": H, **settings}))
    return {k: v.to_dict() for k, v in out.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from smolforge.data.synthetic import generate
    from smolforge.models.tiny import preset_dir

    root = tmp_path_factory.mktemp("diloco_resume")
    preset_dir("tiny-llama")  # built here, not by two ranks at once
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in generate(40, seed=11)))
    ranks, _ = run_gloo_ranks(_runs, 2, root)
    return ranks


@pytest.mark.parametrize("codec", list(CODECS))
def test_a_resumed_run_with_error_feedback_is_bitwise_the_undisturbed_one(runs, codec):
    paused, resumed, whole = (runs[0][codec + s] for s in ("_paused", "_resumed", ""))
    assert paused["stopped"] == "pause" and paused["steps"] == 2 * H
    # the checkpoint holds each rank's own buffer (they saw different rows: different residuals)
    blob = torch.load(Path(paused["checkpoint_dir"]) / "optim.pt", map_location="cpu", weights_only=True)
    errors = blob["strategy"]["error_feedback"]
    assert len(errors) == 2 and not torch.equal(errors[0], errors[1]) and float(errors[0].abs().max()) > 0
    assert resumed["data"]["resumed_from"].endswith(f"step-{2 * H}") and resumed["steps"] == STEPS
    a, b = adapter_weights(resumed), adapter_weights(whole)
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:3]
    # what each rank sent per outer step is the codec's formula (plus its fp64 token weight), and a few control scalars
    from smolforge.parallel.codecs import make_codec

    per_round = 8 + make_codec(**{"name": codec, **CODECS[codec]}).nbytes(whole["trainable_params"])
    assert 0 <= whole["comm_bytes_sent"] - (STEPS // H) * per_round < 1024, (whole["comm_bytes_sent"], per_round)
    assert resumed["final_loss"] == whole["final_loss"] and runs[1][codec + "_resumed"]["final_loss"] == runs[1][codec]["final_loss"]
